package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// A reservation lapses claim timeout after its instant, but that instant may be hours
// ahead: a task deleted, archived or completed meanwhile would keep its slot from the
// tasks behind it until then. The sweep releases such reservations: it lists each task
// type's reservations (throttle.Limiter.Reservations) and asks asynq whether the task that
// holds each one (its Holder, see holder) still exists.

// Defaults of SweeperConfig.
const (
	// DefaultSweepInterval is SweeperConfig.Interval when left zero: half the middleware's
	// default ClaimTimeout (DefaultWakeLead + 2s), as New uses for Config.SweepInterval.
	DefaultSweepInterval = (DefaultWakeLead + claimTimeoutMargin) / 2
	// DefaultSweepGrace is SweeperConfig.Grace when left zero. The sweep does not need it
	// to be right (see Sweeper): it allows for the clocks of two Redis servers, when the
	// limiter's is not asynq's, and for a reservation's Created on a worker's clock (within
	// throttle.Config.MaxSkew), and is short enough that a task deleted right after its
	// denial loses its slot within Grace + Interval, less than the default ClaimTimeout.
	DefaultSweepGrace = time.Second
	// DefaultSweepConcurrency is SweeperConfig.Concurrency when left zero.
	DefaultSweepConcurrency = 8
)

// sweepLock is the name of the lock (throttle.Limiter.TryLock) that lets one sweeper per
// task type sweep it per interval.
const sweepLock = "sweep"

// SweeperConfig configures NewSweeper.
type SweeperConfig struct {
	// Interval is how often Run sweeps. A sweep skips a task type that another sweeper
	// (another worker process) swept less than about an Interval ago. Defaults to
	// DefaultSweepInterval.
	Interval time.Duration
	// Grace is the age under which a reservation is never released, its Created against
	// the TIME of asynq's Redis. Defaults to DefaultSweepGrace; negative: none.
	Grace time.Duration
	// Concurrency is the most asynq lookups (Inspector.GetTaskInfo) a sweep has in flight.
	// Defaults to DefaultSweepConcurrency.
	Concurrency int
	// Logger receives a Debug line for every reservation released, a Warn line for each
	// sweep in which asynq could not answer about some tasks, and, from Run, a Warn line
	// at most once a minute while sweeps fail. Defaults to slog.Default().
	Logger *slog.Logger
}

// Sweeper releases the reservations of tasks that asynq no longer holds: deleted,
// archived, or completed (or revoked) without claiming them. New starts one (see
// Config.SweepInterval); build your own to sweep from elsewhere. A Sweeper is safe for
// concurrent use.
//
// A reservation is released only when asynq says that none of the tasks that may hold it
// exists in a live state (pending, active, scheduled, retry or aggregating): its holder,
// and, as a task with no retry left is replaced by a copy (see the package doc), the
// first task (the reservation's token), the copy before the holder, the holder again, and
// the copy after it. Asked in that order, the order in which asynq holds them (a copy is
// enqueued before the task it replaces is revoked), no copy is missed while it is being
// enqueued. An error from asynq, including asynq.ErrQueueNotFound (which a Redis other
// than asynq's would also answer), keeps the reservation: it lapses on its own.
//
// A sweep costs, per task type, a lock and a listing of its reservations (HSCAN), and per
// reservation older than Grace one asynq lookup (up to five before one is released).
type Sweeper struct {
	lim      *throttle.Limiter
	rdb      redis.UniversalClient
	insp     *asynq.Inspector
	types    []string
	typeFunc func() []string // if set, lists the task types to sweep instead of types
	interval time.Duration
	lockTTL  time.Duration
	grace    time.Duration // <= 0: none
	conc     int
	log      *slog.Logger
	runLog   rate.Sometimes
}

// NewSweeper returns a Sweeper of the reservations that lim holds for taskTypes, asking
// asynq about their tasks on rdb, the client of asynq's Redis. It returns an error if lim
// or rdb is nil, a task type is empty, or cfg.Interval or cfg.Concurrency is negative.
func NewSweeper(lim *throttle.Limiter, rdb redis.UniversalClient, taskTypes []string, cfg SweeperConfig) (*Sweeper, error) {
	switch {
	case lim == nil:
		return nil, errors.New("worker: NewSweeper: nil Limiter")
	case rdb == nil:
		return nil, errors.New("worker: NewSweeper: nil Redis client; it must be the client of asynq's Redis")
	case cfg.Interval < 0:
		return nil, fmt.Errorf("worker: NewSweeper: negative Interval %s", cfg.Interval)
	case cfg.Concurrency < 0:
		return nil, fmt.Errorf("worker: NewSweeper: negative Concurrency %d", cfg.Concurrency)
	case slices.Contains(taskTypes, ""):
		return nil, errors.New("worker: NewSweeper: empty task type")
	}
	s := &Sweeper{
		lim:      lim,
		rdb:      rdb,
		insp:     asynq.NewInspectorFromRedisClient(rdb),
		types:    slices.Compact(slices.Sorted(slices.Values(taskTypes))),
		interval: cfg.Interval,
		grace:    cfg.Grace,
		conc:     cfg.Concurrency,
		log:      cfg.Logger,
		runLog:   rate.Sometimes{First: 1, Interval: time.Minute},
	}
	if s.interval == 0 {
		s.interval = DefaultSweepInterval
	}
	// The lock ends a fifth of an interval early: with the whole interval a sweeper's own
	// lock would still be there at its next tick about every other time, by a few ms.
	s.lockTTL = max(s.interval-s.interval/5, time.Millisecond)
	if s.grace == 0 {
		s.grace = DefaultSweepGrace
	}
	if s.conc == 0 {
		s.conc = DefaultSweepConcurrency
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	return s, nil
}

// Run sweeps every Interval until ctx ends, and returns ctx.Err(); or, if a Redis client
// is closed, an error wrapping redis.ErrClosed. A failed sweep is logged (at most one line
// a minute) and the next one runs as planned.
func (s *Sweeper) Run(ctx context.Context) error {
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		_, err := s.Sweep(ctx)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, redis.ErrClosed):
			return err
		case err != nil:
			s.runLog.Do(func() {
				s.log.Warn("throttle: sweep failed; reservations of tasks asynq no longer holds stay until they lapse", "err", err)
			})
		}
	}
}

// Sweep releases, on every task type that no other sweeper swept in the last Interval,
// the reservations older than Grace whose tasks asynq no longer holds, and returns how
// many it released. A reservation whose Holder the middleware did not write is left
// alone. The error is Redis's (the TIME of asynq's Redis, the lock, the listing, a
// release) or ctx's; asynq's answers are not errors: a reservation it cannot answer for is
// kept, and logged.
func (s *Sweeper) Sweep(ctx context.Context) (int, error) {
	var now time.Time
	if s.grace > 0 {
		var err error
		if now, err = s.rdb.Time(ctx).Result(); err != nil {
			return 0, fmt.Errorf("worker: sweep: read the TIME of asynq's Redis: %w", err)
		}
	}
	var errs []error
	var types []string
	all := s.types
	if s.typeFunc != nil {
		all = s.typeFunc()
	}
	for _, tt := range all { // all locks first: their instants then depend on no sweep's length
		ok, err := s.lim.TryLock(ctx, tt, sweepLock, s.lockTTL)
		if err != nil {
			errs = append(errs, fmt.Errorf("worker: sweep %s: %w", quote.Name(tt), err))
		} else if ok {
			types = append(types, tt)
		}
	}
	tally := &sweepTally{sem: make(chan struct{}, s.conc)}
	for _, tt := range types {
		if err := s.sweepType(ctx, tt, now, tally); err != nil {
			errs = append(errs, err)
			if ctx.Err() != nil {
				break
			}
		}
	}
	tally.wg.Wait()
	if tally.doubts > 0 {
		s.log.Warn("throttle: sweep could not ask asynq about some tasks; their reservations are kept",
			"reservations", tally.doubts, "err", tally.doubt)
	}
	if tally.failed > 0 {
		errs = append(errs, fmt.Errorf("worker: sweep: %d releases failed, the first: %w", tally.failed, tally.fail))
	}
	return int(tally.released), errors.Join(errs...)
}

// sweepTally is what one Sweep has done so far, over every task type.
type sweepTally struct {
	sem      chan struct{} // a slot per lookup in flight
	wg       sync.WaitGroup
	mu       sync.Mutex
	released int
	doubts   int   // reservations kept because asynq could not answer
	doubt    error // the first of asynq's errors
	failed   int   // releases that failed
	fail     error // the first of their errors
}

// sweepType settles, with at most cap(tally.sem) at a time over the whole sweep, every
// reservation of taskType older than s.grace at now.
func (s *Sweeper) sweepType(ctx context.Context, taskType string, now time.Time, tally *sweepTally) error {
	err := s.lim.Reservations(ctx, taskType, func(r throttle.Reservation) bool {
		if s.grace > 0 && now.Sub(r.Created) < s.grace {
			return true
		}
		queue, id, ok := holderOf(r.Holder)
		if !ok {
			return true // not the middleware's
		}
		select {
		case tally.sem <- struct{}{}:
		case <-ctx.Done():
			return false
		}
		tally.wg.Go(func() {
			defer func() { <-tally.sem }()
			s.settle(ctx, r, queue, id, tally)
		})
		return true
	})
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("worker: sweep %s: %w", quote.Name(taskType), err)
	}
	return nil
}

// settle asks asynq about the tasks that may hold r (see judge) and releases r if none
// exists in a live state.
func (s *Sweeper) settle(ctx context.Context, r throttle.Reservation, queue, id string, tally *sweepTally) {
	release, err := judge(r.Token, id, func(id string) (asynq.TaskState, error) {
		info, err := s.insp.GetTaskInfo(queue, id)
		if err != nil {
			return 0, fmt.Errorf("task %s of queue %q: %w", id, queue, err)
		}
		return info.State, nil
	})
	if err != nil {
		tally.mu.Lock()
		defer tally.mu.Unlock()
		if tally.doubts++; tally.doubt == nil {
			tally.doubt = err
		}
		return
	}
	if !release || ctx.Err() != nil {
		return
	}
	held, err := s.lim.Release(ctx, r.Key.TaskType, r.Token)
	tally.mu.Lock()
	defer tally.mu.Unlock()
	switch {
	case err != nil:
		if tally.failed++; tally.fail == nil {
			tally.fail = err
		}
	case held: // else claimed or lapsed meanwhile
		tally.released++
		s.log.Debug("throttle: released the reservation of a task asynq no longer holds",
			"task_type", quote.Cut(r.Key.TaskType), "token", r.Token, "tenant", quote.Cut(r.Key.Tenant), "queue", queue, "task_id", id)
	}
}

// judge reports whether the reservation of token, whose holder is the task holderID of
// one queue, may be released, lookup giving the state of a task of that queue, or its
// error. It asks about the holder, then about its lineage, in order (see lineage), and
// answers false at the first task that exists in a live state, and false with the error
// at the first lookup that fails other than with asynq.ErrTaskNotFound.
func judge(token, holderID string, lookup func(id string) (asynq.TaskState, error)) (bool, error) {
	held := func(id string) (bool, error) {
		state, err := lookup(id)
		switch {
		case errors.Is(err, asynq.ErrTaskNotFound):
			return false, nil
		case err != nil:
			return false, err
		}
		return state != asynq.TaskStateArchived && state != asynq.TaskStateCompleted, nil
	}
	if ok, err := held(holderID); ok || err != nil {
		return false, err // the common case: one lookup
	}
	for _, id := range lineage(token, holderID) {
		if ok, err := held(id); ok || err != nil {
			return false, err
		}
	}
	return true, nil
}

// lineage lists the tasks to ask about, after the holder holderID was found gone, before
// the reservation of token is released: in the order in which asynq holds them, the first
// task (token), the copy before the holder (the task that made the reservation, alive
// while it enqueues the holder), the holder again (enqueued meanwhile), and the copy after
// it (the holder may have come back too early for its reservation and been replaced, the
// decision leaving the reservation's Holder as it was). A holder that is the token itself
// has no task before it: the holder was asked already. Copies are named as copyID names
// them, "<token>:deferred:<n>". A holder of another shape gives the token and the holder.
func lineage(token, holderID string) []string {
	n := -1
	if holderID == token {
		n = 0
	} else if rest, ok := strings.CutPrefix(holderID, token+":deferred:"); ok {
		if k, err := strconv.Atoi(rest); err == nil && k >= 1 && strconv.Itoa(k) == rest {
			n = k
		}
	}
	if n < 0 {
		return []string{token, holderID}
	}
	name := func(k int) string { return token + ":deferred:" + strconv.Itoa(k) }
	var ids []string
	if n >= 1 {
		ids = append(ids, token)
	}
	if n >= 2 {
		ids = append(ids, name(n-1))
	}
	if n >= 1 {
		ids = append(ids, holderID)
	}
	return append(ids, name(n+1))
}

// startSweep starts the background sweep of the task types with a rule, default or
// override (see Config.SweepInterval): a Sweeper run until cfg.Context ends.
func (m *middleware) startSweep(cfg Config) error {
	if cfg.SweepInterval < 0 || len(cfg.Rules) == 0 && cfg.Overrides == nil {
		return nil
	}
	interval := cfg.SweepInterval
	if interval == 0 {
		interval = m.claimTimeout / 2
	}
	if interval <= 0 {
		return fmt.Errorf("worker: sweep interval ClaimTimeout / 2 = %s is not positive; set Config.SweepInterval or a positive ClaimTimeout", interval)
	}
	s, err := NewSweeper(m.lim, cfg.Redis, nil, SweeperConfig{Interval: interval, Logger: m.log})
	if err != nil {
		return err
	}
	s.typeFunc = func() []string { return m.limits.Load().taskTypes() } // at each sweep: overrides may add types
	ctx := cfg.Context
	if ctx == nil {
		ctx = context.Background()
	}
	go func() { _ = s.Run(ctx) }()
	return nil
}
