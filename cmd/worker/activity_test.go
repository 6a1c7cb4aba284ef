package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// runTask is one task of key through a's handler, as the middleware calls it when the
// task starts.
func runTask(a *activity, key throttle.Key) {
	h := a.handler("tenant", asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	_ = h.ProcessTask(context.Background(), asynq.NewTaskWithHeaders(key.TaskType, nil, map[string]string{"tenant": key.Tenant}))
}

func TestActivity_take(t *testing.T) {
	t.Parallel()
	a := newActivity()
	ctx := context.Background()
	// decide admits ran tasks (decided, then started: their handlers run) and denies
	// denied ones.
	decide := func(typ, tenant string, ran, denied int) {
		key := throttle.Key{TaskType: typ, Tenant: tenant}
		for range ran {
			a.decided(ctx, nil, key, throttle.Decision{Allowed: true})
			runTask(a, key)
		}
		for range denied {
			a.decided(ctx, nil, key, throttle.Decision{Allowed: false})
		}
	}
	decide("api:call", "globex", 5, 0)
	decide("api:call", "acme", 5, 12)
	decide("email:send", "", 1, 2)
	decide("api:call", "two words", 0, 3)
	decide("api:call", "z"+strings.Repeat("x", 10239), 0, 1) // cut to 64 bytes (internal/quote)
	decide("bad type", "evil\ntenant=acme", 0, 1)            // quoted: the newline stays in the line

	want := []string{
		`api:call tenant="acme" ran=5 throttled=12`,
		`api:call tenant="globex" ran=5 throttled=0`,
		`api:call tenant="two words" ran=0 throttled=3`,
		`api:call tenant="z` + strings.Repeat("x", 63) + `"...(10240 bytes) ran=0 throttled=1`,
		`"bad type" tenant="evil\ntenant=acme" ran=0 throttled=1`,
		`email:send tenant="" ran=1 throttled=2`,
	}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
		t.Errorf("first interval:\n got %q\nwant %q", got, want)
	}
	if got := a.take(20); len(got) != 0 {
		t.Errorf("idle interval: got %q, want no lines", got)
	}
	decide("api:call", "acme", 0, 1)
	if got, want := a.take(20), []string{`api:call tenant="acme" ran=0 throttled=1`}; !reflect.DeepEqual(got, want) {
		t.Errorf("third interval: got %q, want %q", got, want)
	}
}

// TestActivity_takeCapped has 5,000 tenants active in one interval, 3 of them busier than
// the rest: with 3 lines at most, those 3 get a line, sorted by name, and one line sums up
// the other 4,997.
func TestActivity_takeCapped(t *testing.T) {
	t.Parallel()
	a := newActivity()
	ctx := context.Background()
	for i := range 5000 {
		key := throttle.Key{TaskType: "api:call", Tenant: fmt.Sprintf("t%04d", i)}
		runTask(a, key)
		a.decided(ctx, nil, key, throttle.Decision{})
		if i == 4000 || i == 17 || i == 2500 {
			a.decided(ctx, nil, key, throttle.Decision{})
		}
	}
	want := []string{
		`api:call tenant="t0017" ran=1 throttled=2`,
		`api:call tenant="t2500" ran=1 throttled=2`,
		`api:call tenant="t4000" ran=1 throttled=2`,
		`... and 4997 more (task type, tenant) pairs: ran=4997 throttled=4997`,
	}
	if got := a.take(3); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q\nwant %q", got, want)
	}
	// Ties are broken by name: with all equal, the first in name order get the lines.
	for _, tenant := range []string{"c", "a", "b"} {
		runTask(a, throttle.Key{TaskType: "x", Tenant: tenant})
	}
	want = []string{`x tenant="a" ran=1 throttled=0`, `... and 2 more (task type, tenant) pairs: ran=2 throttled=0`}
	if got := a.take(1); !reflect.DeepEqual(got, want) {
		t.Errorf("ties: got %q\nwant %q", got, want)
	}
}

// TestActivity_handler checks that tasks of a type without a rule count as runs (the
// middleware does not decide them) and that handler errors count as failures.
func TestActivity_handler(t *testing.T) {
	t.Parallel()
	a := newActivity()
	fail := errors.New("boom")
	h := a.handler("tenant", asynq.HandlerFunc(func(_ context.Context, task *asynq.Task) error {
		if string(task.Payload()) == "fail" {
			return fail
		}
		return nil
	}))
	ctx := context.Background()
	_ = h.ProcessTask(ctx, acmeTask("ok"))
	_ = h.ProcessTask(ctx, acmeTask("ok"))
	if err := h.ProcessTask(ctx, acmeTask("fail")); !errors.Is(err, fail) {
		t.Errorf("handler error = %v, want %v", err, fail)
	}
	want := []string{`report:build tenant="acme" ran=3 throttled=0 failed=1 last_error="boom"`}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestActivity_handlerRequeuedAtShutdown: once the worker is stopping, a run whose
// handler returns context.Canceled (asynq cancels what still runs at the shutdown
// timeout and puts it back in its queue, no failure counted) counts as requeued, not
// failed; any other error still counts as a failure, and before stop so does a
// cancellation.
func TestActivity_handlerRequeuedAtShutdown(t *testing.T) {
	t.Parallel()
	a := newActivity()
	fail := errors.New("boom")
	h := a.handler("tenant", asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		if string(task.Payload()) == "fail" {
			return fail
		}
		<-ctx.Done()
		return ctx.Err()
	}))
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	_ = h.ProcessTask(canceled, acmeTask("wait")) // before stop: a failure
	a.stop()
	_ = h.ProcessTask(canceled, acmeTask("wait"))
	_ = h.ProcessTask(canceled, acmeTask("wait"))
	_ = h.ProcessTask(context.Background(), acmeTask("fail"))
	want := []string{`report:build tenant="acme" ran=4 throttled=0 failed=2 requeued=2 last_error="boom"`}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestActivity_settle: settle waits for the handlers still running (asynq's Shutdown
// returns before the handlers it canceled do), and gives up after its bound.
func TestActivity_settle(t *testing.T) {
	t.Parallel()
	a := newActivity()
	release := make(chan struct{})
	h := a.handler("tenant", asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		<-release
		return ctx.Err()
	}))
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	a.stop()
	done := make(chan struct{})
	go func() {
		_ = h.ProcessTask(canceled, acmeTask(""))
		close(done)
	}()
	for activityTotal(a) == 0 { // until the run has started
		time.Sleep(time.Millisecond)
	}
	if a.settle(20 * time.Millisecond) {
		t.Error("settle = true while a handler runs, want false after its bound")
	}
	close(release)
	if !a.settle(5 * time.Second) {
		t.Error("settle = false after the handler returned, want true")
	}
	<-done
	if got, want := a.take(20), []string{`report:build tenant="acme" ran=1 throttled=0 requeued=1`}; !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestActivity_outerArchived: a task the middleware ends with asynq.SkipRetry without
// starting its handler (a cost that can never fit, overdue=archive) counts as archived;
// a handler's own SkipRetry is a failed run; a task the middleware re-queues (another
// error, its handler not started) counts as neither (its denial is counted by decided).
func TestActivity_outerArchived(t *testing.T) {
	t.Parallel()
	a := newActivity()
	inner := a.handler("tenant", asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		return fmt.Errorf("handler: bad input: %w", asynq.SkipRetry)
	}))
	mw := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		switch string(task.Payload()) {
		case "reject":
			return fmt.Errorf("worker: rule %q: cost 9 exceeds a limit: %w", "x", asynq.SkipRetry)
		case "requeue":
			return errors.New("worker: throttled")
		}
		return inner.ProcessTask(ctx, task)
	})
	h := a.outer("tenant", mw)
	for _, p := range []string{"reject", "reject", "requeue", "run"} {
		_ = h.ProcessTask(context.Background(), acmeTask(p))
	}
	want := []string{`report:build tenant="acme" ran=1 throttled=0 archived=2 failed=1 last_error="handler: bad input: skip retry for the task"`}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

// acmeTask is a report:build task of tenant "acme" (header "tenant") with payload.
func acmeTask(payload string) *asynq.Task {
	return asynq.NewTaskWithHeaders("report:build", []byte(payload), map[string]string{"tenant": "acme"})
}

// activityTotal is the tasks a counts since its last take.
func activityTotal(a *activity) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, t := range a.counts {
		n += t.total()
	}
	return n
}

func TestAsynqLogger_dropsRevokeWarnings(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := newAsynqLogger(&buf)
	l.Warn("revoke task id=4f1c")
	l.Warn("Retry exhausted for task id=4f1c")
	l.Error("boom")
	out := buf.String()
	if strings.Contains(out, "revoke") || !strings.Contains(out, "asynq: ") ||
		!strings.Contains(out, "WARN: Retry exhausted for task id=4f1c\n") || !strings.Contains(out, "ERROR: boom\n") {
		t.Errorf("logged:\n%s", out)
	}
}

// TestActivity_ranCountsStarts runs 10 tasks of one tenant at once through the real
// middleware, wired as run wires it, under "api:call tenant=5/1m" with a wait in the
// handler of up to 2m: 5 are admitted and start, the other 5 are admitted for the slots
// a window ahead and wait in the middleware. The interval's line says ran=5, not 10 (v1
// counted admissions); when their contexts end before their slots, they never start and
// the next interval counts nothing.
func TestActivity_ranCountsStarts(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rules, err := worker.ParseRules("api:call tenant=5/1m")
	if err != nil {
		t.Fatal(err)
	}
	a := newActivity()
	var decisions atomic.Int32
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, NoReservations: true, MaxWait: 2 * time.Minute,
		SweepInterval: -1, DecisionFunc: func(ctx context.Context, task *asynq.Task, key throttle.Key, d throttle.Decision) {
			a.decided(ctx, task, key, d)
			decisions.Add(1)
		}})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(a.handler("tenant", asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	for range 10 {
		wg.Go(func() { errs <- h.ProcessTask(ctx, producer.NewTask("api:call", nil, "acme")) })
	}
	deadline := time.Now().Add(10 * time.Second)
	for decisions.Load() < 10 || len(errs) < 5 { // all decided, the 5 admitted for now done
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %d decisions, %d tasks done; want 10 and 5", decisions.Load(), len(errs))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got, want := a.take(20), []string{`api:call tenant="acme" ran=5 throttled=0`}; !reflect.DeepEqual(got, want) {
		t.Errorf("interval with 5 tasks waiting for their slots: %q, want %q", got, want)
	}
	cancel() // the 5 waiting give up their slots, a minute ahead, before starting
	wg.Wait()
	close(errs)
	canceled := 0
	for err := range errs {
		if errors.Is(err, context.Canceled) {
			canceled++
		} else if err != nil {
			t.Errorf("task: %v", err)
		}
	}
	if canceled != 5 {
		t.Errorf("%d tasks ended by their context while waiting, want 5", canceled)
	}
	if got := a.take(20); len(got) != 0 {
		t.Errorf("interval after the waiting tasks gave up: %q, want no line", got)
	}
}
