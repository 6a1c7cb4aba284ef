package producer_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// clock is a settable NowFunc.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

func (c *clock) set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

// t0 is midnight UTC of a day the tests count enqueues over.
var t0 = time.Date(2026, 3, 2, 0, 0, 0, 0, time.UTC)

func tenantQuota(events int, window time.Duration) throttle.Quota {
	return throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: events, Window: window}}
}

// newEnqueuer returns an Enqueuer on rdb with quotas for taskType and the clock c.
func newEnqueuer(t *testing.T, rdb redis.UniversalClient, c *clock, taskType string, qs ...throttle.Quota) *producer.Enqueuer {
	t.Helper()
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{
		Quotas: map[string][]throttle.Quota{taskType: qs}, Redis: rdb, NowFunc: c.now,
	})
	if err != nil {
		t.Fatal(err)
	}
	return enq
}

// pendingByTenant counts queue's pending tasks by the value of header.
func pendingByTenant(t *testing.T, rdb redis.UniversalClient, queue, header string) map[string]int {
	t.Helper()
	ins := asynq.NewInspectorFromRedisClient(rdb)
	n := map[string]int{}
	for page := 1; ; page++ {
		tasks, err := ins.ListPendingTasks(queue, asynq.PageSize(5000), asynq.Page(page))
		if errors.Is(err, asynq.ErrQueueNotFound) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, ti := range tasks {
			n[ti.Headers[header]]++
		}
		if len(tasks) < 5000 {
			return n
		}
	}
}

// wantQuotaError fails t unless err is a *QuotaError equal to want, matched by
// errors.Is(err, ErrQuotaExceeded).
func wantQuotaError(t *testing.T, err error, want producer.QuotaError) {
	t.Helper()
	var qe *producer.QuotaError
	if !errors.As(err, &qe) {
		t.Fatalf("error = %v, want a *producer.QuotaError", err)
	}
	if !errors.Is(err, producer.ErrQuotaExceeded) {
		t.Errorf("errors.Is(%v, ErrQuotaExceeded) = false", err)
	}
	if !qe.RetryAt.Equal(want.RetryAt) {
		t.Errorf("RetryAt = %s, want %s", qe.RetryAt, want.RetryAt)
	}
	got := *qe
	got.RetryAt, want.RetryAt = time.Time{}, time.Time{}
	if got != want {
		t.Errorf("QuotaError = %+v, want %+v", got, want)
	}
}

// The case: 10,000 tasks per tenant per day. The 10,001st of the day is refused
// with the exact wait until the day's first leaves the window; other tenants, and the
// workers' own keys, are untouched.
func TestEnqueuer_refusesThe10001stTaskOfTheDay(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	c := &clock{t: t0}
	day := tenantQuota(10000, 24*time.Hour)
	enq := newEnqueuer(t, rdb, c, "report:build", day)
	ctx := context.Background()

	// 10,000 tasks, one every 5s from midnight: the last at 13:53:15.
	for i := range 10000 {
		c.set(t0.Add(time.Duration(i) * 5 * time.Second))
		if _, err := enq.Enqueue(ctx, "report:build", nil, "acme"); err != nil {
			t.Fatalf("task %d of the day: %v", i+1, err)
		}
	}

	// 20:00: the 10,001st waits until midnight, when the first is 24h old.
	c.set(t0.Add(20 * time.Hour))
	_, err := enq.Enqueue(ctx, "report:build", []byte("10001"), "acme")
	wantQuotaError(t, err, producer.QuotaError{TaskType: "report:build", Tenant: "acme", Quota: day,
		RetryAfter: 4 * time.Hour, RetryAt: t0.Add(24 * time.Hour)})
	var qe *producer.QuotaError
	if errors.As(err, &qe) && qe.RetryAfterSeconds() != 14400 {
		t.Errorf("RetryAfterSeconds() = %d, want 14400", qe.RetryAfterSeconds())
	}
	if want := `producer: report:build for tenant "acme" over enqueue quota tenant=10000/24h, retry after 4h0m0s`; err.Error() != want {
		t.Errorf("error = %q, want %q", err, want)
	}

	// Another tenant has its own day.
	if _, err := enq.Enqueue(ctx, "report:build", nil, "globex"); err != nil {
		t.Fatalf("globex at 20:00: %v", err)
	}
	if got, want := pendingByTenant(t, rdb, "default", producer.TenantHeader), map[string]int{"acme": 10000, "globex": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by tenant = %v, want %v (the refused task not enqueued)", got, want)
	}

	// 1ms before midnight: still full, 1ms to wait (a Retry-After of 1s).
	c.set(t0.Add(24*time.Hour - time.Millisecond))
	_, err = enq.Enqueue(ctx, "report:build", nil, "acme")
	wantQuotaError(t, err, producer.QuotaError{TaskType: "report:build", Tenant: "acme", Quota: day,
		RetryAfter: time.Millisecond, RetryAt: t0.Add(24 * time.Hour)})
	if errors.As(err, &qe) && qe.RetryAfterSeconds() != 1 {
		t.Errorf("RetryAfterSeconds() = %d, want 1", qe.RetryAfterSeconds())
	}

	// Midnight: the first task of the previous day left the window; one more fits, and
	// the next waits for the second (enqueued at 00:00:05) to leave.
	c.set(t0.Add(24 * time.Hour))
	if _, err := enq.Enqueue(ctx, "report:build", nil, "acme"); err != nil {
		t.Fatalf("acme at midnight: %v", err)
	}
	_, err = enq.Enqueue(ctx, "report:build", nil, "acme")
	wantQuotaError(t, err, producer.QuotaError{TaskType: "report:build", Tenant: "acme", Quota: day,
		RetryAfter: 5 * time.Second, RetryAt: t0.Add(24*time.Hour + 5*time.Second)})

	// The counts live under the enqueue prefix only: no worker key was written, and a
	// worker's limiter on the same Redis, task type and tenant starts from nothing.
	keys, err := rdb.Keys(ctx, "throttle:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"throttle:enqueue:{report:build}:tenant:acme", "throttle:enqueue:{report:build}:tenant:globex"}; !sameSet(keys, want) {
		t.Errorf("throttle keys = %q, want %q", keys, want)
	}
	if got := enq.RedisKey("report:build", "acme", throttle.ScopeTenant); got != "throttle:enqueue:{report:build}:tenant:acme" {
		t.Errorf("RedisKey = %q", got)
	}
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	d, err := lim.AllowAt(ctx, throttle.Request{Key: throttle.Key{TaskType: "report:build", Tenant: "acme"},
		Quotas: []throttle.Quota{tenantQuota(1, 24*time.Hour)}}, t0.Add(24*time.Hour))
	if err != nil || !d.Allowed || d.Count != 1 {
		t.Errorf("worker limiter after 10,001 enqueues: %+v, %v; want allowed with count 1", d, err)
	}
}

func sameSet(a, b []string) bool {
	m := map[string]int{}
	for _, s := range a {
		m[s]++
	}
	for _, s := range b {
		m[s]--
	}
	for _, n := range m {
		if n != 0 {
			return false
		}
	}
	return true
}

// A type-wide quota is shared by all tenants; a task must fit every quota, names the
// first that is full, waits until all have room, and a refusal takes no slot.
func TestEnqueuer_severalQuotas(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	c := &clock{t: t0}
	perTenant := tenantQuota(2, time.Minute)
	perType := throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 4, Window: time.Hour}}
	enq := newEnqueuer(t, rdb, c, "api:call", perTenant, perType)
	ctx := context.Background()
	at := func(d time.Duration) time.Time { return t0.Add(d) }

	steps := []struct {
		at     time.Duration
		tenant string
		want   *producer.QuotaError // nil: enqueued
	}{
		{0, "acme", nil},
		{time.Second, "acme", nil},
		{2 * time.Second, "globex", nil},
		// acme's own quota is full, the type's is not: until acme's first is 1m old.
		{10 * time.Second, "acme", &producer.QuotaError{Quota: perTenant, RetryAfter: 50 * time.Second, RetryAt: at(time.Minute)}},
		{10 * time.Second, "initech", nil},
		// The type's quota is full (4): until its first is 1h old.
		{11 * time.Second, "initech", &producer.QuotaError{Quota: perType, RetryAfter: time.Hour - 11*time.Second, RetryAt: at(time.Hour)}},
		// Both are full for acme: it waits until both have room, and names the type's
		// hour, which holds it back that long (the minute has room from 01:00).
		{20 * time.Second, "acme", &producer.QuotaError{Quota: perType, RetryAfter: time.Hour - 20*time.Second, RetryAt: at(time.Hour)}},
		// Only the type's is full for acme now.
		{time.Minute, "acme", &producer.QuotaError{Quota: perType, RetryAfter: time.Hour - time.Minute, RetryAt: at(time.Hour)}},
		// The refusals took no slot: at 01:00 the type's first (00:00:00) has left, one fits.
		{time.Hour, "acme", nil},
		{time.Hour, "initech", &producer.QuotaError{Quota: perType, RetryAfter: time.Second, RetryAt: at(time.Hour + time.Second)}},
	}
	for i, s := range steps {
		c.set(at(s.at))
		_, err := enq.Enqueue(ctx, "api:call", nil, s.tenant)
		if s.want == nil {
			if err != nil {
				t.Fatalf("step %d (%s at +%s): %v, want enqueued", i+1, s.tenant, s.at, err)
			}
			continue
		}
		want := *s.want
		want.TaskType, want.Tenant = "api:call", s.tenant
		wantQuotaError(t, err, want)
	}

	// Task types without quotas are not checked and write no key.
	for range 5 {
		if _, err := enq.Enqueue(ctx, "email:send", nil, "acme"); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := rdb.Exists(ctx, enq.RedisKey("email:send", "acme", throttle.ScopeTenant)).Result(); err != nil || n != 0 {
		t.Errorf("email:send's key exists: %d, %v", n, err)
	}
	if got, want := pendingByTenant(t, rdb, "default", producer.TenantHeader), map[string]int{"acme": 8, "globex": 1, "initech": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by tenant = %v, want %v", got, want)
	}
}

// The same asynq.TaskID is checked once: a retried enqueue takes no second slot, and
// asynq then reports the duplicate.
func TestEnqueuer_taskIDIsOneSlot(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	c := &clock{t: t0}
	q := tenantQuota(2, time.Hour)
	enq := newEnqueuer(t, rdb, c, "api:call", q)
	ctx := context.Background()

	if _, err := enq.Enqueue(ctx, "api:call", nil, "acme", asynq.TaskID("order-1")); err != nil {
		t.Fatal(err)
	}
	c.set(t0.Add(time.Second))
	_, err := enq.Enqueue(ctx, "api:call", nil, "acme", asynq.TaskID("order-1"))
	if !errors.Is(err, asynq.ErrTaskIDConflict) || errors.Is(err, producer.ErrQuotaExceeded) {
		t.Fatalf("same task id again: %v, want asynq.ErrTaskIDConflict", err)
	}
	if want := `producer: enqueue api:call for tenant "acme": `; !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error = %q, want prefix %q", err, want)
	}
	if _, err := enq.Enqueue(ctx, "api:call", nil, "acme", asynq.TaskID("order-2")); err != nil {
		t.Fatalf("second task id: %v (the repeated check must not have taken a slot)", err)
	}
	_, err = enq.Enqueue(ctx, "api:call", nil, "acme", asynq.TaskID("order-3"))
	wantQuotaError(t, err, producer.QuotaError{TaskType: "api:call", Tenant: "acme", Quota: q,
		RetryAfter: time.Hour - time.Second, RetryAt: t0.Add(time.Hour)})
}

// The tenant is read from, and written to, the configured header; a task without it
// counts against the tenant "", as the workers count it.
func TestEnqueuer_tenantHeader(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	c := &clock{t: t0}
	q := tenantQuota(1, time.Minute)
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{
		TenantHeader: "x-org", Quotas: map[string][]throttle.Quota{"api:call": {q}}, Redis: rdb, NowFunc: c.now,
	})
	if err != nil {
		t.Fatal(err)
	}
	if enq.TenantHeader() != "x-org" {
		t.Errorf("TenantHeader() = %q", enq.TenantHeader())
	}
	ctx := context.Background()
	if _, err := enq.Enqueue(ctx, "api:call", nil, "acme"); err != nil {
		t.Fatal(err)
	}
	// Tagged with the default header only: that is not x-org, so tenant "".
	if _, err := enq.EnqueueTask(ctx, producer.NewTask("api:call", nil, "acme")); err != nil {
		t.Fatal(err)
	}
	_, err = enq.EnqueueTask(ctx, asynq.NewTask("api:call", nil))
	wantQuotaError(t, err, producer.QuotaError{TaskType: "api:call", Tenant: "", Quota: q,
		RetryAfter: time.Minute, RetryAt: t0.Add(time.Minute)})
	_, err = enq.EnqueueTask(ctx, enq.NewTask("api:call", nil, "acme"))
	wantQuotaError(t, err, producer.QuotaError{TaskType: "api:call", Tenant: "acme", Quota: q,
		RetryAfter: time.Minute, RetryAt: t0.Add(time.Minute)})
	if got, want := pendingByTenant(t, rdb, "default", "x-org"), map[string]int{"acme": 1, "": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by x-org = %v, want %v", got, want)
	}
}

// A quota that cannot be checked refuses nothing and enqueues nothing: the error is not
// a QuotaError (a web handler answers 503, not 429).
// TestEnqueuer_invalidTask: a task whose tenant (in the Enqueuer's own header) is not
// valid UTF-8 is refused by Check and EnqueueTask before the quota check, with an
// ErrInvalidTask error naming the header: it takes no slot of its quota and enqueues
// nothing.
func TestEnqueuer_invalidTask(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{TenantHeader: "org",
		Quotas: map[string][]throttle.Quota{"api:call": {tenantQuota(5, time.Minute)}}, Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	want := `producer: invalid task: api:call: header "org" holds "caf\xe9", which is not valid UTF-8 and which asynq cannot encode`
	if _, err := enq.Enqueue(ctx, "api:call", nil, "caf\xe9"); err == nil || err.Error() != want || !errors.Is(err, producer.ErrInvalidTask) {
		t.Errorf("Enqueue = %v\nwant %s (ErrInvalidTask)", err, want)
	}
	if err := enq.Check(ctx, enq.NewTask("api:call", nil, "caf\xe9")); err == nil || err.Error() != want {
		t.Errorf("Check = %v\nwant %s", err, want)
	}
	if n, err := rdb.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Errorf("Redis holds %d keys (%v) after refused enqueues, want 0: no slot taken, nothing enqueued", n, err)
	}
}

func TestEnqueuer_limiterDown(t *testing.T) {
	t.Parallel()
	queueRedis := redistest.Start(t)
	quotaSrv := redistest.StartServer(t)
	quotaRedis := quotaSrv.Client()
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(queueRedis), producer.EnqueuerConfig{
		Quotas: map[string][]throttle.Quota{"api:call": {tenantQuota(5, time.Minute)}}, Redis: quotaRedis,
	})
	if err != nil {
		t.Fatal(err)
	}
	quotaSrv.Stop()
	_, err = enq.Enqueue(context.Background(), "api:call", nil, "acme")
	if err == nil || errors.Is(err, producer.ErrQuotaExceeded) {
		t.Fatalf("error = %v, want a Redis error that is not ErrQuotaExceeded", err)
	}
	if want := `producer: enqueue quota of api:call for tenant "acme": throttle: allow api:call for tenant "acme": `; !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error = %q, want prefix %q", err, want)
	}
	if got := pendingByTenant(t, queueRedis, "default", producer.TenantHeader); len(got) != 0 {
		t.Errorf("pending tasks = %v, want none", got)
	}
}

// The README's web handler: 202 until the tenant's quota is full, then 429 with the
// exact Retry-After in whole seconds, rounded up.
func TestReportHandler(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	c := &clock{t: t0}
	enq := newEnqueuer(t, rdb, c, "report:build", tenantQuota(2, time.Minute))
	srv := httptest.NewServer(reportHandler(enq))
	defer srv.Close()

	post := func(tenant string) (int, string, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"month":"2026-02"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-Tenant", tenant)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, resp.Header.Get("Retry-After"), string(body)
	}
	type reply struct {
		code       int
		retryAfter string
	}
	steps := []struct {
		at     time.Duration
		tenant string
		want   reply
	}{
		{0, "acme", reply{http.StatusAccepted, ""}},
		{0, "acme", reply{http.StatusAccepted, ""}},
		{0, "acme", reply{http.StatusTooManyRequests, "60"}},
		{0, "globex", reply{http.StatusAccepted, ""}},
		{30*time.Second + 500*time.Millisecond, "acme", reply{http.StatusTooManyRequests, "30"}}, // 29.5s, rounded up
		{time.Minute, "acme", reply{http.StatusAccepted, ""}},
	}
	for i, s := range steps {
		c.set(t0.Add(s.at))
		code, ra, body := post(s.tenant)
		if got := (reply{code, ra}); got != s.want {
			t.Errorf("step %d (%s at +%s): %d Retry-After %q, want %d %q; body %q", i+1, s.tenant, s.at, code, ra, s.want.code, s.want.retryAfter, body)
		}
		if code == http.StatusTooManyRequests && !strings.HasPrefix(body, `producer: report:build for tenant "acme" over enqueue quota tenant=2/1m, retry after `) {
			t.Errorf("step %d: 429 body = %q", i+1, body)
		}
	}
	if got, want := pendingByTenant(t, rdb, "default", producer.TenantHeader), map[string]int{"acme": 3, "globex": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by tenant = %v, want %v", got, want)
	}
}

func TestNewEnqueuer_errors(t *testing.T) {
	t.Parallel()
	client := asynq.NewClientFromRedisClient(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})) // never dialled
	q := tenantQuota(5, time.Minute)
	tests := []struct {
		name   string
		client *asynq.Client
		cfg    producer.EnqueuerConfig
		want   string
	}{
		{name: "NilClient", cfg: producer.EnqueuerConfig{}, want: "producer: NewEnqueuer: nil asynq.Client"},
		{name: "NoRedis", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": {q}}},
			want: "producer: NewEnqueuer: EnqueuerConfig.Redis is nil; enqueue quotas need a Redis"},
		{name: "EmptyType", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"": {q}}},
			want: "producer: enqueue quotas for an empty task type"},
		{name: "EmptyList", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": nil}},
			want: `producer: task type "api:call": empty list of enqueue quotas`},
		{name: "BadLimit", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": {q, tenantQuota(0, time.Hour)}}},
			want: `producer: task type "api:call": enqueue quota 2: throttle: limit 0/1h: events must be at least 1, got 0`},
		{name: "BadScope", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": {{Limit: q.Limit}}}},
			want: `producer: task type "api:call": enqueue quota 1: throttle: quota Scope(0)=5/1m: scope must be ScopeTenant or ScopeType`},
		{name: "SameScopeAndWindow", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": {q, tenantQuota(3, time.Minute)}}},
			want: `producer: task type "api:call": enqueue quotas tenant=5/1m and tenant=3/1m have the same scope and window; keep one`},
		{name: "BadPrefix", client: client, cfg: producer.EnqueuerConfig{Quotas: map[string][]throttle.Quota{"api:call": {q}}, Redis: redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), Prefix: "a{b}"},
			want: `producer: NewEnqueuer: throttle: prefix "a{b}:enqueue" must not contain '{' or '}': they would move the Redis Cluster hash tag`},
		{name: "EnqueuePrefix", client: client, cfg: producer.EnqueuerConfig{Prefix: "throttle:enqueue"},
			want: `producer: NewEnqueuer: EnqueuerConfig.Prefix: producer: prefix "throttle:enqueue": its last ':'-separated segment is "enqueue", which enqueue quotas put after the workers' prefix ("<prefix>:enqueue:{<task type>}:..."): a worker's keys under it would be enqueue quotas' keys; choose another`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			enq, err := producer.NewEnqueuer(tc.client, tc.cfg)
			if err == nil || err.Error() != tc.want {
				t.Fatalf("NewEnqueuer error = %v, want %s", err, tc.want)
			}
			if enq != nil {
				t.Errorf("NewEnqueuer returned %v with its error", enq)
			}
		})
	}
}

// TestCheckPrefix: a workers' prefix whose last ':'-separated segment is "enqueue" is
// refused, because its keys would be those of another prefix's enqueue quotas (shown
// below with the keys of both); any other prefix is accepted.
func TestCheckPrefix(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"throttle", "myapp:throttle", "enqueued", "enqueue:x", "throttle:enqueuer", "throttle:enqueue:x", "x-enqueue"} {
		if err := producer.CheckPrefix(p); err != nil {
			t.Errorf("CheckPrefix(%q) = %v, want nil", p, err)
		}
	}
	for _, p := range []string{"throttle:enqueue", "enqueue", "a:b:enqueue"} {
		want := `producer: prefix "` + p + `": its last ':'-separated segment is "enqueue", which enqueue quotas put after the workers' prefix ` +
			`("<prefix>:enqueue:{<task type>}:..."): a worker's keys under it would be enqueue quotas' keys; choose another`
		if err := producer.CheckPrefix(p); err == nil || err.Error() != want {
			t.Errorf("CheckPrefix(%q) = %v\nwant %s", p, err, want)
		}
	}

	// Why: a limiter with the prefix "throttle:enqueue" (as a worker would build it) names
	// the very keys of the enqueue quotas of the prefix "throttle".
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{
		Quotas: map[string][]throttle.Quota{"api:call": {tenantQuota(5, time.Minute)}}, Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	lim, err := throttle.New(rdb, throttle.Config{Prefix: "throttle:enqueue"})
	if err != nil {
		t.Fatal(err)
	}
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	if got, enqKey := lim.RedisKey(key, throttle.ScopeTenant), enq.RedisKey("api:call", "acme", throttle.ScopeTenant); got != enqKey ||
		got != "throttle:enqueue:{api:call}:tenant:acme" {
		t.Errorf("worker key %q, enqueue key %q: want both throttle:enqueue:{api:call}:tenant:acme", got, enqKey)
	}
}

func TestEnqueuer_prefixAndNoQuotas(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	client := asynq.NewClientFromRedisClient(rdb)
	enq, err := producer.NewEnqueuer(client, producer.EnqueuerConfig{Prefix: "myapp",
		Quotas: map[string][]throttle.Quota{"api:call": {tenantQuota(5, time.Minute)}}, Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := enq.RedisKey("api:call", "a/b{c}", throttle.ScopeTenant), "myapp:enqueue:{api:call}:tenant:a%2Fb%7Bc%7D"; got != want {
		t.Errorf("RedisKey = %q, want %q", got, want)
	}
	if got, want := enq.RedisKey("api:call", "", throttle.ScopeType), "myapp:enqueue:{api:call}:type"; got != want {
		t.Errorf("RedisKey = %q, want %q", got, want)
	}
	if got := enq.Quotas("api:call"); !reflect.DeepEqual(got, []throttle.Quota{tenantQuota(5, time.Minute)}) {
		t.Errorf("Quotas = %v", got)
	}

	plain, err := producer.NewEnqueuer(client, producer.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if plain.TenantHeader() != producer.TenantHeader || plain.Quotas("api:call") != nil || plain.RedisKey("api:call", "acme", throttle.ScopeTenant) != "" {
		t.Errorf("Enqueuer without quotas: header %q, quotas %v, key %q", plain.TenantHeader(), plain.Quotas("api:call"), plain.RedisKey("api:call", "acme", throttle.ScopeTenant))
	}
	if _, err := plain.EnqueueTask(context.Background(), nil); err == nil || err.Error() != "producer: enqueue a nil task" {
		t.Errorf("EnqueueTask(nil) = %v, want producer: enqueue a nil task", err)
	}
	// No quota: Check sends nothing to the (unreachable) Redis.
	if err := plain.Check(context.Background(), plain.NewTask("api:call", nil, "acme")); err != nil {
		t.Errorf("Check without quotas = %v, want nil", err)
	}
}

func TestQuotaError_RetryAfterSeconds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		d    time.Duration
		want int64
	}{
		{time.Millisecond, 1}, {999 * time.Millisecond, 1}, {time.Second, 1}, {1001 * time.Millisecond, 2},
		{4 * time.Hour, 14400}, {24 * time.Hour, 86400},
	} {
		if got := (&producer.QuotaError{RetryAfter: tc.d}).RetryAfterSeconds(); got != tc.want {
			t.Errorf("RetryAfterSeconds(%s) = %d, want %d", tc.d, got, tc.want)
		}
	}
}

func TestParseQuotas(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in      string
		want    []throttle.Quota
		wantErr string
	}{
		{in: "tenant=10000/24h", want: []throttle.Quota{tenantQuota(10000, 24*time.Hour)}},
		{in: "  tenant=100/1m   tenant=10000/24h type=1000000/24h ", want: []throttle.Quota{
			tenantQuota(100, time.Minute), tenantQuota(10000, 24*time.Hour),
			{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 1000000, Window: 24 * time.Hour}}}},
		{in: "", wantErr: `producer: quotas "": no quota; want e.g. tenant=10000/24h`},
		{in: "10000/24h", wantErr: `producer: quotas "10000/24h": "10000/24h": want scope=events/window, with no space around '=', e.g. tenant=10000/24h`},
		{in: "tenant = 5/1s", wantErr: `producer: quotas "tenant = 5/1s": "tenant": want scope=events/window, with no space around '=', e.g. tenant=10000/24h`},
		{in: "api:call tenant=5/1s", wantErr: `producer: quotas "api:call tenant=5/1s": "api:call": want scope=events/window; quotas name no task type ` +
			`(the enqueuer applies them to the task type they are given for), e.g. tenant=10000/24h`},
		{in: "org=5/1s", wantErr: `producer: quotas "org=5/1s": "org=5/1s": unknown scope "org"; want tenant or type`},
		{in: "tenant=5/1d", wantErr: `producer: quotas "tenant=5/1d": "tenant=5/1d": throttle: limit "5/1d": window "1d" is not a Go duration such as 2s, 1m or 1h`},
		{in: "tenant=0/1h", wantErr: `producer: quotas "tenant=0/1h": "tenant=0/1h": throttle: limit "0/1h": events must be at least 1, got 0`},
		{in: "tenant=5/1h tenant=3/60m", wantErr: `producer: quotas "tenant=5/1h tenant=3/60m": tenant=5/1h and tenant=3/1h have the same scope and window; keep one`},
	}
	for _, tc := range tests {
		got, err := producer.ParseQuotas(tc.in)
		if tc.wantErr != "" {
			if err == nil || err.Error() != tc.wantErr {
				t.Errorf("ParseQuotas(%q) error = %v, want %s", tc.in, err, tc.wantErr)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseQuotas(%q) = %v, %v, want %v", tc.in, got, err, tc.want)
		}
	}
}
