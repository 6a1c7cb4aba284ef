package producer_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestNewTask(t *testing.T) {
	t.Parallel()
	payload := []byte(`{"to":"a@example.com"}`)
	task := producer.NewTask("email:send", payload, "acme")
	if task.Type() != "email:send" || string(task.Payload()) != string(payload) {
		t.Errorf("task = %s %q, want email:send %q", task.Type(), task.Payload(), payload)
	}
	if want := map[string]string{producer.TenantHeader: "acme"}; !reflect.DeepEqual(task.Headers(), want) {
		t.Errorf("Headers() = %v, want %v", task.Headers(), want)
	}
}

func TestWithTenant(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		orig    *asynq.Task
		want    map[string]string
		origHdr map[string]string // orig's headers afterwards: unchanged
	}{
		{
			name:    "NoHeaders",
			orig:    asynq.NewTask("api:call", []byte("p")),
			want:    map[string]string{producer.TenantHeader: "globex"},
			origHdr: nil,
		},
		{
			name:    "KeepsOtherHeadersReplacesTenant",
			orig:    asynq.NewTaskWithHeaders("api:call", []byte("p"), map[string]string{"trace": "t1", producer.TenantHeader: "acme"}),
			want:    map[string]string{"trace": "t1", producer.TenantHeader: "globex"},
			origHdr: map[string]string{"trace": "t1", producer.TenantHeader: "acme"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := producer.WithTenant(tc.orig, "globex")
			if got == tc.orig {
				t.Fatal("WithTenant returned its argument, want a copy")
			}
			if got.Type() != "api:call" || string(got.Payload()) != "p" {
				t.Errorf("copy = %s %q, want api:call \"p\"", got.Type(), got.Payload())
			}
			if !reflect.DeepEqual(got.Headers(), tc.want) {
				t.Errorf("copy's Headers() = %v, want %v", got.Headers(), tc.want)
			}
			if !reflect.DeepEqual(tc.orig.Headers(), tc.origHdr) {
				t.Errorf("original's Headers() = %v after WithTenant, want unchanged %v", tc.orig.Headers(), tc.origHdr)
			}

			// Not aliased: writing the copy's headers and payload leaves the original alone.
			got.Headers()["trace"] = "changed"
			got.Payload()[0] = 'X'
			if !reflect.DeepEqual(tc.orig.Headers(), tc.origHdr) {
				t.Errorf("original's Headers() = %v after writing the copy's, want %v", tc.orig.Headers(), tc.origHdr)
			}
			if string(tc.orig.Payload()) != "p" {
				t.Errorf("original's Payload() = %q after writing the copy's, want \"p\"", tc.orig.Payload())
			}
		})
	}
}

func TestNewTask_headersNotSharedBetweenTasks(t *testing.T) {
	t.Parallel()
	a := producer.NewTask("api:call", nil, "acme")
	b := producer.NewTask("api:call", nil, "globex")
	a.Headers()[producer.TenantHeader] = "changed"
	if tenant, _ := producer.Tenant(b); tenant != "globex" {
		t.Errorf("Tenant(b) = %q after writing a's headers, want globex", tenant)
	}
}

func TestTenant(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		task       *asynq.Task
		wantTenant string
		wantOK     bool
	}{
		{name: "Set", task: producer.NewTask("api:call", nil, "acme"), wantTenant: "acme", wantOK: true},
		{name: "SetEmpty", task: producer.NewTask("api:call", nil, ""), wantTenant: "", wantOK: true},
		{name: "NoHeaders", task: asynq.NewTask("api:call", nil), wantOK: false},
		{name: "OtherHeadersOnly", task: asynq.NewTaskWithHeaders("api:call", nil, map[string]string{"trace": "t1"}), wantOK: false},
		{name: "NilTask", task: nil, wantOK: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tenant, ok := producer.Tenant(tc.task)
			if tenant != tc.wantTenant || ok != tc.wantOK {
				t.Errorf("Tenant() = %q, %v, want %q, %v", tenant, ok, tc.wantTenant, tc.wantOK)
			}
		})
	}
}

func TestEnqueue(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	client := asynq.NewClientFromRedisClient(rdb)
	ctx := context.Background()

	info, err := producer.Enqueue(ctx, client, "api:call", []byte(`{"n":1}`), "acme",
		asynq.Queue("critical"), asynq.MaxRetry(3), asynq.TaskID("task-1"))
	if err != nil {
		t.Fatal(err)
	}
	if info.Queue != "critical" || info.State != asynq.TaskStatePending {
		t.Errorf("TaskInfo: queue %q state %v, want critical pending", info.Queue, info.State)
	}

	ins := asynq.NewInspectorFromRedisClient(rdb)
	pending, err := ins.ListPendingTasks("critical")
	if err != nil {
		t.Fatal(err)
	}
	if len(pending) != 1 {
		t.Fatalf("%d pending tasks in queue critical, want 1", len(pending))
	}
	got := pending[0]
	if got.ID != "task-1" || got.Type != "api:call" || string(got.Payload) != `{"n":1}` || got.Queue != "critical" || got.MaxRetry != 3 {
		t.Errorf("pending task = id %q type %q payload %q queue %q max retry %d, want task-1 api:call {\"n\":1} critical 3",
			got.ID, got.Type, got.Payload, got.Queue, got.MaxRetry)
	}
	if want := map[string]string{producer.TenantHeader: "acme"}; !reflect.DeepEqual(got.Headers, want) {
		t.Errorf("pending task headers = %v, want %v", got.Headers, want)
	}
	if queues, err := ins.Queues(); err != nil || !reflect.DeepEqual(queues, []string{"critical"}) {
		t.Errorf("Queues() = %v, %v, want [critical]", queues, err)
	}

	// A second task with the same ID: asynq's error, wrapped.
	_, err = producer.Enqueue(ctx, client, "api:call", nil, "acme", asynq.Queue("critical"), asynq.TaskID("task-1"))
	if !errors.Is(err, asynq.ErrTaskIDConflict) {
		t.Fatalf("Enqueue with a taken task ID: error = %v, want asynq.ErrTaskIDConflict", err)
	}
	if want := `producer: enqueue api:call for tenant "acme": `; !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error = %q, want prefix %q", err, want)
	}
}

// TestEnqueue_invalidTask: a tenant (or another header, or the task type) that is not
// valid UTF-8, which asynq would refuse with only "cannot encode message", and a tenant
// longer than throttle.MaxTenantBytes, which the workers would archive, are refused
// before anything is sent, by an ErrInvalidTask error that names the header. A tenant of
// exactly MaxTenantBytes is enqueued.
func TestEnqueue_invalidTask(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	client := asynq.NewClientFromRedisClient(rdb)
	ctx := context.Background()
	long := strings.Repeat("x", throttle.MaxTenantBytes+1)
	tests := []struct {
		taskType, tenant, want string
	}{
		{"api:call", "bad\xffbyte",
			`producer: invalid task: api:call: header "tenant" holds "bad\xffbyte", which is not valid UTF-8 and which asynq cannot encode`},
		{"api:call", long, `producer: invalid task: api:call: header "tenant" holds a tenant of 1025 bytes, ` +
			`more than throttle.MaxTenantBytes (1024): workers would archive the task`},
		{"api:\xfe", "acme", `producer: invalid task: task type "api:\xfe" is not valid UTF-8, which asynq cannot encode`},
	}
	for _, tc := range tests {
		info, err := producer.Enqueue(ctx, client, tc.taskType, nil, tc.tenant)
		if err == nil || err.Error() != tc.want || !errors.Is(err, producer.ErrInvalidTask) || info != nil {
			t.Errorf("Enqueue(%q, tenant %.20q) = %v, %v\nwant nil, %s (ErrInvalidTask)", tc.taskType, tc.tenant, info, err, tc.want)
		}
	}
	other := asynq.NewTaskWithHeaders("api:call", nil, map[string]string{"trace": "\xc3(", "tenant": "acme"})
	if err, want := producer.CheckTask(other, producer.TenantHeader), `producer: invalid task: api:call: header "trace" holds "\xc3(", `+
		`which is not valid UTF-8 and which asynq cannot encode`; err == nil || err.Error() != want {
		t.Errorf("CheckTask(header trace) = %v, want %s", err, want)
	}
	if n, err := rdb.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Errorf("Redis holds %d keys (%v) after refused enqueues, want 0", n, err)
	}
	if _, err := producer.Enqueue(ctx, client, "api:call", nil, long[:throttle.MaxTenantBytes]); err != nil {
		t.Errorf("Enqueue with a tenant of MaxTenantBytes: %v", err)
	}
}
