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
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
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
	// middleware re-enqueues there the copy of a denied task that has no retry left. New
	// reads its maxmemory-policy (CheckEvictionPolicy) and warns unless it is NoEviction.
	// Required.
	Redis redis.UniversalClient
	// NoEvictionCheck skips New's check of Redis's maxmemory-policy, for a Redis that has
	// no such setting (an embedded miniredis). Defaults to false: New checks.
	NoEvictionCheck bool
	// FailOpen runs a task unthrottled when the limiter cannot decide (Redis unreachable
	// or timing out past UnavailableWait). Defaults to false: fail closed, the task does
	// not run and comes back after UnavailableRetryDelay, not counted as a failure.
	FailOpen bool
	// UnavailableWait is how long the middleware keeps asking an unreachable limiter, with
	// the same event id, before it gives up on this attempt. The same id means a decision
	// whose reply was lost is found again and not made twice: a task never takes a slot
	// that it then does not use because of a lost reply shorter than this. Defaults to
	// DefaultUnavailableWait; bounded by the task's deadline. While the limiter is down
	// only one task at a time keeps asking it so (the probe); the others whose decision
	// needs the limiter are re-queued at once for UnavailableRetryDelay (or run, with
	// FailOpen) without a call, so that the worker's slots stay free for tasks that need
	// no limiter. New returns an error if it is negative.
	UnavailableWait time.Duration
	// Concurrency is the asynq server's Config.Concurrency (the worker slots): at most
	// Concurrency - 1 handlers then sit out a wait for a slot ahead (MaxWait, NewcomerWait)
	// at any time, so that one worker slot at least is always left to tasks that can run
	// now (other task types, tasks due now) and no burst of throttled tasks holds every slot
	// hostage. A task that would wait when no waiting slot is free asks the limiter for now
	// only: it runs if it can start at once, and otherwise is re-queued for its
	// reservation (a denial, no retry spent), which it keeps. With Concurrency 1 the one
	// worker may wait (no slot can be left over there, and with none a reserved task would
	// never run: asynq re-queues in whole seconds, so it never comes back on its very
	// millisecond). Defaults to 0: no bound, every worker slot may wait (before this field
	// existed, the only behaviour).
	//
	// Bounded waiting slots change two things, so that the tasks due in each second fit
	// them. Reservations are spread out (throttle.Request.Spread: at the average rate of
	// the tenant quota that holds them back, Window/Events per unit of cost): without it a
	// backlog's reservations fall on the instants of the admissions that filled the first
	// window, as many per instant as ran at once (Concurrency), more than Concurrency - 1
	// slots can wait for, and a task that cannot wait for its instant comes back after it
	// and loses its slot. And while two waiting slots or more, and half of them or more,
	// are taken, a task comes back for its reservation into a slot only from
	// scarceClaimWait before its instant (WakeLead less asynq's whole second), so that
	// slots go to the tasks due soonest; one due later is re-queued at once (a denial,
	// writing nothing) and asks again one forwarder interval later. With
	// Concurrency 10, "tenant=20/1s" and a backlog, reserved tasks so get their whole
	// limit (TestWaitSlots_notHostage), against 45-50 % without either, at the cost of a
	// few more limiter calls per task (each a claim ahead, denied). New returns an error if
	// it is negative.
	Concurrency int
	// NoReservations turns reservations off: a denied task is told to retry when the
	// oldest entry it waits for leaves the window, the instant every task denied meanwhile
	// is told too (the naive schedule, whose thundering herd cmd/throttlebench measures).
	// Defaults to false: each denied task holds a reservation (throttle.Request.Reservation)
	// for its own slot, so tasks denied together come back one slot apart, in order.
	NoReservations bool
	// MaxWait is the longest a task waits inside its handler for a slot instead of being
	// re-queued, never past its deadline: the limiter admits it for a slot at most that far
	// ahead (throttle.Request.ClaimWait, throttle.Decision.Delay) and the task starts then.
	// The task holds its worker slot meanwhile. With reservations it applies to a task
	// coming back for its reservation; a task denied for the first time waits at most
	// NewcomerWait. Defaults to DefaultMaxWait; negative: never wait in the handler, which
	// needs NoReservations (New returns an error otherwise: a task that cannot wait for
	// its reserved instant comes back after it, when its slot is promised to the next).
	MaxWait time.Duration
	// WakeLead is how long before its reserved instant a re-queued task is scheduled to
	// come back. asynq stores retry times in whole seconds and moves due tasks back to
	// their queue every DelayedTaskCheckInterval, then a worker polls for them: a task
	// scheduled at its exact instant starts up to 1s + that interval + the poll late,
	// and, the limiter being exact, so does every task whose slot follows its own. Woken
	// WakeLead early (the wake instant rounded up to a whole second, so that asynq never
	// delivers it before the wake instant) it arrives before its instant and waits the
	// rest in the handler. Defaults to DefaultWakeLead, which fits WrapConfig's forwarder
	// interval; set it to 1s + your DelayedTaskCheckInterval + ~250ms, and MaxWait above
	// it (a task never waits longer than MaxWait: a larger WakeLead wakes it MaxWait
	// early). Ignored with NoReservations. New returns an error if it is negative.
	WakeLead time.Duration
	// ClaimTimeout is how long after its reserved instant a task may still claim its
	// reservation (throttle.Request.ClaimTimeout); later, the reservation lapses and stops
	// holding the slot, and the task waits like a newcomer. Defaults to WakeLead + 2s: a
	// task woken WakeLead early arrives before its instant unless the workers are busy.
	// New returns an error if it is negative.
	ClaimTimeout time.Duration
	// QueuePriority maps an asynq queue name to the priority of its tasks' reservations
	// (throttle.Request.Priority, 0 to throttle.MaxPriority): a denied task of a higher
	// priority takes the earliest slot held by a reservation of a lower one on its logs, and
	// the task displaced waits for a later slot. QueuePriorities derives it from the
	// asynq.Config.Queues weights. Ignored with NoReservations. Defaults to nil: every task
	// has priority 0. New returns an error for a priority out of range.
	QueuePriority map[string]int
	// WeightFunc, if set, gives each tenant its share of a type-wide quota (ScopeType):
	// tenants with waiting tasks get its slots in proportion to their weights, from 1 to
	// throttle.MaxWeight. A weight set by Overrides (a tier's or the tenant's) wins over
	// it. Defaults to 1 for every tenant: equal shares.
	WeightFunc func(key throttle.Key) int
	// Overrides, if set, is where the middleware reads the tiers and overrides that refine
	// Rules at runtime (see Overrides and OverrideStore): once in New, then every
	// OverrideInterval until Context ends, with one HGET of the version per check and one
	// HGETALL when it changed. A set that cannot be read or does not parse leaves the one
	// read last in force (at first: Rules alone); that is logged once until a read
	// succeeds again, and reported to OverrideReloadFunc each time.
	Overrides *OverrideStore
	// OverrideInterval is how often the middleware checks Overrides for a change. A change
	// is in force on every worker within about this plus a round trip. Defaults to
	// DefaultOverrideInterval.
	OverrideInterval time.Duration
	// OverrideReloadFunc, if set, is called after every reload of Overrides, e.g. to count
	// reloads by result: with the version now in force and a nil error when a changed set
	// took effect, and with the version still in force (-1: Rules alone, nothing read yet)
	// and the error when checking, reading or parsing failed. A check that finds no change
	// calls nothing. It is called from one goroutine at a time.
	OverrideReloadFunc func(version int64, err error)
	// SweepInterval is how often the middleware releases the reservations of tasks that
	// asynq no longer holds (deleted, archived, completed; see Sweeper), so their slots go
	// to the tasks behind them. Defaults to ClaimTimeout / 2; negative: never. The sweep
	// runs in the background until Context ends.
	SweepInterval time.Duration
	// Context bounds the middleware's background work (the sweep). Defaults to
	// context.Background(): the life of the process.
	Context context.Context
	// Logger receives a line for every task that can never fit (bad cost, cost over a
	// limit), each fail-open run, clock-skew fallbacks (at most one a minute), and, from
	// New, Redis's maxmemory-policy if it is not NoEviction or cannot be read. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Metrics, if set, records decisions by task type and outcome, delays, limiter calls,
	// tasks waiting in handlers and the reservations held (see NewMetrics).
	Metrics *Metrics
	// DecisionFunc, if set, is called after every decision the limiter makes, admitted or
	// denied, with the task's key, e.g. to count or log throttling. It must be fast and
	// safe for concurrent use.
	DecisionFunc func(ctx context.Context, task *asynq.Task, key throttle.Key, d throttle.Decision)
	// NowFunc is the middleware's clock, for the retry instants and waits it computes; give
	// it the clock of the Limiter's throttle.Config.NowFunc. Defaults to time.Now. asynq
	// reads time.Now for when a retry is due, so a NowFunc off from it by d brings
	// re-queued tasks back d late (ahead) or early (behind): a test that moves it moves
	// WakeLead and MaxWait with it.
	NowFunc func() time.Time
}

// Defaults of Config.
const (
	// DefaultUnavailableWait is Config.UnavailableWait when left zero.
	DefaultUnavailableWait = 5 * time.Second
	// DefaultWakeLead is Config.WakeLead when left zero: asynq's whole-second retry
	// times (1s), WrapConfig's forwarder interval (DefaultDelayedTaskCheckInterval) and
	// 250ms for polling and a round trip.
	DefaultWakeLead = time.Second + DefaultDelayedTaskCheckInterval + 250*time.Millisecond
	// DefaultMaxWait is Config.MaxWait when left zero: a little more than DefaultWakeLead,
	// so that a task woken early waits in its handler instead of being re-queued again.
	DefaultMaxWait = DefaultWakeLead + 250*time.Millisecond
	// PauseRecheck is the longest a task denied by a pause (throttle.Limiter.Pause, an
	// upstream 429, cmd/throttle pause) stays away: it comes back at the pause's end or
	// after PauseRecheck, whichever is first, and is denied again (writing nothing) while
	// the pause lasts. asynq holds a re-queued task until its retry instant whatever
	// happens meanwhile, so without it a task denied by a long pause would wait out the
	// whole pause even after a resume.
	PauseRecheck = time.Minute
	// NewcomerWait is the longest a task denied for the first time (holding no reservation
	// yet) waits in its handler, with reservations; a longer wait re-queues it. MaxWait is
	// for tasks coming back for their reservation.
	NewcomerWait = 250 * time.Millisecond
	// DefaultOverrideInterval is Config.OverrideInterval when left zero.
	DefaultOverrideInterval = time.Second
	// claimTimeoutMargin is ClaimTimeout beyond WakeLead when left zero.
	claimTimeoutMargin = 2 * time.Second
)

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
	lastUnavail  atomic.Int64 // unix ns of the last "limiter unavailable" log line
	lim          *throttle.Limiter
	claimTimeout time.Duration
	weight       func(throttle.Key) int
	priority     map[string]int
	limits       atomic.Pointer[limitSet] // Rules with the overrides in force
	header       string
	client       *asynq.Client
	inspector    *asynq.Inspector
	rdb          redis.UniversalClient // asynq's Redis: a deferred Unique task's lock (deferral.go)
	failOpen     bool
	reserve      bool
	maxWait      time.Duration // < 0: never wait in the handler
	slots        waitSlots     // Concurrency - 1 handlers (at least 1) may wait; nil: any number
	health       limiterHealth
	lead         time.Duration
	wait         time.Duration
	log          *slog.Logger
	metrics      *Metrics
	observe      func(context.Context, *asynq.Task, throttle.Key, throttle.Decision)
	now          func() time.Time
	skewLog      rate.Sometimes
	shadowLog    shadowLogger
}

// New returns asynq middleware that decides each task of a ruled type against lim before
// the handler runs. An admitted task runs with its Decision in the context (see
// DecisionFrom). A denied task returns a *throttle.DeniedError (use WrapConfig so asynq
// retries it at the right time without counting a failure), or, if asynq would archive
// it because it has no retry left, is re-enqueued as a copy due at the retry instant.
//
// With at least one rule and unless cfg.NoEvictionCheck, New reads the maxmemory-policy
// of cfg.Redis (CheckEvictionPolicy, within 2s and cfg.Context) and logs one line unless it
// is NoEviction: a warning (and Metrics.EvictionPolicyUnsafe set to 1) for another
// policy, an Info line if it cannot read it (CONFIG renamed or forbidden). Either way New
// goes on. With at least one rule, New also asks lim's Redis for its version
// (throttle.Limiter.CheckServer) and returns its error for one older than
// throttle.MinRedisVersion (7.0), whose script calls would fail.
//
// New returns an error if lim or cfg.Redis is nil, a rule is invalid (Rule.Validate), two
// rules name one task type, or cfg.OverrideInterval, UnavailableWait, WakeLead,
// Concurrency or ClaimTimeout is negative (MaxWait may be, with NoReservations). With cfg.Overrides it
// reads them before it returns (see Config.Overrides).
func New(lim *throttle.Limiter, cfg Config) (asynq.MiddlewareFunc, error) {
	if lim == nil {
		return nil, errors.New("worker: nil Limiter")
	}
	if cfg.Redis == nil {
		return nil, errors.New("worker: Config.Redis is nil; it must be the client of asynq's Redis")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"OverrideInterval", cfg.OverrideInterval}, {"UnavailableWait", cfg.UnavailableWait}, {"WakeLead", cfg.WakeLead}} {
		if d.v < 0 {
			return nil, fmt.Errorf("worker: %s %s < 0", d.name, d.v)
		}
	}
	if cfg.Concurrency < 0 {
		return nil, fmt.Errorf("worker: Concurrency %d < 0; want asynq's Config.Concurrency, or 0 for no bound on waiting slots", cfg.Concurrency)
	}
	m := &middleware{
		lim:       lim,
		header:    cfg.TenantHeader,
		client:    asynq.NewClientFromRedisClient(cfg.Redis),
		inspector: asynq.NewInspectorFromRedisClient(cfg.Redis),
		rdb:       cfg.Redis,
		failOpen:  cfg.FailOpen,
		reserve:   !cfg.NoReservations,
		maxWait:   cfg.MaxWait,
		slots:     newWaitSlots(cfg.Concurrency),
		lead:      cfg.WakeLead,
		wait:      cfg.UnavailableWait,
		log:       cfg.Logger,
		metrics:   cfg.Metrics,
		observe:   cfg.DecisionFunc,
		now:       time.Now,
		skewLog:   rate.Sometimes{First: 1, Interval: time.Minute},
		shadowLog: shadowLogger{unavailable: rate.Sometimes{First: 1, Interval: time.Minute}},
	}
	if cfg.NowFunc != nil {
		m.now = cfg.NowFunc
	}
	if m.header == "" {
		m.header = producer.TenantHeader
	}
	if m.wait == 0 {
		m.wait = DefaultUnavailableWait
	}
	if m.maxWait == 0 {
		m.maxWait = DefaultMaxWait
	}
	if m.lead == 0 {
		m.lead = DefaultWakeLead
	}
	if !m.reserve {
		m.lead = 0
	}
	if m.reserve && m.maxWait < 0 {
		return nil, errors.New("worker: MaxWait < 0 (never wait in a handler) needs NoReservations: " +
			"a task that cannot wait for its reserved instant comes back after it, when its slot is promised to the next task")
	}
	if cfg.ClaimTimeout < 0 {
		return nil, fmt.Errorf("worker: ClaimTimeout %s < 0: a reservation must stay claimable for some time after its instant", cfg.ClaimTimeout)
	}
	m.claimTimeout = cfg.ClaimTimeout
	if m.claimTimeout == 0 {
		m.claimTimeout = max(m.lead, 0) + claimTimeoutMargin
	}
	m.weight = cfg.WeightFunc
	if err := checkQueuePriority(cfg.QueuePriority); err != nil {
		return nil, err
	}
	m.priority = cfg.QueuePriority
	if m.log == nil {
		m.log = slog.Default()
	}
	seen := make(map[string]bool, len(cfg.Rules))
	for _, r := range cfg.Rules {
		if err := r.Validate(); err != nil {
			return nil, err
		}
		if seen[r.TaskType] {
			return nil, fmt.Errorf("worker: two rules for task type %q; put all its quotas in one rule", r.TaskType)
		}
		seen[r.TaskType] = true
	}
	m.limits.Store(compileLimits(cfg.Rules, nil))
	if err := m.startOverrides(cfg); err != nil {
		return nil, err
	}
	if err := m.startSweep(cfg); err != nil {
		return nil, err
	}
	types := m.limits.Load().taskTypes()
	if len(types) > 0 {
		ctx := cfg.Context
		if ctx == nil {
			ctx = context.Background()
		}
		ctx, cancel := context.WithTimeout(ctx, evictionCheckTimeout)
		defer cancel()
		if !cfg.NoEvictionCheck {
			_, _ = CheckEvictionPolicy(ctx, cfg.Redis, m.log, m.metrics) // logged; a worker runs either way
		}
		if err := lim.CheckServer(ctx); err != nil { // a Redis 6 would fail every task that must wait
			return nil, fmt.Errorf("worker: %w", err)
		}
	}
	m.metrics.throttles(lim, types, m.reserve)
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			return m.process(ctx, task, next)
		})
	}, nil
}

type decisionKey struct{}

// DecisionFrom returns the admission Decision of the task whose handler got ctx, and
// false if the task ran without one: no rule for its type, run unthrottled by FailOpen or
// overdue=run, or run by a shadow rule (ModeShadow) that would have held it back.
func DecisionFrom(ctx context.Context) (throttle.Decision, bool) {
	d, ok := ctx.Value(decisionKey{}).(throttle.Decision)
	return d, ok
}

func (m *middleware) process(ctx context.Context, task *asynq.Task, next asynq.Handler) error {
	key := throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[m.header]}
	eff, ok := m.limits.Load().resolve(key)
	if !ok {
		return next.ProcessTask(ctx, task)
	}
	growStack() // once, while shallow, for the limiter call's depth (see handlerStack)
	rule := eff.Rule
	next = m.watch(next, key, eff)
	cost, err := rule.cost(task)
	if rule.Mode == ModeShadow {
		return m.shadow(ctx, task, next, key, eff, cost, err)
	}
	if err != nil {
		return m.reject(ctx, key, rule, err)
	}
	slot := m.slots.take() // may wait for a slot ahead; given back after the wait
	req := m.request(ctx, task, key, eff, cost, slot)
	d, asked, err := m.allow(ctx, req)
	if slot && (err != nil || !d.Allowed) {
		m.slots.give()
	}
	switch {
	case errors.Is(err, throttle.ErrInvalid):
		return m.reject(ctx, key, rule, err)
	case err != nil && m.failOpen:
		m.metrics.count(key, OutcomeFailedOpen)
		m.log.Warn("throttle: limiter unavailable, running task unthrottled (FailOpen)",
			"task_type", quote.Cut(key.TaskType), "tenant", quote.Cut(key.Tenant), "err", err)
		return next.ProcessTask(ctx, task)
	case err != nil:
		m.metrics.count(key, OutcomeUnavailable)
		m.logUnavailable(key, err)
		return m.later(ctx, task, fmt.Errorf("%w: %w", ErrUnavailable, err), m.now().Add(UnavailableRetryDelay), "", 0)
	}
	m.checkSkew(key, d)
	if m.observe != nil {
		m.observe(ctx, task, key, d)
	}
	if d.Allowed {
		return m.run(ctx, task, next, key, d, asked, slot)
	}
	if reason := m.overdue(ctx, rule, d); reason != "" {
		return m.giveUp(ctx, task, next, rule, req, reason)
	}
	wake := m.now().Add(d.RetryAfter)
	if d.Reserved {
		wake = wake.Add(-m.leadFor(ctx))
	}
	denied := &throttle.DeniedError{
		Key:        key,
		Quota:      d.Quota,
		RetryAfter: d.RetryAfter,
		RetryAt:    wake, // local clock, as asynq's retry scores
		Paused:     d.Paused,
	}
	if d.Paused {
		err := fmt.Errorf("worker: %s paused (Backpressure after an upstream 429/503, or throttle pause) until %s: %w", scopeWords(d.Quota.Scope),
			d.RetryAt().UTC().Format(time.RFC3339Nano), denied)
		if recheck := m.now().Add(PauseRecheck); denied.RetryAt.After(recheck) {
			denied.RetryAt = recheck // so that a resume reaches it (RetryDelayFunc reads it)
		}
		return m.later(ctx, task, err, denied.RetryAt, OutcomePaused, d.RetryAfter)
	}
	return m.later(ctx, task, denied, denied.RetryAt, OutcomeDenied, d.RetryAfter)
}

// watch returns next with its error looked at by afterHandler: a handler that returns a
// *BackpressureError pauses the quota and is re-queued (see Backpressure).
func (m *middleware) watch(next asynq.Handler, key throttle.Key, eff Effective) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		return m.afterHandler(ctx, task, key, eff, next.ProcessTask(ctx, task))
	})
}

// request is the limiter's request for task, of key and cost, under eff: with the weight
// of eff (a tier's or the tenant's), else WeightFunc's, and a reservation (of its queue's
// priority) unless NoReservations. Only a task that holds a waiting slot (slot) may be
// admitted for an instant ahead; without one, MaxWait and ClaimWait are 0: admitted for
// now, else denied (a reservation it holds is kept, see waitSlots).
func (m *middleware) request(ctx context.Context, task *asynq.Task, key throttle.Key, eff Effective, cost int, slot bool) throttle.Request {
	wait := func(d time.Duration) time.Duration {
		if !slot {
			return 0
		}
		return m.waitFor(ctx, d)
	}
	req := throttle.Request{Key: key, Quotas: eff.Rule.Quotas, Cost: cost, Member: throttle.NewMember(),
		MaxWait: wait(m.maxWait), Weight: m.weightFor(key, eff)}
	if m.reserve {
		req.Reservation = reservationID(ctx, task)
		req.Holder = m.holder(ctx, task)
		req.MaxWait = wait(min(NewcomerWait, m.maxWait))
		req.ClaimWait = wait(m.maxWait)
		if m.slots != nil {
			req.Spread = true
			if slot && m.slots.scarce() {
				req.ClaimWait = min(req.ClaimWait, m.scarceClaimWait())
			}
		}
		req.ClaimTimeout = m.claimTimeout
		req.Priority = m.priorityOf(ctx)
	}
	return req
}

// scarceClaimWait is the ClaimWait of a task that takes a waiting slot while they are
// scarce (waitSlots.scarce): WakeLead less asynq's whole second of retry-time rounding, so the
// forwarder interval and 250ms (DefaultWakeLead), at least 250ms. A task re-queued at once
// (its wake instant past) is back within about one forwarder interval and a poll, less
// than that, so it is asked again inside the span and never skips over it to come back
// late.
func (m *middleware) scarceClaimWait() time.Duration {
	return max(m.lead-time.Second, 250*time.Millisecond)
}

// weightFor is key's share of its rule's ScopeType quotas: eff's (a tier's or the
// tenant's), else WeightFunc's clamped to [1, throttle.MaxWeight], else 0 (the limiter's
// default, 1).
func (m *middleware) weightFor(key throttle.Key, eff Effective) int {
	if eff.Weight > 0 {
		return eff.Weight
	}
	if m.weight != nil {
		return min(max(m.weight(key), 1), throttle.MaxWeight)
	}
	return 0
}

// run starts the handler of a task admitted by d: at once, or after d.Delay when it was
// admitted for a slot a little ahead (the limiter logged its admission at that instant,
// so starting earlier would break the window that the API sees). If ctx ends while it
// waits, the task returns ctx's error and asynq retries it as it would any task whose
// context ended; the slot it was given goes unused.
//
// A clock ahead of the Redis server's TIME, within MaxSkew (the limiter trusts it), logs
// its admissions that far ahead of the others' and would start them that early: an entry
// another worker logged at t leaves the window at t + W on this clock, before t + W on
// the others'. So the task also waits out how far this clock was ahead (Decision.Skew, if
// positive and read: ServerTime set, no SkewFallback): it starts at its logged instant on
// Redis's clock, which every worker's admissions agree with.
//
// The wait counts from asked, when the call that decided was made (Delay is At less the
// call's own instant), so a slow reply shortens it rather than making the task start late.
//
// slot says that the task holds a waiting slot (see waitSlots): run gives it back when the
// wait is over, before the handler starts. A task without one was asked for now only, so
// its Delay is at most the few ms by which its clock is behind the log's; it sits that
// and its skew out all the same (starting earlier would break the window), uncounted in
// TasksWaiting, which counts the holders of waiting slots.
func (m *middleware) run(ctx context.Context, task *asynq.Task, next asynq.Handler, key throttle.Key, d throttle.Decision, asked time.Time, slot bool) error {
	wait := max(d.Delay-time.Since(asked), 0)
	if !d.ServerTime.IsZero() && !d.SkewFallback && d.Skew() > 0 {
		wait += d.Skew()
	}
	if d.Delay > 0 {
		m.metrics.delayed(key, OutcomeWaited, d.Delay)
	} else {
		m.metrics.count(key, OutcomeAdmitted)
	}
	if wait > 0 {
		if slot {
			m.metrics.waiting(key.TaskType, 1)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if slot {
			m.metrics.waiting(key.TaskType, -1)
			m.slots.give()
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	} else if slot {
		m.slots.give()
	}
	return next.ProcessTask(context.WithValue(ctx, decisionKey{}, d), task)
}

// waitFor is the longest a task may wait in its handler: d (negative: not at all), and no
// later than 100ms before ctx's deadline, so that the handler still has time to start.
func (m *middleware) waitFor(ctx context.Context, d time.Duration) time.Duration {
	d = max(d, 0)
	if dl, ok := ctx.Deadline(); ok {
		d = min(d, max(dl.Sub(m.now())-100*time.Millisecond, 0))
	}
	return d
}

// holder names the asynq task that will hold the reservation this attempt may make, for
// the sweep to ask asynq about: this task, or, if it has no retry left (it would be
// replaced by a copy, see deferTask), the copy. See holderOf.
func (m *middleware) holder(ctx context.Context, task *asynq.Task) string {
	queue, _ := asynq.GetQueueName(ctx)
	id, _ := asynq.GetTaskID(ctx)
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	if retried >= maxRetry {
		id = copyID(task, id)
	}
	return strconv.Itoa(len(queue)) + ":" + queue + id
}

// holderOf reads a holder written by holder: the queue and the task id.
func holderOf(h string) (queue, id string, ok bool) {
	n, rest, ok := strings.Cut(h, ":")
	l, err := strconv.Atoi(n)
	if !ok || err != nil || l < 0 || l > len(rest) {
		return "", "", false
	}
	return rest[:l], rest[l:], true
}

// overdue returns why the task, denied by d, would wait too long under rule (longer than
// rule.MaxDelay, or past its asynq Deadline), or "" if it would not.
func (m *middleware) overdue(ctx context.Context, rule Rule, d throttle.Decision) string {
	if rule.MaxDelay > 0 && d.RetryAfter > rule.MaxDelay {
		return fmt.Sprintf("would wait %s for a slot, more than max-delay %s", d.RetryAfter, rule.MaxDelay)
	}
	start := m.now().Add(d.RetryAfter)
	dl, ok := ctx.Deadline()
	if !ok || !start.After(dl) {
		return ""
	}
	// The context's deadline is also the attempt's Timeout, which a re-queue renews: only
	// the task's own Deadline, read from asynq, is final.
	id, _ := asynq.GetTaskID(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	info, err := m.inspector.GetTaskInfo(queue, id)
	if err != nil || info.Deadline.IsZero() || !start.After(info.Deadline) {
		return ""
	}
	return fmt.Sprintf("throttled until %s, after its deadline %s", start.Format(time.RFC3339), info.Deadline.Format(time.RFC3339))
}

// giveUp ends a task the throttle would hold back too long, as rule.Overdue says, after
// giving up its reservation so that the slot goes to the next task.
func (m *middleware) giveUp(ctx context.Context, task *asynq.Task, next asynq.Handler, rule Rule, req throttle.Request, reason string) error {
	start := time.Now()
	err := m.lim.Cancel(ctx, req)
	if req.Reservation != "" { // else Cancel sends nothing to Redis
		m.metrics.called(req.Key.TaskType, CallCancel, start, err)
	}
	if err != nil {
		m.log.Warn("throttle: could not cancel the reservation of an overdue task; its slot stays held for a window",
			"task_type", quote.Cut(req.Key.TaskType), "tenant", quote.Cut(req.Key.Tenant), "err", err)
	}
	m.metrics.count(req.Key, OutcomeOverdue)
	id, _ := asynq.GetTaskID(ctx)
	m.log.Warn("throttle: task overdue: "+reason, "task_id", id, "task_type", quote.Cut(req.Key.TaskType),
		"tenant", quote.Cut(req.Key.Tenant), "rule", rule.String(), "overdue", rule.Overdue.String())
	err = fmt.Errorf("worker: rule %q: task %s %s", rule.String(), id, reason)
	switch rule.Overdue {
	case OverdueRun:
		return next.ProcessTask(ctx, task)
	case OverdueDrop:
		return fmt.Errorf("%w; dropped: %w", err, asynq.RevokeTask)
	default:
		return fmt.Errorf("%w; archived: %w", err, asynq.SkipRetry)
	}
}

// leadFor is how early to wake a re-queued reserved task: WakeLead, but no more than the
// task will be able to wait in its handler when it comes back (MaxWait, and what is left of
// this attempt's deadline, which the next attempt gets again at least), so that it is
// never woken only to be re-queued again.
func (m *middleware) leadFor(ctx context.Context) time.Duration {
	lead := min(m.lead, max(m.maxWait, 0))
	if dl, ok := ctx.Deadline(); ok {
		lead = min(lead, max(dl.Sub(m.now())-100*time.Millisecond, 0))
	}
	return lead
}

// reservationID is the id under which a task holds its reservation: its asynq task id,
// or, for a copy that replaced a task with no retry left, the first task's id (the copy
// comes back for the reservation the original was given).
func reservationID(ctx context.Context, task *asynq.Task) string {
	if id := task.Headers()[HeaderOriginID]; id != "" {
		return id
	}
	id, _ := asynq.GetTaskID(ctx)
	return id
}

// replayLateness is how far past its instant a replayed admission (Decision.Replay: a
// retry found what an attempt whose reply was lost had decided) may be and still start
// the task: the first retry's backoff (50ms) and a round trip. Later than that, as after
// durable mode waited seconds for a replica, or an outage, the task would start that much
// after the instant the log counts it at, and an upstream with the same limit could see
// one more than the limit in a window: allow asks again as a new event instead.
const replayLateness = 100 * time.Millisecond

// allow asks the limiter, and while it cannot answer (a Redis error, not ErrInvalid) asks
// again with the same request, so the same event id, for up to m.wait and never past
// ctx's deadline: a decision made by a call whose reply was lost is then found and
// reported again (Decision.Replay), not made a second time; an admission so found more than
// replayLateness past its instant is not run on, and the event is asked again afresh. Only one task at a time asks
// a limiter whose Redis is failing (see limiterHealth): any other returns errProbing at
// once, before or after its first call. A task that gives up so after a call whose reply
// was lost leaves the slot that call may have taken unused until it leaves the window:
// the limit is never exceeded, a slot may be lost. It also returns when the call that
// decided was made (monotonic): Decision.Delay counts from then, not from the reply.
func (m *middleware) allow(ctx context.Context, req throttle.Request) (throttle.Decision, time.Time, error) {
	call, probe := m.health.enter()
	if !call {
		return throttle.Decision{}, time.Time{}, errProbing
	}
	defer func() { m.health.leave(probe) }()
	giveUp := m.now().Add(m.wait)
	if dl, ok := ctx.Deadline(); ok && dl.Before(giveUp) {
		giveUp = dl
	}
	backoff := 50 * time.Millisecond
	req.Fresh = true // the first attempt: its member was never sent, so it is no replay
	for {
		start := time.Now()
		d, err := m.lim.Allow(ctx, req)
		m.metrics.called(req.Key.TaskType, CallAllow, start, err)
		if errors.Is(err, throttle.ErrInvalid) { // sent nothing to Redis
			return d, start, err
		}
		if err == nil {
			m.health.ok()
			if d.Allowed && d.Replay && m.now().Sub(d.At) > replayLateness {
				// An earlier attempt was admitted but its reply was lost (or, in durable
				// mode, not acknowledged in time), for an instant long past: started now,
				// the task would run outside the window the log counts it in. Ask again as
				// a new event; the old admission stays counted where it was logged (a slot
				// may be lost, never the limit).
				req.Member, req.Fresh = throttle.NewMember(), true
				continue
			}
			return d, start, nil
		}
		if !m.health.failed(ctx, &probe) || !m.now().Add(backoff).Before(giveUp) {
			return d, start, err
		}
		req.Fresh = false // the script may have decided it: a repeat is looked for
		select {
		case <-ctx.Done():
			return d, start, err
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// reject ends a task that can never be decided (its cost is unreadable, or more than a
// quota's Events): it logs a line naming the rule and returns err with asynq.SkipRetry,
// so asynq archives the task with that reason instead of throttling it forever.
func (m *middleware) reject(ctx context.Context, key throttle.Key, rule Rule, err error) error {
	m.metrics.count(key, OutcomeRejected)
	id, _ := asynq.GetTaskID(ctx)
	m.log.Error("throttle: task can never run under its rule; archiving it",
		"task_id", id, "task_type", quote.Cut(key.TaskType), "tenant", quote.Cut(key.Tenant), "rule", rule.String(), "err", err)
	if errors.Is(err, ErrBadCost) { // already "worker: bad task cost: ..."
		return fmt.Errorf("%w (rule %q): %w", err, rule.String(), asynq.SkipRetry)
	}
	return fmt.Errorf("worker: rule %q: %w: %w", rule.String(), err, asynq.SkipRetry)
}

// checkSkew logs (at most once a minute) and counts a decision made by the server's clock
// because the local one was off by more than the limiter's tolerance.
func (m *middleware) checkSkew(key throttle.Key, d throttle.Decision) {
	if m.metrics != nil && !d.ServerTime.IsZero() { // a denial may be decided without reading it
		m.metrics.ClockSkew.Set(d.Skew().Seconds())
		if d.SkewFallback {
			m.metrics.SkewFallbacks.WithLabelValues(key.TaskType).Inc()
		}
	}
	if d.SkewFallback {
		m.skewLog.Do(func() {
			m.log.Warn("throttle: this worker's clock is off from the Redis server's (or Redis ran the call late); deciding by the server's TIME",
				"skew", d.Skew(), "task_type", quote.Cut(key.TaskType))
		})
	}
}

// later returns err, which asynq retries without counting a failure (WrapConfig), if the
// task has a retry left; otherwise asynq would archive it, so it re-enqueues a copy due
// at retryAt and revokes the task (deferTask). outcome, unless "", is counted with delay,
// the wait the task was given: OutcomeDenied becomes OutcomeDeferred for a copy; other
// outcomes are counted as they are either way.
func (m *middleware) later(ctx context.Context, task *asynq.Task, err error, retryAt time.Time, outcome string, delay time.Duration) error {
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, _ := asynq.GetMaxRetry(ctx)
	key := throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[m.header]}
	if retried < maxRetry {
		if outcome != "" {
			m.metrics.delayed(key, outcome, delay)
		}
		return err
	}
	if outcome == OutcomeDenied {
		outcome = OutcomeDeferred
	}
	if outcome != "" {
		m.metrics.delayed(key, outcome, delay)
	}
	return m.deferTask(ctx, task, err, retryAt, maxRetry-retried)
}

// unavailableLogEvery is how often at most the middleware logs that the limiter could not
// decide: an outage or durable mode's unacknowledged admissions would otherwise leave
// tasks waiting with nothing in the log but a metric.
const unavailableLogEvery = 10 * time.Second

// logUnavailable logs, at most once per unavailableLogEvery, that a task goes back to
// asynq because the limiter could not decide it, with the error
// (throttle.ErrNotReplicated's says how many replicas acknowledged).
func (m *middleware) logUnavailable(key throttle.Key, err error) {
	now := m.now().UnixNano()
	last := m.lastUnavail.Load()
	if now-last < int64(unavailableLogEvery) || !m.lastUnavail.CompareAndSwap(last, now) {
		return
	}
	m.log.Warn("throttle: the limiter could not decide; tasks go back to asynq for UnavailableRetryDelay (counted as unavailable), logged at most every 10s",
		"task_type", quote.Cut(key.TaskType), "tenant", quote.Cut(key.Tenant), "err", err)
}
