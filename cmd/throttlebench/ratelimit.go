package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The x/time/rate strategy is asynq's documented way to rate-limit task processing
// (hibiken/asynq wiki, "Rate Limiting"): a golang.org/x/time/rate.Limiter in the worker
// process, a RateLimitError returned when it says no, IsFailure false for that error and
// RetryDelayFunc returning its RetryIn. The wiki notes that this is "a per server
// instance rate limit, and not a global rate limit": each of N worker processes admits
// the full limit, so together they admit up to N times it. The wiki's example uses one
// limiter for all tasks and a random RetryIn of 0-9s; here, to compare like with like,
// each process has one limiter per tenant (rate limit/window, burst limit) and RetryIn
// is fixed (-retry-in).

// RateLimitError is the wiki's error for a task the process's limiter refused.
type RateLimitError struct {
	RetryIn time.Duration
}

func (e *RateLimitError) Error() string {
	return fmt.Sprintf("rate limited (retry in %v)", e.RetryIn)
}

// isRateLimitError is the wiki's IsRateLimitError, with errors.As.
func isRateLimitError(err error) bool {
	var e *RateLimitError
	return errors.As(err, &e)
}

// rateLimitRetryDelay is the wiki's RetryDelayFunc: RetryIn for a RateLimitError, asynq's
// default otherwise. asynq stores the retry time in whole seconds, truncated.
func rateLimitRetryDelay(n int, err error, task *asynq.Task) time.Duration {
	var e *RateLimitError
	if errors.As(err, &e) {
		return e.RetryIn
	}
	return asynq.DefaultRetryDelayFunc(n, err, task)
}

// rateLimited holds one worker process's limiters, one per tenant.
type rateLimited struct {
	limit   throttle.Limit
	retryIn time.Duration
	mu      sync.Mutex
	byKey   map[string]*rate.Limiter
}

func newRateLimited(limit throttle.Limit, retryIn time.Duration) *rateLimited {
	return &rateLimited{limit: limit, retryIn: retryIn, byKey: map[string]*rate.Limiter{}}
}

// limiter returns tenant's limiter: limit.Events per limit.Window, burst limit.Events.
func (r *rateLimited) limiter(tenant string) *rate.Limiter {
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.byKey[tenant]
	if !ok {
		l = rate.NewLimiter(rate.Limit(float64(r.limit.Events)/r.limit.Window.Seconds()), r.limit.Events)
		r.byKey[tenant] = l
	}
	return l
}

// middleware runs the task if its tenant's limiter allows it now, noting the admission
// instant in the delivery's record; otherwise it returns a RateLimitError.
func (r *rateLimited) middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		now := time.Now()
		rec := recordFrom(ctx)
		if !r.limiter(tenant).AllowN(now, 1) {
			if rec != nil {
				rec.Denials = append(rec.Denials, denial{AtMS: now.UnixMilli(), RetryAfterMS: r.retryIn.Milliseconds()})
			}
			return &RateLimitError{RetryIn: r.retryIn}
		}
		if rec != nil {
			rec.AtMS = now.UnixMilli()
		}
		return next.ProcessTask(ctx, task)
	})
}
