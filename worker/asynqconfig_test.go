package worker_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

func deniedErr(retryAt time.Time) *throttle.DeniedError {
	return &throttle.DeniedError{
		Key:        throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quota:      throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)},
		RetryAfter: time.Until(retryAt),
		RetryAt:    retryAt,
	}
}

// errorKinds are the errors a throttled handler can return, and whether each is a
// throttling outcome (not a failure).
var errorKinds = []struct {
	name      string
	err       error
	throttled bool
}{
	{name: "Denied", err: deniedErr(time.Now().Add(time.Second)), throttled: true},
	{name: "DeniedWrapped", err: fmt.Errorf("handler: %w", deniedErr(time.Now().Add(time.Second))), throttled: true},
	{name: "DeniedDeferred", err: fmt.Errorf("%w; deferred as task x:deferred:1: %w", deniedErr(time.Now()), asynq.RevokeTask), throttled: true},
	{name: "Unavailable", err: fmt.Errorf("%w: %w", worker.ErrUnavailable, io.EOF), throttled: true},
	{name: "Backpressure", err: fmt.Errorf("worker: the tenant's quota paused until x: call the API: %w",
		&worker.BackpressureError{StatusCode: 429, RetryAfter: 3 * time.Second, RetryAt: time.Now().Add(3 * time.Second)}), throttled: true},
	// What asynq's recoverer retries the task of a crashed worker with: no retry spent.
	{name: "LeaseExpired", err: asynq.ErrLeaseExpired, throttled: true},
	{name: "Other", err: errors.New("upstream 500"), throttled: false},
	{name: "Rejected", err: fmt.Errorf("worker: rule %q: %w: %w", "x tenant=5/1m", worker.ErrBadCost, asynq.SkipRetry), throttled: false},
}

func TestIsFailureFunc(t *testing.T) {
	t.Parallel()
	for _, tc := range errorKinds {
		t.Run(tc.name, func(t *testing.T) {
			if got := worker.IsFailureFunc(nil)(tc.err); got != !tc.throttled {
				t.Errorf("IsFailureFunc(nil)(%v) = %v, want %v", tc.err, got, !tc.throttled)
			}
			for _, verdict := range []bool{false, true} {
				var asked []error
				f := worker.IsFailureFunc(func(err error) bool { asked = append(asked, err); return verdict })
				got := f(tc.err)
				want := verdict
				if tc.throttled {
					want = false
				}
				if got != want {
					t.Errorf("with a fallback saying %v: IsFailure(%v) = %v, want %v", verdict, tc.err, got, want)
				}
				if tc.throttled && len(asked) != 0 {
					t.Errorf("fallback asked about a throttling error %v", tc.err)
				}
				if !tc.throttled && (len(asked) != 1 || asked[0] != tc.err) {
					t.Errorf("fallback asked %v, want exactly [%v]", asked, tc.err)
				}
			}
		})
	}
	if worker.IsFailureFunc(nil)(nil) {
		t.Error("IsFailureFunc(nil)(nil) = true, want false (asynq's default)")
	}
}

func TestRetryDelayFunc(t *testing.T) {
	t.Parallel()
	task := asynq.NewTask("api:call", nil)
	other := errors.New("upstream 500")
	var gotN int
	var gotErr error
	var gotTask *asynq.Task
	fallback := func(n int, err error, task *asynq.Task) time.Duration {
		gotN, gotErr, gotTask = n, err, task
		return 42 * time.Second
	}
	if d := worker.RetryDelayFunc(fallback)(7, other, task); d != 42*time.Second || gotN != 7 || gotErr != other || gotTask != task {
		t.Errorf("other error: delay %s, fallback got (%d, %v, %p); want 42s from fallback(7, %v, %p)", d, gotN, gotErr, gotTask, other, task)
	}
	gotErr = nil
	for _, fb := range []asynq.RetryDelayFunc{nil, fallback} {
		if d := worker.RetryDelayFunc(fb)(3, fmt.Errorf("%w: %w", worker.ErrUnavailable, io.EOF), task); d != worker.UnavailableRetryDelay {
			t.Errorf("ErrUnavailable: delay %s, want %s", d, worker.UnavailableRetryDelay)
		}
		if d := worker.RetryDelayFunc(fb)(0, asynq.ErrLeaseExpired, task); d != 0 {
			t.Errorf("ErrLeaseExpired: delay %s, want 0 (the recoverer found it 55-120s after the crash)", d)
		}
		// A denial 1.2s ahead waits until the next whole second after it: more than 1.2s
		// minus the time this call takes, at most 2.2s.
		start := time.Now()
		d := worker.RetryDelayFunc(fb)(3, deniedErr(start.Add(1200*time.Millisecond)), task)
		elapsed := time.Since(start)
		if d < 1200*time.Millisecond-elapsed || d > 2200*time.Millisecond {
			t.Errorf("denial 1.2s ahead: delay %s, want in [1.2s - %s, 2.2s]", d, elapsed)
		}
		// A denial already due: no wait.
		if d := worker.RetryDelayFunc(fb)(3, deniedErr(time.Now().Add(-3*time.Second)), task); d != 0 {
			t.Errorf("denial due 3s ago: delay %s, want 0", d)
		}
	}
	if gotErr != nil {
		t.Errorf("fallback asked about a throttling error %v", gotErr)
	}
	// Without a fallback, other errors get asynq's default: for n=0, 15s + [0, 30s).
	for i := 0; i < 20; i++ {
		if d := worker.RetryDelayFunc(nil)(0, other, task); d < 15*time.Second || d >= 45*time.Second {
			t.Errorf("other error, nil fallback: delay %s, want asynq.DefaultRetryDelayFunc's [15s, 45s)", d)
		}
	}
}

func TestWrapConfig(t *testing.T) {
	t.Parallel()
	var handled []error
	cfg := worker.WrapConfig(asynq.Config{
		Concurrency: 3,
		Queues:      map[string]int{"critical": 6, "default": 3},
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			handled = append(handled, err)
		}),
		IsFailure:      func(error) bool { return false }, // the user's: nothing is a failure
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return 42 * time.Second },
	})
	if cfg.Concurrency != 3 || len(cfg.Queues) != 2 || cfg.Queues["critical"] != 6 {
		t.Errorf("WrapConfig changed other fields: Concurrency %d, Queues %v", cfg.Concurrency, cfg.Queues)
	}
	// The default is well under asynq's 5s, so that a throttled task due at a whole
	// second is moved back to its queue soon after.
	if d := worker.DefaultDelayedTaskCheckInterval; cfg.DelayedTaskCheckInterval != d || d <= 0 || d > time.Second {
		t.Errorf("DelayedTaskCheckInterval = %s, want the default %s (in (0, 1s])", cfg.DelayedTaskCheckInterval, d)
	}
	// An idle processor polls every 0.5-1.5 x TaskCheckInterval: 100ms keeps a forwarded
	// task within the wake lead's 250ms margin.
	if cfg.TaskCheckInterval != 100*time.Millisecond {
		t.Errorf("TaskCheckInterval = %s, want the default 100ms", cfg.TaskCheckInterval)
	}
	task := asynq.NewTask("api:call", nil)
	for _, tc := range errorKinds {
		handled = nil
		cfg.ErrorHandler.HandleError(context.Background(), task, tc.err)
		quiet := errors.Is(tc.err, throttle.ErrDenied) || errors.Is(tc.err, worker.ErrBackpressure)
		switch {
		case quiet && len(handled) != 0:
			t.Errorf("%s: ErrorHandler called for a denial or a backpressure", tc.name)
		case !quiet && (len(handled) != 1 || handled[0] != tc.err):
			t.Errorf("%s: ErrorHandler got %v, want exactly [%v]", tc.name, handled, tc.err)
		}
		if cfg.IsFailure(tc.err) {
			t.Errorf("%s: IsFailure = true; want false (throttling, or the user's IsFailure)", tc.name)
		}
		if !tc.throttled {
			if d := cfg.RetryDelayFunc(1, tc.err, task); d != 42*time.Second {
				t.Errorf("%s: RetryDelayFunc = %s, want the user's 42s", tc.name, d)
			}
		}
	}

	kept := worker.WrapConfig(asynq.Config{DelayedTaskCheckInterval: 100 * time.Millisecond, TaskCheckInterval: 2 * time.Second})
	if kept.DelayedTaskCheckInterval != 100*time.Millisecond || kept.TaskCheckInterval != 2*time.Second {
		t.Errorf("DelayedTaskCheckInterval 100ms and TaskCheckInterval 2s became %s and %s", kept.DelayedTaskCheckInterval, kept.TaskCheckInterval)
	}
	if kept.ErrorHandler != nil {
		t.Error("WrapConfig installed an ErrorHandler where the Config had none")
	}
	if kept.IsFailure == nil || kept.RetryDelayFunc == nil {
		t.Fatal("WrapConfig left IsFailure or RetryDelayFunc nil")
	}
	if !kept.IsFailure(errors.New("x")) || kept.IsFailure(deniedErr(time.Now())) {
		t.Error("without the user's IsFailure: want other errors failures, denials not")
	}
}
