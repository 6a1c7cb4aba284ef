// Package worker adapts package throttle to asynq: a middleware that decides every task
// against its rule's quotas before the handler runs, and WrapConfig, which sets up an
// asynq.Config so that a throttled task is neither failed, nor archived, nor charged a
// retry, and comes back when its quotas have room.
//
// asynq v0.26.0 archives a task whose handler returns an error once Retried >= MaxRetry,
// before it looks at IsFailure (processor.go, handleFailedMessage). So a denied task that
// still has retries left is returned as a *throttle.DeniedError (a non-failure retry), and
// one with none left (MaxRetry(0), or retries spent on real failures) is re-enqueued as a
// copy due at its retry instant and the original is revoked (asynq.RevokeTask): done,
// never archived.
package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Config configures New.
type Config struct {
	// Rules throttle the task types they name; tasks of other types run freely.
	Rules []Rule
	// TenantHeader is the task header that names the tenant. Defaults to
	// producer.TenantHeader ("tenant"). A task without the header (or with an empty one)
	// counts against the tenant "": one bucket shared by all untagged tasks of its type.
	TenantHeader string
	// Redis is the client of the Redis that asynq uses (often the limiter's too). The
	// middleware re-enqueues there the copy of a denied task that has no retry left.
	// Required.
	Redis redis.UniversalClient
	// DecisionFunc, if set, is called after every decision the limiter makes, admitted or
	// denied, with the task's key, e.g. to count or log throttling. It must be fast and
	// safe for concurrent use.
	DecisionFunc func(ctx context.Context, task *asynq.Task, key throttle.Key, d throttle.Decision)
}

// Header names of the copy that replaces a denied task with no retry left.
const (
	// HeaderOriginID holds the ID of the task that was first enqueued.
	HeaderOriginID = "throttle-origin-id"
	// HeaderDeferrals counts how often the task was replaced by a copy.
	HeaderDeferrals = "throttle-deferrals"
)

// ErrUnavailable matches, under errors.Is, the error a throttled task returns when the
// limiter could not decide (Redis unreachable or timed out). The task does not run: the
// limiter fails closed. WrapConfig treats it as a non-failure retried after
// UnavailableRetryDelay.
var ErrUnavailable = errors.New("worker: limiter unavailable")

// UnavailableRetryDelay is how long a task waits when the limiter was unavailable.
const UnavailableRetryDelay = 5 * time.Second

type middleware struct {
	lim       *throttle.Limiter
	rules     map[string]Rule
	header    string
	client    *asynq.Client
	inspector *asynq.Inspector
	observe   func(context.Context, *asynq.Task, throttle.Key, throttle.Decision)
	now       func() time.Time
}

// New returns asynq middleware that decides each task of a ruled type against lim before
// the handler runs. An admitted task runs with its Decision in the context (see
// DecisionFrom). A denied task returns a *throttle.DeniedError (use WrapConfig so asynq
// retries it at the right time without counting a failure), or, if asynq would archive
// it because it has no retry left, is re-enqueued as a copy due at the retry instant.
//
// New returns an error if lim or cfg.Redis is nil, a rule is invalid (Rule.Validate), or
// two rules name one task type.
func New(lim *throttle.Limiter, cfg Config) (asynq.MiddlewareFunc, error) {
	if lim == nil {
		return nil, errors.New("worker: nil Limiter")
	}
	if cfg.Redis == nil {
		return nil, errors.New("worker: Config.Redis is nil; it must be the client of asynq's Redis")
	}
	m := &middleware{
		lim:       lim,
		rules:     make(map[string]Rule, len(cfg.Rules)),
		header:    cfg.TenantHeader,
		client:    asynq.NewClientFromRedisClient(cfg.Redis),
		inspector: asynq.NewInspectorFromRedisClient(cfg.Redis),
		observe:   cfg.DecisionFunc,
		now:       time.Now,
	}
	if m.header == "" {
		m.header = producer.TenantHeader
	}
	for _, r := range cfg.Rules {
		if err := r.Validate(); err != nil {
			return nil, err
		}
		if _, dup := m.rules[r.TaskType]; dup {
			return nil, fmt.Errorf("worker: two rules for task type %q; put all its quotas in one rule", r.TaskType)
		}
		m.rules[r.TaskType] = r
	}
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			return m.process(ctx, task, next)
		})
	}, nil
}

type decisionKey struct{}

// DecisionFrom returns the admission Decision of the task whose handler got ctx, and
// false if the task was not throttled (no rule for its type).
func DecisionFrom(ctx context.Context) (throttle.Decision, bool) {
	d, ok := ctx.Value(decisionKey{}).(throttle.Decision)
	return d, ok
}

func (m *middleware) process(ctx context.Context, task *asynq.Task, next asynq.Handler) error {
	rule, ok := m.rules[task.Type()]
	if !ok {
		return next.ProcessTask(ctx, task)
	}
	key := throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[m.header]}
	d, err := m.lim.Allow(ctx, throttle.Request{Key: key, Quotas: rule.Quotas})
	if err != nil {
		return m.later(ctx, task, fmt.Errorf("%w: %w", ErrUnavailable, err), m.now().Add(UnavailableRetryDelay))
	}
	if m.observe != nil {
		m.observe(ctx, task, key, d)
	}
	if d.Allowed {
		return next.ProcessTask(context.WithValue(ctx, decisionKey{}, d), task)
	}
	denied := &throttle.DeniedError{
		Key:        key,
		Quota:      d.Quota,
		RetryAfter: d.RetryAfter,
		RetryAt:    m.now().Add(d.RetryAfter), // local clock, as asynq's retry scores
	}
	return m.later(ctx, task, denied, denied.RetryAt)
}

// later returns err, which asynq retries without counting a failure (WrapConfig), if the
// task has a retry left; otherwise asynq would archive it, so it re-enqueues a copy due
// at retryAt and revokes the task (deferTask).
func (m *middleware) later(ctx context.Context, task *asynq.Task, err error, retryAt time.Time) error {
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	if retried < maxRetry {
		return err
	}
	return m.deferTask(ctx, task, err, retryAt, maxRetry-retried)
}
