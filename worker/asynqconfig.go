package worker

import (
	"context"
	"errors"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// DefaultDelayedTaskCheckInterval is the forwarder interval WrapConfig sets when the
// Config leaves it zero. asynq's own default is 5s: a throttled task is due at a whole
// second but only moved back to its queue at the forwarder's next run, so it would come
// back up to 5s late, and a task woken early for its reservation (Config.WakeLead) would
// need to be woken that much earlier and wait that much longer in its handler. At 500ms
// it costs each server two small Redis script calls per queue every 500ms.
const DefaultDelayedTaskCheckInterval = 500 * time.Millisecond

// DefaultTaskCheckInterval is the idle-poll interval WrapConfig sets when the Config
// leaves TaskCheckInterval zero. asynq's own default is 1s, and an idle processor polls
// every 0.5-1.5 x TaskCheckInterval: a task the forwarder has just moved back could so
// start up to 1.5s after its wake instant, past its reserved slot (WakeLead covers a whole
// second of retry rounding, the forwarder and 250ms), and a task late for its slot loses
// it. At 100ms a task starts within 150ms; an idle server polls each queue 10 times a
// second instead of once.
const DefaultTaskCheckInterval = 100 * time.Millisecond

// WrapConfig returns a copy of cfg set up for throttled tasks; the caller's own functions
// still handle every other error:
//
//   - IsFailure is false for throttle.ErrDenied, ErrBackpressure and ErrUnavailable
//     (asynq then keeps Retried and the failed count as they are), and for
//     asynq.ErrLeaseExpired (see IsFailureFunc); otherwise cfg.IsFailure, or asynq's
//     default (every error is a failure).
//   - RetryDelayFunc waits until a denial's RetryAt (or a *BackpressureError's) rounded
//     up to a whole second, UnavailableRetryDelay for ErrUnavailable, and nothing for
//     asynq.ErrLeaseExpired (the task has already waited out its lease and the
//     recoverer's scan); otherwise cfg.RetryDelayFunc, or asynq.DefaultRetryDelayFunc.
//   - ErrorHandler is not called for denials, backpressure and deferrals; it is for
//     everything else, ErrUnavailable included.
//   - DelayedTaskCheckInterval defaults to DefaultDelayedTaskCheckInterval (500ms).
//   - TaskCheckInterval defaults to DefaultTaskCheckInterval (100ms).
func WrapConfig(cfg asynq.Config) asynq.Config {
	cfg.IsFailure = IsFailureFunc(cfg.IsFailure)
	cfg.RetryDelayFunc = RetryDelayFunc(cfg.RetryDelayFunc)
	if h := cfg.ErrorHandler; h != nil {
		cfg.ErrorHandler = asynq.ErrorHandlerFunc(func(ctx context.Context, task *asynq.Task, err error) {
			if !errors.Is(err, throttle.ErrDenied) && !errors.Is(err, ErrBackpressure) {
				h.HandleError(ctx, task, err)
			}
		})
	}
	if cfg.DelayedTaskCheckInterval == 0 {
		cfg.DelayedTaskCheckInterval = DefaultDelayedTaskCheckInterval
	}
	if cfg.TaskCheckInterval == 0 {
		cfg.TaskCheckInterval = DefaultTaskCheckInterval
	}
	return cfg
}

// IsFailureFunc returns an asynq.Config.IsFailure that is false for throttle.ErrDenied,
// ErrBackpressure, ErrUnavailable and asynq.ErrLeaseExpired, and otherwise asks fallback
// (nil: every non-nil error is a failure, as asynq's default).
//
// asynq.ErrLeaseExpired is the error asynq v0.26.0's recoverer retries a task with when
// the worker that held it stopped extending its lease: killed (kill -9, OOM, a lost
// node) or cut off from Redis. The recoverer consults IsFailure (recoverer.go, retry), so
// a false here keeps Retried: a crashed worker costs no retry. It is also what a task
// waiting in its handler for a slot ahead gets (it had not started its work), and
// IsFailure cannot tell which task it is asked about: it applies to every task. So a task
// whose own handler crashes its worker every time is never archived by its retries: it
// is recovered and run again, once per lease scan (about every 1-2 minutes). To keep
// asynq's rule for it, set your own IsFailure after WrapConfig, e.g.
// cfg.IsFailure = func(err error) bool { return errors.Is(err, asynq.ErrLeaseExpired) || wrapped(err) }.
func IsFailureFunc(fallback func(error) bool) func(error) bool {
	return func(err error) bool {
		if errors.Is(err, throttle.ErrDenied) || errors.Is(err, ErrBackpressure) || errors.Is(err, ErrUnavailable) ||
			errors.Is(err, asynq.ErrLeaseExpired) {
			return false
		}
		if fallback != nil {
			return fallback(err)
		}
		return err != nil
	}
}

// RetryDelayFunc returns an asynq.RetryDelayFunc that, for a *throttle.DeniedError or a
// *BackpressureError, returns the time from now until its RetryAt rounded up to a whole
// second (asynq stores retry times as truncated whole seconds, so an unrounded delay could
// bring the task back up to 1s early, to be denied again); for ErrUnavailable
// UnavailableRetryDelay; for asynq.ErrLeaseExpired 0 (asynq's recoverer finds a task only
// 30s after its lease, itself up to 30s long, expired, scanning every minute: the task has
// waited 55-120s already, and with Retried kept, see IsFailureFunc, asynq's default delay
// would add 15-45s more); and otherwise asks fallback (nil: asynq.DefaultRetryDelayFunc).
func RetryDelayFunc(fallback asynq.RetryDelayFunc) asynq.RetryDelayFunc {
	if fallback == nil {
		fallback = asynq.DefaultRetryDelayFunc
	}
	return func(n int, err error, task *asynq.Task) time.Duration {
		if d, ok := retryDelay(time.Now(), err); ok {
			return d
		}
		return fallback(n, err, task)
	}
}

// retryDelay is RetryDelayFunc's rule at the instant now.
func retryDelay(now time.Time, err error) (time.Duration, bool) {
	var denied *throttle.DeniedError
	var bp *BackpressureError
	switch {
	case errors.As(err, &denied):
		return max(ceilSecond(denied.RetryAt).Sub(now), 0), true
	case errors.As(err, &bp):
		return max(ceilSecond(bp.RetryAt).Sub(now), 0), true
	case errors.Is(err, ErrUnavailable):
		return UnavailableRetryDelay, true
	case errors.Is(err, asynq.ErrLeaseExpired):
		return 0, true
	}
	return 0, false
}
