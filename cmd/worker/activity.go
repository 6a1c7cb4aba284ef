package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// activity counts, per (task type, tenant), what happened since the last take: tasks
// that ran (whose handler started: admitted by the limiter, once any wait for a slot a
// little ahead is over, or of a type no rule throttles), tasks throttled (denials), tasks
// the middleware archived without running them (outer: a cost that can never fit or
// cannot be read, overdue=archive), runs whose handler failed, and runs cut short by the
// worker's shutdown (requeued: asynq puts
// a task still running at WORKER_SHUTDOWN_TIMEOUT back in its queue, no failure counted,
// and cancels its context, so that its handler returns context.Canceled). It is safe for
// concurrent use.
type activity struct {
	mu       sync.Mutex
	counts   map[throttle.Key]*tally
	stopping atomic.Bool    // the worker is shutting down (stop)
	running  sync.WaitGroup // runs whose handler has not returned (settle)
}

type tally struct {
	ran, throttled, archived, failed, requeued int
	lastErr                                    string // the latest failed run's error
}

func newActivity() *activity { return &activity{counts: map[throttle.Key]*tally{}} }

// stop says the worker is shutting down: from now on a run whose handler returns
// context.Canceled counts as requeued, not failed. (A task canceled by
// Inspector.CancelProcessing meanwhile, which asynq retries as a failure, counts so too.)
func (a *activity) stop() { a.stopping.Store(true) }

// settle waits until every run's handler has returned, or for at most d, and reports
// whether they all had. asynq's Shutdown puts a task still running at its timeout back in
// its queue and cancels its context, but returns without waiting for its handler, which
// counts the run as requeued only once it returns.
func (a *activity) settle(d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		a.running.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// startedKey is the context key under which outer leaves a flag that handler sets: the
// task's handler started.
type startedKey struct{}

// outer wraps the middleware (mw, whose handler is a.handler's): a task it ends with
// asynq.SkipRetry without starting the handler was archived by the middleware (a cost
// that can never fit or cannot be read, overdue=archive), which no decision and no run
// counts. A handler's own SkipRetry is a failed run, counted by handler.
func (a *activity) outer(tenantHeader string, mw asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		started := new(atomic.Bool)
		err := mw.ProcessTask(context.WithValue(ctx, startedKey{}, started), task)
		if errors.Is(err, asynq.SkipRetry) && !started.Load() {
			a.mu.Lock()
			a.tally(keyOf(task, tenantHeader)).archived++
			a.mu.Unlock()
		}
		return err
	})
}

// keyOf is task's type and its tenant, the value of its header tenantHeader.
func keyOf(task *asynq.Task, tenantHeader string) throttle.Key {
	return throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[tenantHeader]}
}

// tally returns key's tally; a.mu must be held.
func (a *activity) tally(key throttle.Key) *tally {
	t := a.counts[key]
	if t == nil {
		t = &tally{}
		a.counts[key] = t
	}
	return t
}

// decided is the worker.Config.DecisionFunc: it counts a denial as throttled. An
// admission is not a run yet: a task admitted for a slot a little ahead waits for it in
// the middleware first (and may never start, if its context ends meanwhile); handler
// counts it when it starts.
func (a *activity) decided(_ context.Context, _ *asynq.Task, key throttle.Key, d throttle.Decision) {
	if d.Allowed {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.tally(key).throttled++
}

// handler wraps next, which runs inside the throttle middleware, so it is called when the
// task starts: after the middleware admitted it and it waited for its slot, or at once for
// a task that no rule throttles, that a shadow rule runs, or that runs unthrottled
// (FailOpen, overdue=run). It counts the run, and a failed one (or, after stop, one that
// the shutdown cut short: requeued).
func (a *activity) handler(tenantHeader string, next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		key := keyOf(task, tenantHeader)
		a.running.Add(1)
		defer a.running.Done()
		if started, ok := ctx.Value(startedKey{}).(*atomic.Bool); ok {
			started.Store(true)
		}
		a.mu.Lock()
		a.tally(key).ran++
		a.mu.Unlock()
		err := next.ProcessTask(ctx, task)
		if err != nil {
			a.mu.Lock()
			t := a.tally(key)
			if a.stopping.Load() && errors.Is(err, context.Canceled) && ctx.Err() != nil {
				t.requeued++
			} else {
				t.failed++
				t.lastErr = err.Error()
			}
			a.mu.Unlock()
		}
		return err
	})
}

// take returns the lines for the activity counted since the last take, and resets the
// counts: one line per (task type, tenant), sorted by type then tenant,
//
//	api:call tenant="acme" ran=5 throttled=12
//
// with " archived=N" appended when the middleware archived tasks, " failed=N" when runs
// failed, " requeued=N" when the shutdown cut runs short, and last_error="..." after a
// failure (tally.String). The tenant is always quoted (quote.Quote), the task type only if
// it needs it (quote.Name), both cut to quote.MaxBytes (64) with "...(N bytes)" after a
// cut one. If more than maxLines pairs had activity, only the maxLines busiest (most tasks
// counted, tally.total; ties by type then tenant) get a line, and one more line sums up
// the rest:
//
//	... and 4980 more (task type, tenant) pairs: ran=4980 throttled=9960
func (a *activity) take(maxLines int) []string {
	a.mu.Lock()
	counts := a.counts
	a.counts = map[throttle.Key]*tally{}
	a.mu.Unlock()

	keys := make([]throttle.Key, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	byName := func(i, j throttle.Key) bool {
		if i.TaskType != j.TaskType {
			return i.TaskType < j.TaskType
		}
		return i.Tenant < j.Tenant
	}
	var rest tally
	if len(keys) > maxLines {
		sort.Slice(keys, func(i, j int) bool {
			if ti, tj := counts[keys[i]].total(), counts[keys[j]].total(); ti != tj {
				return ti > tj
			}
			return byName(keys[i], keys[j])
		})
		for _, k := range keys[maxLines:] {
			t := counts[k]
			rest.ran, rest.throttled, rest.archived = rest.ran+t.ran, rest.throttled+t.throttled, rest.archived+t.archived
			rest.failed, rest.requeued = rest.failed+t.failed, rest.requeued+t.requeued
		}
		keys = keys[:maxLines:maxLines]
	}
	sort.Slice(keys, func(i, j int) bool { return byName(keys[i], keys[j]) })
	lines := make([]string, 0, len(keys)+1)
	for _, k := range keys {
		lines = append(lines, fmt.Sprintf("%s tenant=%s %s", quote.Name(k.TaskType), quote.Quote(k.Tenant), counts[k]))
	}
	if n := len(counts) - len(keys); n > 0 {
		lines = append(lines, fmt.Sprintf("... and %d more (task type, tenant) pairs: %s", n, &rest))
	}
	return lines
}

// total is every task t counts.
func (t *tally) total() int { return t.ran + t.throttled + t.archived + t.failed + t.requeued }

// String is "ran=R throttled=T", with " archived=A" when A > 0, " failed=F" when F > 0
// and " requeued=Q" when Q > 0, and then, for one (task type, tenant), the latest
// failure's error: ` last_error="..."` (quoted, and cut to quote.MaxErrorBytes, 256), so
// that a failing handler shows why in the log.
func (t *tally) String() string {
	s := fmt.Sprintf("ran=%d throttled=%d", t.ran, t.throttled)
	if t.archived > 0 {
		s += fmt.Sprintf(" archived=%d", t.archived)
	}
	if t.failed > 0 {
		s += fmt.Sprintf(" failed=%d", t.failed)
	}
	if t.requeued > 0 {
		s += fmt.Sprintf(" requeued=%d", t.requeued)
	}
	if t.lastErr != "" {
		s += " last_error=" + quote.QuoteError(t.lastErr)
	}
	return s
}
