package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// activity counts, per (task type, tenant), what happened since the last take: tasks
// that ran (admitted by the limiter, or of a type no rule throttles), tasks throttled
// (denied), and runs whose handler failed. It is safe for concurrent use.
type activity struct {
	mu     sync.Mutex
	counts map[throttle.Key]*tally
}

type tally struct{ ran, throttled, failed int }

func newActivity() *activity { return &activity{counts: map[throttle.Key]*tally{}} }

// tally returns key's tally; a.mu must be held.
func (a *activity) tally(key throttle.Key) *tally {
	t := a.counts[key]
	if t == nil {
		t = &tally{}
		a.counts[key] = t
	}
	return t
}

// decided is the worker.Config.DecisionFunc: it counts an admission as a run and a
// denial as throttled.
func (a *activity) decided(_ context.Context, _ *asynq.Task, key throttle.Key, d throttle.Decision) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t := a.tally(key)
	if d.Allowed {
		t.ran++
	} else {
		t.throttled++
	}
}

// handler wraps next, which runs inside the throttle middleware: it counts as runs the
// tasks that no rule throttles (decided never sees them), and counts failed runs.
func (a *activity) handler(tenantHeader string, next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		key := throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[tenantHeader]}
		if _, throttled := worker.DecisionFrom(ctx); !throttled {
			a.mu.Lock()
			a.tally(key).ran++
			a.mu.Unlock()
		}
		err := next.ProcessTask(ctx, task)
		if err != nil {
			a.mu.Lock()
			a.tally(key).failed++
			a.mu.Unlock()
		}
		return err
	})
}

// take returns one line per (task type, tenant) counted since the last take, sorted by
// type then tenant, and resets the counts:
//
//	api:call tenant=acme ran=5 throttled=12
//
// with " failed=N" appended when a run failed. A tenant that is empty or has spaces,
// quotes or unprintable characters is quoted.
func (a *activity) take() []string {
	a.mu.Lock()
	counts := a.counts
	a.counts = map[throttle.Key]*tally{}
	a.mu.Unlock()

	keys := make([]throttle.Key, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i].TaskType != keys[j].TaskType {
			return keys[i].TaskType < keys[j].TaskType
		}
		return keys[i].Tenant < keys[j].Tenant
	})
	lines := make([]string, len(keys))
	for i, k := range keys {
		t := counts[k]
		lines[i] = fmt.Sprintf("%s tenant=%s ran=%d throttled=%d", k.TaskType, quoteIfNeeded(k.Tenant), t.ran, t.throttled)
		if t.failed > 0 {
			lines[i] += fmt.Sprintf(" failed=%d", t.failed)
		}
	}
	return lines
}

// quoteIfNeeded returns s as is if it is a non-empty run of printable non-space
// characters without quotes, else strconv.Quote(s).
func quoteIfNeeded(s string) string {
	if s == "" || strings.ContainsFunc(s, func(r rune) bool {
		return r == '"' || r == ' ' || !strconv.IsPrint(r)
	}) {
		return strconv.Quote(s)
	}
	return s
}
