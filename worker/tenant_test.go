package worker_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestMissingTenant runs, through a real asynq server under "t:call tenant=2/1m", one
// task without a tenant header and one with an empty one: as Config.TenantHeader
// documents, both count against the tenant "", one bucket, which is then full; a tagged
// task has a bucket of its own.
func TestMissingTenant(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rules := mustRules(t, "t:call tenant=2/1m")
	var mu sync.Mutex
	var seen []throttle.Key
	var counts []int // Decision.Count of the tenant "" admissions
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb,
		DecisionFunc: func(_ context.Context, _ *asynq.Task, key throttle.Key, d throttle.Decision) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, key)
			if key.Tenant == "" && d.Allowed {
				counts = append(counts, d.Count)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error { return nil }, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	tasks := []*asynq.Task{
		asynq.NewTask("t:call", []byte("untagged")),                                             // no header at all
		asynq.NewTaskWithHeaders("t:call", []byte("other header"), map[string]string{"x": "y"}), // headers, not the tenant
		producer.NewTask("t:call", []byte("empty"), ""),                                         // tenant header, empty
		producer.NewTask("t:call", []byte("acme"), "acme"),
	}
	// The first three share the bucket "", limit 2: only two of them may be admitted.
	// Run the two that must fit first, then check the third is denied by the full bucket.
	for _, i := range []int{0, 2, 3} {
		if _, err := client.Enqueue(tasks[i], asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 10*time.Second, "3 tasks completed", func() bool { return queueInfo(insp).Completed == 3 })

	// zcard counts the admissions in a tenant's log: with reservations on, a denied task
	// may also hold a reservation entry there.
	zcard := func(tenant string) int {
		return len(admissions(t, rdb, lim.RedisKey(throttle.Key{TaskType: "t:call", Tenant: tenant}, throttle.ScopeTenant)))
	}
	if n := zcard(""); n != 2 {
		t.Errorf("bucket of tenant \"\" (%s) holds %d admissions, want 2 (untagged and empty header)",
			lim.RedisKey(throttle.Key{TaskType: "t:call"}, throttle.ScopeTenant), n)
	}
	if n := zcard("acme"); n != 1 {
		t.Errorf("bucket of acme holds %d admissions, want 1", n)
	}
	mu.Lock()
	sort.Ints(counts)
	if len(counts) != 2 || counts[0] != 1 || counts[1] != 2 {
		t.Errorf("tenant \"\" admissions saw counts %v, want [1 2]: one shared window", counts)
	}
	mu.Unlock()

	// The bucket "" is full: a task with other headers but no tenant is denied, and stays
	// waiting (retry), not run.
	info, err := client.Enqueue(tasks[1], asynq.Retention(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the third untagged task is denied", func() bool {
		ti, err := insp.GetTaskInfo("default", info.ID)
		return err == nil && ti.State == asynq.TaskStateRetry
	})
	ti, err := insp.GetTaskInfo("default", info.ID)
	if err != nil {
		t.Fatal(err)
	}
	if ti.Retried != 0 || ti.LastErr == "" {
		t.Errorf("denied task: Retried %d, LastErr %q; want 0 and a denial", ti.Retried, ti.LastErr)
	}
	if n := zcard(""); n != 2 {
		t.Errorf("after a denial the bucket \"\" holds %d, want 2", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, k := range seen {
		if k.TaskType != "t:call" || (k.Tenant != "" && k.Tenant != "acme") {
			t.Errorf("decision for key %+v, want tenant \"\" or acme", k)
		}
	}
}

// TestCustomTenantHeader calls the middleware directly: with TenantHeader "org" the
// tenant comes from "org", not from producer.TenantHeader; a task without "org" counts
// against "" even if it has a "tenant" header.
func TestCustomTenantHeader(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	var got []string
	mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "c:call tenant=5/1m"), Redis: rdb, TenantHeader: "org",
		DecisionFunc: func(_ context.Context, _ *asynq.Task, key throttle.Key, _ throttle.Decision) {
			got = append(got, key.Tenant)
		}})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := mw(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if d, ok := worker.DecisionFrom(ctx); !ok || !d.Allowed {
			t.Errorf("handler ran without an admission: %+v, %v", d, ok)
		}
		ran++
		return nil
	}))
	ctx := context.Background()
	for _, headers := range []map[string]string{
		{"org": "acme", "tenant": "globex"},
		{"org": "acme"},
		{"tenant": "globex"}, // no org: tenant ""
		{"org": ""},
	} {
		if err := h.ProcessTask(ctx, asynq.NewTaskWithHeaders("c:call", nil, headers)); err != nil {
			t.Fatalf("ProcessTask(%v): %v", headers, err)
		}
	}
	if want := []string{"acme", "acme", "", ""}; len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] || got[3] != want[3] {
		t.Errorf("tenants decided %q, want %q", got, want)
	}
	if ran != 4 {
		t.Errorf("handler ran %d times, want 4", ran)
	}
	for tenant, want := range map[string]int{"acme": 2, "": 2, "globex": 0} {
		if n := len(logEntries(t, rdb, lim.RedisKey(throttle.Key{TaskType: "c:call", Tenant: tenant}, throttle.ScopeTenant))); n != want {
			t.Errorf("bucket %q holds %d, want %d", tenant, n, want)
		}
	}
}

// TestTenantTooLong: a task whose tenant is longer than throttle.MaxTenantBytes (here
// 1 MB) can never be decided: the middleware rejects it (asynq.SkipRetry: archived, not
// retried), counts it as rejected, and its error and its one log line show the tenant
// cut to its first 64 bytes, with its length: neither holds the megabyte.
func TestTenantTooLong(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}}))
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "t:call tenant=5/1s"), Redis: rdb,
		Metrics: metrics, Logger: logger, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	tenant := strings.Repeat("x", 1<<20)
	err = h.ProcessTask(context.Background(), producer.NewTask("t:call", nil, tenant))

	x64 := strings.Repeat("x", 64)
	want := `worker: rule "t:call tenant=5/1s": throttle: invalid request: t:call for tenant "` + x64 +
		`"...(1048576 bytes): tenant of 1048576 bytes, more than MaxTenantBytes (1024): skip retry for the task`
	if err == nil || err.Error() != want || !errors.Is(err, asynq.SkipRetry) || !errors.Is(err, throttle.ErrInvalid) {
		t.Errorf("err = %v\nwant %s (asynq.SkipRetry, throttle.ErrInvalid)", err, want)
	}
	if ran != 0 {
		t.Errorf("handler ran %d times, want 0", ran)
	}
	wantLog := `level=ERROR msg="throttle: task can never run under its rule; archiving it" task_id="" task_type=t:call tenant="` +
		x64 + `...(1048576 bytes)" rule="t:call tenant=5/1s" err="throttle: invalid request: t:call for tenant \"` + x64 +
		`\"...(1048576 bytes): tenant of 1048576 bytes, more than MaxTenantBytes (1024)"` + "\n"
	if logs.String() != wantLog {
		t.Errorf("log (%d bytes):\n%.600s\nwant\n%s", logs.Len(), logs.String(), wantLog)
	}
	if got, want := outcomes(t, metrics, "t:call"), wantOutcomes(map[string]float64{worker.OutcomeRejected: 1}); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
}
