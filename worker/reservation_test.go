package worker_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// This file runs reserved tasks through a real asynq server: the middleware's defaults
// (reservations, in-handler waits up to MaxWait and never past the deadline, WakeLead)
// and WrapConfig's RetryDelayFunc.

// resvCall is one run of the handler chain (the throttle middleware and the handler) for
// a task, seen from a middleware placed outside the throttle's.
type resvCall struct {
	begin, end time.Time
	err        error // what the chain returned
	ctxErr     error // ctx.Err() when it returned: non-nil if it waited until its deadline
}

// resvDecision is one decision of the limiter for a task, and the local time right after
// it, before the middleware reads its clock to compute a DeniedError's RetryAt.
type resvDecision struct {
	seen time.Time
	d    throttle.Decision
}

// resvRecorder records, per task id, every chain run, every decision and every
// successful handler run with its admission instant.
type resvRecorder struct {
	mu        sync.Mutex
	calls     map[string][]resvCall
	decisions map[string][]resvDecision
	starts    []time.Time    // DecisionFrom(ctx).At of every handler run
	done      map[string]int // handler runs per task id
}

func (r *resvRecorder) requeues(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.calls[id] {
		if errors.Is(c.err, throttle.ErrDenied) {
			n++
		}
	}
	return n
}

func (r *resvRecorder) callsOf(id string) []resvCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls[id])
}

func (r *resvRecorder) decisionsOf(id string) []resvDecision {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.decisions[id])
}

func (r *resvRecorder) completed() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.done {
		n += c
	}
	return n
}

// resvRule is the rule of every test here: one tenant quota on task type "resv:call".
func resvRule(events int, window time.Duration) worker.Rule {
	return worker.Rule{TaskType: "resv:call", Quotas: []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: events, Window: window}}}}
}

// resvStart runs an asynq server of the test's own on rdb (through worker.WrapConfig,
// forwarder every 100ms, idle poll ~50ms, concurrency workers) whose handler chain is a recording middleware,
// then the throttle middleware New(lim, cfg) with cfg.Rules = rule, then a handler that
// records its admission. It stops the server at cleanup.
func resvStart(t *testing.T, rdb *redis.Client, lim *throttle.Limiter, rule worker.Rule, cfg worker.Config, concurrency int) *resvRecorder {
	t.Helper()
	rec := &resvRecorder{calls: map[string][]resvCall{}, decisions: map[string][]resvDecision{}, done: map[string]int{}}
	cfg.Rules, cfg.Redis = []worker.Rule{rule}, rdb
	cfg.DecisionFunc = func(ctx context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
		seen := time.Now()
		id, _ := asynq.GetTaskID(ctx)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		rec.decisions[id] = append(rec.decisions[id], resvDecision{seen: seen, d: d})
	}
	throttleMW, err := worker.New(lim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	handler := asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		d, ok := worker.DecisionFrom(ctx)
		if !ok || !d.Allowed {
			return fmt.Errorf("handler ran without an admission: %+v", d)
		}
		id, _ := asynq.GetTaskID(ctx)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		rec.starts = append(rec.starts, d.At)
		rec.done[id]++
		return nil
	})
	chain := throttleMW(handler)
	outer := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		begin := time.Now()
		err := chain.ProcessTask(ctx, task)
		call := resvCall{begin: begin, end: time.Now(), err: err, ctxErr: ctx.Err()}
		id, _ := asynq.GetTaskID(ctx)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		rec.calls[id] = append(rec.calls[id], call)
		return err
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{
		Concurrency:              concurrency,
		Queues:                   map[string]int{"default": 1},
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          2 * time.Second,
		LogLevel:                 asynq.FatalLevel,
	}))
	if err := srv.Start(outer); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return rec
}

// resvEnqueue enqueues a "resv:call" task for tenant "acme" with the given id.
func resvEnqueue(t *testing.T, client *asynq.Client, id string, opts ...asynq.Option) {
	t.Helper()
	task := producer.NewTask("resv:call", nil, "acme", append([]asynq.Option{asynq.TaskID(id)}, opts...)...)
	if _, err := client.Enqueue(task); err != nil {
		t.Fatalf("enqueue %s: %v", id, err)
	}
}

// resvWaitDone waits (at most timeout) until the handler ran n times and the default
// queue holds nothing pending, active, scheduled or retrying, so that no run can follow.
func resvWaitDone(t *testing.T, rdb *redis.Client, rec *resvRecorder, n int, timeout time.Duration) {
	t.Helper()
	insp := asynq.NewInspectorFromRedisClient(rdb)
	deadline := time.Now().Add(timeout)
	for {
		qi, err := insp.GetQueueInfo("default")
		if rec.completed() >= n && err == nil && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %d of %d handler runs, queue %+v (%v)", timeout, rec.completed(), n, qi, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// resvFill takes the whole of rule's window for tenant "acme" now, as another worker
// would, and returns the admission.
func resvFill(t *testing.T, lim *throttle.Limiter, rule worker.Rule) throttle.Decision {
	t.Helper()
	d, err := lim.Allow(context.Background(), throttle.Request{Key: throttle.Key{TaskType: rule.TaskType, Tenant: "acme"},
		Quotas: rule.Quotas, Cost: rule.Quotas[0].Limit.Events})
	if err != nil || !d.Allowed {
		t.Fatalf("fill the window: %+v, %v", d, err)
	}
	return d
}

// TestMiddleware_reservationsDenyOnce: 20 tasks of one tenant under tenant=5/1s with the
// default Config, on 20 asynq workers. Every task runs exactly once, no task is re-queued more than once (the
// reservations spread them over the next seconds instead of waking them all together),
// and the handler starts fill, but never exceed, 5 in any 1s window.
func TestMiddleware_reservationsDenyOnce(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rec := resvStart(t, rdb, lim, resvRule(5, time.Second), worker.Config{}, 20)
	client := asynq.NewClientFromRedisClient(rdb)
	var ids []string
	for i := 1; i <= 20; i++ {
		ids = append(ids, fmt.Sprintf("burst-%02d", i))
		resvEnqueue(t, client, ids[i-1])
	}
	resvWaitDone(t, rdb, rec, 20, 15*time.Second)

	rec.mu.Lock()
	defer rec.mu.Unlock()
	requeued, waited := 0, 0
	for _, id := range ids {
		if n := rec.done[id]; n != 1 {
			t.Errorf("task %s ran %d times, want 1", id, n)
		}
		denials := 0
		for _, c := range rec.calls[id] {
			if errors.Is(c.err, throttle.ErrDenied) {
				denials++
			} else if c.err != nil {
				t.Errorf("task %s: chain returned %v", id, c.err)
			}
		}
		if denials > 1 {
			t.Errorf("task %s was re-queued %d times, want at most once: %+v", id, denials, rec.calls[id])
		}
		requeued += denials
		for _, dec := range rec.decisions[id] {
			if !dec.d.Allowed && !dec.d.Reserved {
				t.Errorf("task %s: denied without a reservation: %+v", id, dec.d)
			}
		}
		if len(rec.decisions[id]) > 1 {
			waited++
		}
	}
	if got := throttle.MaxInWindow(rec.starts, time.Second); got != 5 {
		t.Errorf("most handler starts in a 1s window = %d, want 5 (the limit, reached)", got)
	}
	// All 20 start at once on 20 workers: the last five are reserved ~3s ahead, beyond
	// the default MaxWait, so the re-queue path is taken.
	if requeued == 0 {
		t.Errorf("no task was re-queued: the test did not exercise WakeLead")
	}
	t.Logf("20 tasks: %d denied at least once, %d re-queues", waited, requeued)
}

// TestMiddleware_maxWait: a task whose reserved slot is ~2s away (tenant=1/2s, the window
// just filled) is re-queued, with RetryAt = now + RetryAfter - WakeLead, and comes back to
// be admitted for its instant and wait out the rest in its handler: within MaxWait 300ms if
// WakeLead is 200ms; with MaxWait 3s and the default WakeLead, it still is re-queued first
// (a newcomer waits in its handler at most NewcomerWait), then claims its reservation.
func TestMiddleware_maxWait(t *testing.T) {
	t.Parallel()
	rule := resvRule(1, 2*time.Second)
	t.Run("Requeued", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		lim, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			t.Fatal(err)
		}
		const lead = 200 * time.Millisecond
		rec := resvStart(t, rdb, lim, rule, worker.Config{MaxWait: 300 * time.Millisecond, WakeLead: lead}, 10)
		fill := resvFill(t, lim, rule)
		resvEnqueue(t, asynq.NewClientFromRedisClient(rdb), "b")
		resvWaitDone(t, rdb, rec, 1, 15*time.Second)

		calls, decs := rec.callsOf("b"), rec.decisionsOf("b")
		if len(calls) != 2 || len(decs) < 2 || len(decs) > 3 {
			t.Fatalf("task b: %d chain runs, %d decisions; want 2 runs (re-queued once) and 2 or 3 decisions (denied, "+
				"perhaps denied again on its return before its instant, admitted): %+v %+v", len(calls), len(decs), calls, decs)
		}
		first := decs[0].d
		var denied *throttle.DeniedError
		if !errors.As(calls[0].err, &denied) {
			t.Fatalf("first run of b returned %v, want a *throttle.DeniedError", calls[0].err)
		}
		reservedAt := fill.At.Add(2 * time.Second)
		if first.Allowed || !first.Reserved || !first.RetryAt().Equal(reservedAt) || denied.RetryAfter != first.RetryAfter {
			t.Errorf("first decision %+v (RetryAt %v), DeniedError.RetryAfter %v; want reserved at %v, the fill + 2s",
				first, first.RetryAt(), denied.RetryAfter, reservedAt)
		}
		// RetryAt is the middleware's clock, read between the decision and the return, plus
		// RetryAfter less WakeLead.
		lo, hi := decs[0].seen.Add(first.RetryAfter-lead), calls[0].end.Add(first.RetryAfter-lead)
		if denied.RetryAt.Before(lo) || denied.RetryAt.After(hi) {
			t.Errorf("RetryAt %s, want now + RetryAfter %v - WakeLead %v: in [%s, %s]",
				denied.RetryAt.Format("15:04:05.000"), first.RetryAfter, lead, lo.Format("15:04:05.000"), hi.Format("15:04:05.000"))
		}
		// Back (never before RetryAt rounded up to a second), it is admitted, or, before
		// its instant, waits out the rest in the handler: at most WakeLead < MaxWait.
		if len(decs) == 3 {
			if back := decs[1]; back.seen.Before(calls[0].end) || back.d.Allowed || !back.d.Reserved ||
				!back.d.RetryAt().Equal(reservedAt) || back.d.RetryAfter > lead {
				t.Errorf("second decision %+v, want a denial still reserved at %v, at most WakeLead %v away", back.d, reservedAt, lead)
			}
		}
		last := decs[len(decs)-1]
		if calls[1].err != nil || !last.d.Allowed || last.d.At.Before(reservedAt) || last.seen.Before(denied.RetryAt) {
			t.Errorf("second run returned %v, decision %+v; want an admission at or after %v", calls[1].err, last.d, reservedAt)
		}
	})
	t.Run("BackForItsReservationWaitsInHandler", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		lim, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			t.Fatal(err)
		}
		rec := resvStart(t, rdb, lim, rule, worker.Config{MaxWait: 3 * time.Second}, 10)
		fill := resvFill(t, lim, rule)
		resvEnqueue(t, asynq.NewClientFromRedisClient(rdb), "b")
		resvWaitDone(t, rdb, rec, 1, 15*time.Second)

		// Denied for the first time, with its slot ~2s away (more than NewcomerWait), b is
		// re-queued, although MaxWait is 3s: it holds no worker while it waits.
		calls, decs := rec.callsOf("b"), rec.decisionsOf("b")
		if len(calls) != 2 || len(decs) != 2 {
			t.Fatalf("task b: runs %+v, decisions %+v; want a re-queue, then one run admitted for its reservation", calls, decs)
		}
		reservedAt := fill.At.Add(2 * time.Second)
		var denied *throttle.DeniedError
		if d := decs[0].d; d.Allowed || d.Held || !d.Reserved || !d.RetryAt().Equal(reservedAt) || !errors.As(calls[0].err, &denied) {
			t.Errorf("first decision %+v, run error %v; want a new reservation at %v and a re-queue", d, calls[0].err, reservedAt)
		}
		// Back WakeLead early for the reservation it holds, it is admitted for its instant
		// (Delay) and waits the rest in the handler: one decision, no denial.
		if d := decs[1].d; !d.Allowed || !d.Held || !d.At.Equal(reservedAt) || d.Delay <= 0 || d.Delay > worker.DefaultWakeLead {
			t.Errorf("second decision %+v, want an admission for its reservation at %v, Delay in (0, WakeLead]", d, reservedAt)
		}
		if calls[1].err != nil || calls[1].end.Before(reservedAt) {
			t.Errorf("second run returned %v at %v; want success after %v", calls[1].err, calls[1].end, reservedAt)
		}
	})
}

// TestMiddleware_waitNeverPastDeadline: a task with asynq.Timeout(1s) (asynq keeps
// timeouts in whole seconds) whose slot is ~2s away is re-queued at once rather than wait
// past its deadline, although MaxWait (the default) would allow the wait; it runs later.
func TestMiddleware_waitNeverPastDeadline(t *testing.T) {
	t.Parallel()
	rule := resvRule(1, 2*time.Second)
	rdb := redistest.Start(t)
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rec := resvStart(t, rdb, lim, rule, worker.Config{}, 10)
	fill := resvFill(t, lim, rule)
	resvEnqueue(t, asynq.NewClientFromRedisClient(rdb), "b", asynq.Timeout(time.Second))
	resvWaitDone(t, rdb, rec, 1, 15*time.Second)

	calls, decs := rec.callsOf("b"), rec.decisionsOf("b")
	if len(calls) < 2 || len(decs) < 2 {
		t.Fatalf("task b: runs %+v, decisions %+v; want a re-queue, then a run", calls, decs)
	}
	if d := decs[0].d; d.Allowed || !d.Reserved || d.RetryAfter > worker.DefaultMaxWait {
		t.Fatalf("first decision %+v, want a reserved denial within MaxWait %v", d, worker.DefaultMaxWait)
	}
	if !errors.Is(calls[0].err, throttle.ErrDenied) || calls[0].ctxErr != nil {
		t.Errorf("first run returned %v with ctx.Err() %v; want a DeniedError before the deadline, not a wait", calls[0].err, calls[0].ctxErr)
	}
	last := decs[len(decs)-1].d
	if !last.Allowed || last.At.Before(fill.At.Add(2*time.Second)) {
		t.Errorf("last decision %+v, want an admission at or after the slot %v", last, fill.At.Add(2*time.Second))
	}
	var trail []string
	for _, c := range calls {
		var d *throttle.DeniedError
		if errors.As(c.err, &d) {
			trail = append(trail, fmt.Sprintf("RetryAfter %v, RetryAt %+v from the return", d.RetryAfter, d.RetryAt.Sub(c.end).Round(time.Millisecond)))
		}
	}
	t.Logf("task b: %d runs, %d re-queues before it ran: %q", len(calls), rec.requeues("b"), trail)
}

// TestRetryDelayFunc_reservedDenial: the delay WrapConfig's RetryDelayFunc returns for a
// DeniedError brings now+delay onto RetryAt rounded up to a whole second, the instant
// asynq stores (it truncates to whole seconds), so the task never comes back before
// RetryAt; other errors go to the fallback.
func TestRetryDelayFunc_reservedDenial(t *testing.T) {
	t.Parallel()
	f := worker.RetryDelayFunc(func(int, error, *asynq.Task) time.Duration { return 42 * time.Second })
	task := producer.NewTask("resv:call", nil, "acme")
	ceil := func(tm time.Time) time.Time {
		if s := tm.Truncate(time.Second); !s.Equal(tm) {
			return s.Add(time.Second)
		}
		return tm
	}
	now := time.Now()
	for _, retryAt := range []time.Time{
		now.Add(300 * time.Millisecond),
		now.Add(1750 * time.Millisecond),
		now.Add(2 * time.Second).Truncate(time.Second),                      // a whole second
		now.Add(2 * time.Second).Truncate(time.Second).Add(time.Nanosecond), // just after one
		now.Add(90 * time.Second),
	} {
		err := fmt.Errorf("process: %w", &throttle.DeniedError{RetryAfter: time.Second, RetryAt: retryAt})
		before := time.Now()
		d := f(3, err, task)
		after := time.Now()
		want := ceil(retryAt)
		// The function read its clock between before and after.
		if before.Add(d).After(want) || after.Add(d).Before(want) {
			t.Errorf("RetryAt %s: delay %v lands in [%s, %s], want on %s",
				retryAt.Format("15:04:05.000000000"), d, before.Add(d).Format("15:04:05.000000000"),
				after.Add(d).Format("15:04:05.000000000"), want.Format("15:04:05.000000000"))
		}
		if stored := time.Unix(after.Add(d).Unix(), 0); stored.Before(retryAt) {
			t.Errorf("RetryAt %s: asynq would store %s, before RetryAt", retryAt.Format("15:04:05.000"), stored.Format("15:04:05.000"))
		}
	}
	past := &throttle.DeniedError{RetryAfter: time.Millisecond, RetryAt: time.Now().Add(-3 * time.Second)}
	if d := f(0, past, task); d != 0 {
		t.Errorf("RetryAt 3s ago: delay %v, want 0", d)
	}
	if d := f(0, errors.New("boom"), task); d != 42*time.Second {
		t.Errorf("another error: delay %v, want the fallback's 42s", d)
	}
}
