package worker_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
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

// bpCall is one call the fake API got.
type bpCall struct {
	tenant, task string
	at           time.Time
	refused      bool
}

// TestBackpressure_pausesTenantOnEveryWorker: two asynq servers on one Redis (A works
// queue "a", B queue "b"), rule "bp:call tenant=100/1s". The API answers acme's first
// call with 429 and Retry-After: 3, every other call with 200. The handler returns
// worker.Backpressure(resp). Then:
//   - acme's log is paused on every worker until exactly the error's RetryAt, 3s after
//     the 429: acme's tasks enqueued meanwhile on A and on B (one with MaxRetry(0)) are
//     each denied once as paused, and the API sees no call for acme between the 429 and
//     the pause's end (exactly 0), while globex's calls, one per server, go through at
//     once (exactly 2);
//   - after the pause every acme task runs once, the refused one again, and its Retried
//     is still 0 of its MaxRetry 3; the MaxRetry(0) one is replaced by a copy; nothing
//     is archived;
//   - each server counts exactly its own outcomes, A's PausesActive is 1 during the
//     pause and 0 after it, B's stays 0.
func TestBackpressure_pausesTenantOnEveryWorker(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)

	var mu sync.Mutex
	var calls []bpCall
	refusedOnce := false
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		c := bpCall{tenant: r.Header.Get("Tenant"), task: r.Header.Get("Task"), at: time.Now()}
		if c.tenant == "acme" && !refusedOnce {
			refusedOnce, c.refused = true, true
			w.Header().Set("Retry-After", "3")
			w.WriteHeader(http.StatusTooManyRequests)
		}
		calls = append(calls, c)
	}))
	t.Cleanup(api.Close)

	bpErrs := make(chan *worker.BackpressureError, 1)
	completed := map[string]int{} // payload -> successful runs
	handler := func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api.URL, nil)
		req.Header.Set("Tenant", tenant)
		req.Header.Set("Task", string(task.Payload()))
		resp, err := api.Client().Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if err := worker.Backpressure(resp); err != nil {
			var bp *worker.BackpressureError
			if errors.As(err, &bp) {
				bpErrs <- bp
			}
			return fmt.Errorf("call the API: %w", err)
		}
		mu.Lock()
		completed[string(task.Payload())]++
		mu.Unlock()
		return nil
	}
	rules := mustRules(t, "bp:call tenant=100/1s")
	type server struct {
		lim     *throttle.Limiter
		metrics *worker.Metrics
		reg     *prometheus.Registry
	}
	servers := map[string]*server{}
	for _, queue := range []string{"a", "b"} {
		s := &server{lim: newLimiter(t, rdb), reg: prometheus.NewRegistry()}
		m, err := worker.NewMetrics(s.reg)
		if err != nil {
			t.Fatal(err)
		}
		s.metrics = m
		mw, err := worker.New(s.lim, worker.Config{Rules: rules, Redis: rdb, Metrics: m})
		if err != nil {
			t.Fatal(err)
		}
		runAsynq(t, rdb, mw, handler, func(c *asynq.Config) { c.Queues = map[string]int{queue: 1} })
		servers[queue] = s
	}
	client := asynq.NewClientFromRedisClient(rdb)
	t.Cleanup(func() { client.Close() })
	enqueue := func(tenant, name, queue string, maxRetry int) string {
		t.Helper()
		info, err := producer.Enqueue(ctx, client, "bp:call", []byte(name), tenant, asynq.Queue(queue), asynq.MaxRetry(maxRetry),
			asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}

	first := enqueue("acme", "acme/1", "a", 3)
	var bp *worker.BackpressureError
	select {
	case bp = <-bpErrs:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never got the 429")
	}
	if bp.StatusCode != 429 || bp.RetryAfter != 3*time.Second || bp.Header != "3" || bp.Defaulted || bp.Scope != throttle.ScopeTenant {
		t.Fatalf("BackpressureError = %+v; want 429, RetryAfter 3s from Retry-After: 3, the tenant's scope", *bp)
	}
	acme := throttle.Key{TaskType: "bp:call", Tenant: "acme"}
	var until time.Time
	waitUntil(t, 5*time.Second, "acme's log is paused", func() bool {
		u, ok, err := servers["b"].lim.PausedUntil(ctx, acme, throttle.ScopeTenant)
		until = u
		return err == nil && ok
	})
	if want := time.UnixMilli(bp.RetryAt.UnixMilli()); !until.Equal(want) {
		t.Fatalf("acme paused until %s, want the error's RetryAt %s", until.Format(time.RFC3339Nano), want.Format(time.RFC3339Nano))
	}
	if _, ok, _ := servers["a"].lim.PausedUntil(ctx, throttle.Key{TaskType: "bp:call", Tenant: "globex"}, throttle.ScopeTenant); ok {
		t.Fatal("globex is paused too")
	}
	waitUntil(t, time.Second, "A counts its pause", func() bool { return toFloat64(t, servers["a"].metrics.PausesActive) == 1 })
	if got := toFloat64(t, servers["b"].metrics.PausesActive); got != 0 {
		t.Errorf("B's PausesActive = %g during the pause, want 0 (A set it)", got)
	}

	// While paused: acme's tasks on both servers, one with no retry left, and globex's.
	enqueue("acme", "acme/2", "a", 3)
	enqueue("acme", "acme/3", "a", 3)
	enqueue("acme", "acme/4", "b", 3)
	enqueue("acme", "acme/5", "b", 0)
	enqueue("globex", "globex/1", "a", 3)
	enqueue("globex", "globex/2", "b", 3)
	names := []string{"acme/1", "acme/2", "acme/3", "acme/4", "acme/5", "globex/1", "globex/2"}
	waitUntil(t, 20*time.Second, "every task completed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, n := range names {
			if completed[n] == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(300 * time.Millisecond) // a duplicate run, if any, shows up

	mu.Lock()
	var refusedAt time.Time
	inPause := map[string]int{}
	for _, c := range calls {
		if c.refused {
			refusedAt = c.at
		}
	}
	for _, c := range calls {
		if !c.refused && c.at.After(refusedAt) && c.at.Before(until) {
			inPause[c.tenant]++
		}
	}
	for _, n := range names {
		if completed[n] != 1 {
			t.Errorf("task %s completed %d times, want 1", n, completed[n])
		}
	}
	nCalls := len(calls)
	mu.Unlock()
	if inPause["acme"] != 0 || inPause["globex"] != 2 {
		t.Errorf("calls between the 429 and the pause's end: acme %d, globex %d; want 0 and 2", inPause["acme"], inPause["globex"])
	}
	if nCalls != 8 {
		t.Errorf("the API got %d calls, want 8 (7 tasks, acme/1 twice)", nCalls)
	}

	insp := asynq.NewInspectorFromRedisClient(rdb)
	info, err := insp.GetTaskInfo("a", first)
	if err != nil {
		t.Fatal(err)
	}
	if info.State != asynq.TaskStateCompleted || info.Retried != 0 || info.MaxRetry != 3 {
		t.Errorf("acme/1 after its 429: state %s, Retried %d, MaxRetry %d; want completed, 0, 3", info.State, info.Retried, info.MaxRetry)
	}
	for _, q := range []string{"a", "b"} {
		qi, err := insp.GetQueueInfo(q)
		if err != nil {
			t.Fatal(err)
		}
		wantCompleted := map[string]int{"a": 4, "b": 3}[q]
		if qi.Archived != 0 || qi.Completed != wantCompleted || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
			t.Errorf("queue %s: archived %d completed %d pending %d active %d scheduled %d retry %d; want 0 archived, %d completed, nothing left",
				q, qi.Archived, qi.Completed, qi.Pending, qi.Active, qi.Scheduled, qi.Retry, wantCompleted)
		}
	}
	done, err := insp.ListCompletedTasks("b")
	if err != nil {
		t.Fatal(err)
	}
	copies := 0
	for _, ti := range done {
		if ti.Headers[worker.HeaderDeferrals] == "1" && string(ti.Payload) == "acme/5" && ti.MaxRetry == 0 && ti.Retried == 0 {
			copies++
		}
	}
	if copies != 1 {
		t.Errorf("acme/5 (MaxRetry 0) was replaced by %d copies that completed, want 1", copies)
	}

	// A: acme/1 admitted, backpressure, admitted again; acme/2, acme/3 paused once each,
	// then admitted; globex/1 admitted. B: acme/4 and acme/5 paused, then admitted (acme/5
	// as its copy); globex/2 admitted.
	wantA := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 5, worker.OutcomeBackpressure: 1, worker.OutcomePaused: 2})
	wantB := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 3, worker.OutcomePaused: 2})
	for q, want := range map[string]map[string]float64{"a": wantA, "b": wantB} {
		got := outcomes(t, servers[q].metrics, "bp:call")
		// A call stamped a ms before the other server's admission on the same log is
		// decided at that admission's instant (the log's high-water mark) and waits the ms
		// out: an admission counted as waited. Which server's call comes second is a race.
		got[worker.OutcomeAdmitted] += got[worker.OutcomeWaited]
		got[worker.OutcomeWaited] = 0
		if fmtOutcomes(got) != fmtOutcomes(want) {
			t.Errorf("server %s decisions:\n got  %s\n want %s", q, fmtOutcomes(got), fmtOutcomes(want))
		}
		if got := counter(t, servers[q].reg, "asynq_throttle_redis_errors_total", map[string]string{"task_type": "bp:call", "call": worker.CallPause}); got != 0 {
			t.Errorf("server %s: pause errors %g, want 0", q, got)
		}
	}
	waitUntil(t, time.Second, "A's pause is over in PausesActive", func() bool { return toFloat64(t, servers["a"].metrics.PausesActive) == 0 })
}

// TestBackpressure_scopes: the scope paused is the one asked for when the rule has a quota
// there, else the one the rule has; a shadow rule pauses nothing. In each case a task
// whose first run gets a 429 with Retry-After: 2 is re-queued (state retry, Retried 0)
// with the pause in force, then runs again, Retried still 0, counted as one backpressure
// and two admissions.
func TestBackpressure_scopes(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		rule       string
		opts       []worker.BackpressureOption
		wantTenant bool // a pause was written on acme's log
		wantType   bool // on the type's log
	}{
		{name: "Tenant", rule: "s:call tenant=100/1s type=100/1s", wantTenant: true},
		{name: "Type", rule: "s:call tenant=100/1s type=100/1s", opts: []worker.BackpressureOption{worker.BackpressureScope(throttle.ScopeType)}, wantType: true},
		{name: "TenantAskedTypeOnlyRule", rule: "s:call type=100/1s", wantType: true},
		{name: "TypeAskedTenantOnlyRule", rule: "s:call tenant=100/1s", opts: []worker.BackpressureOption{worker.BackpressureScope(throttle.ScopeType)}, wantTenant: true},
		{name: "Shadow", rule: "s:call tenant=100/1s type=100/1s mode=shadow"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			rdb := redistest.Start(t)
			var mu sync.Mutex
			runs, completed := 0, 0
			handler := func(ctx context.Context, task *asynq.Task) error {
				mu.Lock()
				defer mu.Unlock()
				runs++
				status, h := http.StatusOK, http.Header{}
				if runs == 1 {
					status, h = http.StatusTooManyRequests, http.Header{"Retry-After": {"2"}}
				}
				if err := worker.Backpressure(&http.Response{StatusCode: status, Header: h}, tc.opts...); err != nil {
					return err
				}
				completed++
				return nil
			}
			lim := newLimiter(t, rdb)
			m, err := worker.NewMetrics(prometheus.NewRegistry())
			if err != nil {
				t.Fatal(err)
			}
			mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, tc.rule), Redis: rdb, Metrics: m})
			if err != nil {
				t.Fatal(err)
			}
			runAsynq(t, rdb, mw, handler, nil)
			info, err := producer.Enqueue(ctx, asynq.NewClientFromRedisClient(rdb), "s:call", nil, "acme", asynq.MaxRetry(2), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			insp := asynq.NewInspectorFromRedisClient(rdb)
			waitUntil(t, 5*time.Second, "the task is re-queued", func() bool {
				ti, err := insp.GetTaskInfo("default", info.ID)
				return err == nil && ti.State == asynq.TaskStateRetry && ti.Retried == 0
			})
			key := throttle.Key{TaskType: "s:call", Tenant: "acme"}
			_, tenantPaused, err1 := lim.PausedUntil(ctx, key, throttle.ScopeTenant)
			_, typePaused, err2 := lim.PausedUntil(ctx, key, throttle.ScopeType)
			if err1 != nil || err2 != nil || tenantPaused != tc.wantTenant || typePaused != tc.wantType {
				t.Errorf("paused: tenant %v, type %v (%v, %v); want %v, %v", tenantPaused, typePaused, err1, err2, tc.wantTenant, tc.wantType)
			}
			waitUntil(t, 10*time.Second, "the task completed", func() bool { mu.Lock(); defer mu.Unlock(); return completed == 1 })
			// asynq marks the task completed after its handler returns, in a call of its own:
			// wait for that too (CI once read it a moment before, still active).
			var ti *asynq.TaskInfo
			waitUntil(t, 5*time.Second, "asynq records the task completed", func() bool {
				ti, err = insp.GetTaskInfo("default", info.ID)
				return err == nil && ti.State == asynq.TaskStateCompleted
			})
			if ti.Retried != 0 {
				t.Fatalf("task: %+v; want completed with Retried 0", ti)
			}
			want := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 2, worker.OutcomeBackpressure: 1})
			if got := outcomes(t, m, "s:call"); fmtOutcomes(got) != fmtOutcomes(want) {
				t.Errorf("decisions:\n got  %s\n want %s", fmtOutcomes(got), fmtOutcomes(want))
			}
		})
	}
}
