package worker

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Defaults of Backpressure.
const (
	// DefaultBackpressureDelay is how long Backpressure asks to pause when the response
	// has no Retry-After header, or one that is neither whole seconds nor an HTTP date.
	// Change it with BackpressureDefault.
	DefaultBackpressureDelay = 10 * time.Second
	// DefaultMaxBackpressureDelay is the longest pause Backpressure asks for, whatever the
	// Retry-After says, so that a wrong header (a date years ahead) cannot stop a tenant
	// for years: a task paused that long comes back, asks again, and is paused again if
	// the API still refuses. Change it with BackpressureMax.
	DefaultMaxBackpressureDelay = time.Hour
)

// ErrBackpressure matches every *BackpressureError under errors.Is.
var ErrBackpressure = errors.New("worker: upstream backpressure")

// BackpressureError reports that the API a handler called refused the call for now (HTTP
// 429 Too Many Requests or 503 Service Unavailable) and asked it to come back at RetryAt.
// Build it with Backpressure and return it from the handler, wrapped or not. The
// middleware then pauses the task's quota at Scope on every worker until RetryAt
// (throttle.Limiter.Pause) and re-queues the task for RetryAt, without counting a failure
// or spending a retry (see Backpressure).
type BackpressureError struct {
	// StatusCode is the response's status code: http.StatusTooManyRequests or
	// http.StatusServiceUnavailable.
	StatusCode int
	// RetryAfter is the wait the response asked for, from its Retry-After header: whole
	// seconds, or an HTTP date less the response's Date header (or, without one, less the
	// local clock when Backpressure was called), at least 0 and at most the maximum
	// (DefaultMaxBackpressureDelay, BackpressureMax). Without a usable header it is the
	// default (DefaultBackpressureDelay, BackpressureDefault) and Defaulted is true.
	RetryAfter time.Duration
	// RetryAt is when to come back, on the local clock: its time when Backpressure was
	// called plus RetryAfter.
	RetryAt time.Time
	// Scope is the quota to pause: throttle.ScopeTenant (the default: the task's tenant),
	// or throttle.ScopeType (every tenant of the task type), set with BackpressureScope.
	Scope throttle.Scope
	// Header is the Retry-After header as received ("" when absent).
	Header string
	// Defaulted reports that Header was absent or could not be read, so RetryAfter is the
	// default.
	Defaulted bool
}

// Error names the status, the wait and the scope: "worker: upstream answered 429 Too Many
// Requests, retry after 3s (Retry-After: 3); pause the tenant's quota".
func (e *BackpressureError) Error() string {
	src := "Retry-After: " + e.Header
	switch {
	case e.Header == "":
		src = "no Retry-After: the default"
	case e.Defaulted:
		src = fmt.Sprintf("Retry-After %q unreadable: the default", e.Header)
	}
	return fmt.Sprintf("worker: upstream answered %d %s, retry after %s (%s); pause the %s", e.StatusCode,
		http.StatusText(e.StatusCode), e.RetryAfter, src, scopeWords(e.Scope))
}

// Is reports whether target is ErrBackpressure.
func (e *BackpressureError) Is(target error) bool { return target == ErrBackpressure }

// BackpressureOption changes what Backpressure builds.
type BackpressureOption func(*backpressureOptions)

type backpressureOptions struct {
	scope    throttle.Scope
	fallback time.Duration
	max      time.Duration
}

// BackpressureScope chooses the quota to pause: throttle.ScopeTenant (the default) pauses
// the task's tenant on its task type, throttle.ScopeType every tenant of the type (for an
// API whose limit is the application's, not each tenant's). Another value makes
// Backpressure return an error that is not a *BackpressureError.
func BackpressureScope(s throttle.Scope) BackpressureOption {
	return func(o *backpressureOptions) { o.scope = s }
}

// BackpressureDefault sets the wait used when the response has no usable Retry-After
// (DefaultBackpressureDelay otherwise). A negative d makes Backpressure return an error
// that is not a *BackpressureError.
func BackpressureDefault(d time.Duration) BackpressureOption {
	return func(o *backpressureOptions) { o.fallback = d }
}

// BackpressureMax sets the longest wait Backpressure asks for
// (DefaultMaxBackpressureDelay otherwise); a longer Retry-After is cut to it. A d <= 0
// makes Backpressure return an error that is not a *BackpressureError.
func BackpressureMax(d time.Duration) BackpressureOption {
	return func(o *backpressureOptions) { o.max = d }
}

// Backpressure returns a *BackpressureError for a response with status 429 Too Many
// Requests or 503 Service Unavailable, and nil for any other response (or a nil one), so
// a handler can write:
//
//	resp, err := client.Do(req)
//	if err != nil {
//		return err
//	}
//	defer resp.Body.Close()
//	if err := worker.Backpressure(resp); err != nil {
//		return err // the tenant is paused on every worker until the Retry-After
//	}
//
// The wait comes from the Retry-After header (RFC 9110 section 10.2.3): a number of whole
// seconds, or an HTTP date, counted from the response's Date header when it has one (the
// API's clock, so a skewed local clock does not matter) and from the local clock
// otherwise; a date in the past is a wait of 0. An absent header, or one that is neither,
// gives DefaultBackpressureDelay (BackpressureDefault); no wait is longer than
// DefaultMaxBackpressureDelay (BackpressureMax).
//
// When a handler of a task type that has a rule returns it, the middleware (New):
//   - pauses the task's tenant's window log (or, with BackpressureScope(ScopeType), the
//     task type's) until RetryAt on every worker that shares the Redis
//     (throttle.Limiter.Pause): each task decided on it meanwhile is denied until then
//     (Decision.Paused) and re-queued, counted as OutcomePaused. If the rule has no quota
//     at that scope (a type= quota only, or tenant= quotas only) it pauses the scope the
//     rule has: the log its tasks are decided on. A shadow rule (ModeShadow) pauses
//     nothing;
//   - re-queues the task for RetryAt, rounded up to a whole second, without counting a
//     failure or spending a retry, as a denied task is (a task with no retry left is
//     replaced by a copy), and counts it as OutcomeBackpressure.
//
// If the pause cannot be written (Redis down), the task is still re-queued for RetryAt,
// and the failure is logged and counted in Metrics.RedisErrors (call CallPause). A task
// type without a rule pauses nothing; WrapConfig's asynq functions still retry the task at
// RetryAt without counting a failure (but asynq archives it if it has no retry left).
func Backpressure(resp *http.Response, opts ...BackpressureOption) error {
	if resp == nil || resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return nil
	}
	return newBackpressure(resp, time.Now(), opts)
}

// newBackpressure is Backpressure for a 429 or 503 response received at now.
func newBackpressure(resp *http.Response, now time.Time, opts []BackpressureOption) error {
	o := backpressureOptions{scope: throttle.ScopeTenant, fallback: DefaultBackpressureDelay, max: DefaultMaxBackpressureDelay}
	for _, opt := range opts {
		opt(&o)
	}
	switch {
	case o.scope != throttle.ScopeTenant && o.scope != throttle.ScopeType:
		return fmt.Errorf("worker: Backpressure: scope %s; want throttle.ScopeTenant or throttle.ScopeType", o.scope)
	case o.fallback < 0:
		return fmt.Errorf("worker: Backpressure: negative default wait %s", o.fallback)
	case o.max <= 0:
		return fmt.Errorf("worker: Backpressure: maximum wait %s; want > 0", o.max)
	}
	e := &BackpressureError{StatusCode: resp.StatusCode, Scope: o.scope, Header: resp.Header.Get("Retry-After")}
	wait, ok := retryAfter(e.Header, resp.Header.Get("Date"), now)
	if !ok {
		wait, e.Defaulted = o.fallback, true
	}
	e.RetryAfter = min(wait, o.max)
	e.RetryAt = now.Add(e.RetryAfter)
	return e
}

// retryAfter reads a Retry-After value: whole seconds, or an HTTP date less date (the
// response's Date header, if it parses) or now. It reports false if v is neither.
func retryAfter(v, date string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if isDigits(v) {
		s, err := strconv.ParseInt(v, 10, 64)
		if err != nil || s > math.MaxInt64/int64(time.Second) { // more digits than any wait: as long as allowed
			return time.Duration(math.MaxInt64), true
		}
		return time.Duration(s) * time.Second, true
	}
	at, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	base := now
	if d, err := http.ParseTime(strings.TrimSpace(date)); err == nil {
		base = d
	}
	return max(at.Sub(base), 0), true
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// scopeWords names the quota a pause at scope stops.
func scopeWords(s throttle.Scope) string {
	if s == throttle.ScopeType {
		return "task type's quota"
	}
	return "tenant's quota"
}

// pauseScope is the scope of quotas to pause for a backpressure asking for want: want if
// one of quotas has it, else the scope they have (a rule has at least one quota).
func pauseScope(quotas []throttle.Quota, want throttle.Scope) throttle.Scope {
	for _, q := range quotas {
		if q.Scope == want {
			return want
		}
	}
	if len(quotas) > 0 {
		return quotas[0].Scope
	}
	return want
}

// afterHandler looks at the error a handler of a task of key, decided under eff, returned:
// a *BackpressureError in it pauses the quota (unless the rule is a shadow one) and
// re-queues the task for its RetryAt (see Backpressure); any other error, or nil, is
// returned as it is.
func (m *middleware) afterHandler(ctx context.Context, task *asynq.Task, key throttle.Key, eff Effective, err error) error {
	bp, ok := errors.AsType[*BackpressureError](err) // errors.As(err, &bp) would move bp to the heap on every task
	if !ok {
		return err
	}
	scope := pauseScope(eff.Rule.Quotas, bp.Scope)
	what := "the tenant's quota"
	if scope == throttle.ScopeType {
		what = "the task type's quota"
	}
	id, _ := asynq.GetTaskID(ctx)
	args := []any{"task_id", id, "task_type", key.TaskType, "tenant", key.Tenant, "status", bp.StatusCode,
		"retry_after", bp.RetryAfter, "until", bp.RetryAt.UTC().Format(time.RFC3339Nano)}
	switch {
	case eff.Rule.Mode == ModeShadow:
		what = "nothing (mode=shadow): task re-queued"
		m.log.Info("throttle: upstream backpressure under a shadow rule; the task is re-queued, no quota paused", args...)
	case !bp.RetryAt.After(m.now()):
		what = "nothing (no wait asked)"
	default:
		if perr := m.pause(ctx, key, scope, bp.RetryAt); perr != nil {
			what = "nothing (the pause failed: " + perr.Error() + ")"
			m.log.Warn("throttle: upstream backpressure, but the pause could not be written; only this task waits",
				append(args, "err", perr)...)
		} else {
			what += " paused"
			m.log.Info("throttle: upstream backpressure: "+what+" on every worker", append(args, "scope", scope.String())...)
		}
	}
	out := fmt.Errorf("worker: %s until %s: %w", what, bp.RetryAt.UTC().Format(time.RFC3339Nano), err)
	return m.later(ctx, task, out, bp.RetryAt, OutcomeBackpressure, bp.RetryAfter)
}

// pause pauses key's log at scope until until, timed and counted as CallPause, and
// records the pause in the metrics' PausesActive. It is bounded by UnavailableWait, and
// runs even if the handler's context has ended (the task is re-queued either way).
func (m *middleware) pause(ctx context.Context, key throttle.Key, scope throttle.Scope, until time.Time) error {
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.wait)
	defer cancel()
	start := time.Now()
	err := m.lim.Pause(pctx, key, scope, until)
	m.metrics.called(key.TaskType, CallPause, start, err)
	if err == nil {
		m.metrics.paused(m.lim.RedisKey(key, scope), until)
	}
	return err
}
