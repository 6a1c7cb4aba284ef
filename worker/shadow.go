package worker

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// OutcomeShadowDenied counts, in Metrics.Decisions, the tasks that a shadow rule
// (ModeShadow) would have held back (denied, or rejected for their cost) and that ran
// anyway. A shadow rule's admissions count as OutcomeAdmitted, and a task it ran because
// the limiter could not answer as OutcomeFailedOpen.
const OutcomeShadowDenied = "shadow_denied"

// shadowLogInterval is the least time between two log lines of would-be denials of one
// task type; the lines between are counted in the next.
const shadowLogInterval = time.Second

// shadow decides a task under a shadow rule and runs it, whatever the decision: the
// limiter is asked once, with no reservation and no wait, so an admission is logged in
// the window logs as an enforced rule would log it and a denial writes nothing. costErr
// is the error of the task's cost, if it could not be read.
func (m *middleware) shadow(ctx context.Context, task *asynq.Task, next asynq.Handler, key throttle.Key, eff Effective, cost int, costErr error) error {
	rule := eff.Rule
	if costErr != nil {
		m.wouldThrottle(ctx, key, rule, "it would be archived: "+costErr.Error(), nil)
		return next.ProcessTask(ctx, task)
	}
	req := throttle.Request{Key: key, Quotas: rule.Quotas, Cost: cost, Member: throttle.NewMember(), Weight: m.weightFor(key, eff)}
	d, err := m.shadowAllow(ctx, req)
	switch {
	case errors.Is(err, throttle.ErrInvalid):
		m.wouldThrottle(ctx, key, rule, "it would be archived: "+err.Error(), nil)
		return next.ProcessTask(ctx, task)
	case err != nil:
		m.metrics.count(key, OutcomeFailedOpen)
		m.shadowLog.unavailable.Do(func() {
			m.log.Warn("throttle: limiter unavailable; running tasks of a shadow rule undecided (logged at most once a minute)",
				"task_type", quote.Cut(key.TaskType), "tenant", quote.Cut(key.Tenant), "rule", rule.String(), "err", err)
		})
		return next.ProcessTask(ctx, task)
	}
	m.checkSkew(key, d)
	if m.observe != nil {
		m.observe(ctx, task, key, d)
	}
	if d.Allowed {
		m.metrics.count(key, OutcomeAdmitted)
		return next.ProcessTask(context.WithValue(ctx, decisionKey{}, d), task)
	}
	m.wouldThrottle(ctx, key, rule, "it would be denied", &d)
	return next.ProcessTask(ctx, task)
}

// wouldThrottle counts a would-be denial and logs it, at most one line per task type per
// shadowLogInterval; a line says how many were not logged since the one before.
func (m *middleware) wouldThrottle(ctx context.Context, key throttle.Key, rule Rule, reason string, d *throttle.Decision) {
	m.metrics.count(key, OutcomeShadowDenied)
	skipped, ok := m.shadowLog.take(key.TaskType, m.now())
	if !ok {
		return
	}
	id, _ := asynq.GetTaskID(ctx)
	args := []any{"task_id", id, "task_type", quote.Cut(key.TaskType), "tenant", quote.Cut(key.Tenant), "rule", rule.String(), "not_logged_since_last", skipped}
	if d != nil {
		args = append(args, "quota", d.Quota.String(), "retry_after", d.RetryAfter)
	}
	m.log.Info("throttle: shadow rule would have held this task back ("+reason+"); it runs (mode=shadow)", args...)
}

// shadowLogger limits the log lines of shadow rules.
type shadowLogger struct {
	mu          sync.Mutex
	byType      map[string]*shadowLogState
	unavailable rate.Sometimes // set by New: first, then once a minute
}

type shadowLogState struct {
	next    time.Time // no line before
	skipped int       // would-be denials not logged since the last line
}

// take reports whether a line may be logged for taskType at now, and how many were not
// logged since the last one.
func (l *shadowLogger) take(taskType string, now time.Time) (skipped int, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byType == nil {
		l.byType = map[string]*shadowLogState{}
	}
	st := l.byType[taskType]
	if st == nil {
		st = &shadowLogState{}
		l.byType[taskType] = st
	}
	if now.Before(st.next) {
		st.skipped++
		return 0, false
	}
	skipped, st.skipped, st.next = st.skipped, 0, now.Add(shadowLogInterval)
	return skipped, true
}

// shadowAllow asks the limiter once for a shadow rule's task, unless its Redis is failing
// and another task is probing it (limiterHealth): then it returns errProbing at once.
func (m *middleware) shadowAllow(ctx context.Context, req throttle.Request) (throttle.Decision, error) {
	call, probe := m.health.enter()
	if !call {
		return throttle.Decision{}, errProbing
	}
	defer func() { m.health.leave(probe) }()
	start := time.Now()
	d, err := m.lim.Allow(ctx, req)
	m.metrics.called(req.Key.TaskType, CallAllow, start, err) // as an enforced rule's call: a shadow rollout's alerts see it
	switch {
	case errors.Is(err, throttle.ErrInvalid):
	case err == nil:
		m.health.ok()
	default:
		m.health.failed(ctx, &probe)
	}
	return d, err
}
