package throttle

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/rs/xid"

	"github.com/asynq-throttle/asynq-throttle/lua"
)

// Clock chooses whose clock timestamps the window logs.
type Clock uint8

const (
	// ClockLocal timestamps events with the application's clock (Config.NowFunc), passed
	// to the script in milliseconds. Workers' clocks must agree to well under a window;
	// Decision.Skew shows how far each is from the Redis server.
	ClockLocal Clock = iota
	// ClockRedis timestamps events with the Redis server's TIME, read inside the script:
	// one clock for every worker, whatever their own clocks say.
	ClockRedis
)

// Config configures New. The zero value is ready to use.
type Config struct {
	// Prefix starts every Redis key. Defaults to DefaultPrefix ("throttle"). It must not
	// contain '{' or '}', which would move the Redis Cluster hash tag.
	Prefix string
	// Clock chooses the clock of Allow. Defaults to ClockLocal. AllowAt always uses the
	// time it is given.
	Clock Clock
	// NowFunc is the local clock. Defaults to time.Now.
	NowFunc func() time.Time
	// MaxSkew is how far the local clock may be from the Redis server's TIME before Allow
	// (with ClockLocal) stops trusting it: the script then decides by the server's TIME and
	// the Decision says SkewFallback, so a worker with a wrong clock can neither over-admit
	// nor stall, and can be seen (package worker logs it and counts it). Defaults to 1s;
	// negative disables the check. AllowAt never checks: its time is deliberate.
	//
	// Entries are kept 2 x MaxSkew (2s by default, also when the check is off) beyond
	// their window: a call stamped by a clock that is behind can reach Redis after one
	// stamped later, and must still count every entry of its own window.
	MaxSkew time.Duration
}

// DefaultMaxSkew is Config.MaxSkew when left zero: NTP keeps clocks within milliseconds,
// so a second off means a broken clock, and still leaves room for a slow round trip.
const DefaultMaxSkew = time.Second

// Request is one event to decide.
type Request struct {
	// Key is the event's task type and tenant. Key.TaskType must not be empty.
	Key Key
	// Quotas lists every limit the event must fit, at least one. Quotas at one Scope
	// share one window log, so "10/1s and 500/1h per tenant" is two ScopeTenant quotas.
	Quotas []Quota
	// Cost is the number of slots the event takes in every quota. Defaults to 1 when
	// zero; otherwise it must be between 1 and the smallest quota's Events.
	Cost int
	// Member is the event's id in the window logs. Defaults to a fresh xid. Pass the same
	// Member to repeat a call whose reply was lost: an admission is never made twice.
	Member string
	// Reservation, if set, is the id of the waiting task the event belongs to (an asynq
	// task id). A denied event then holds a reservation: the first instant at which every
	// quota has room, counting the reservations of the events denied before it, becomes
	// its own, and RetryAfter says when that is. Called again with the same Reservation,
	// it is admitted from that instant on, before any event without a reservation, and
	// reservations behind it do not block it. A reservation that is never used stops
	// counting one window after its instant. Empty: a denial writes nothing.
	Reservation string
}

// ErrInvalid matches, under errors.Is, every error that Allow returns for a request that
// could never be decided: no task type, no quota, a bad Limit or Scope, or a cost outside
// [1, Events]. Such errors are returned before any Redis command is sent.
var ErrInvalid = errors.New("throttle: invalid request")

// ErrCostOverLimit matches (as well as ErrInvalid) the error for a request whose cost is
// more than some quota's Events: no window could ever admit it, so it must not be retried.
var ErrCostOverLimit = errors.New("throttle: cost exceeds limit")

// Limiter decides events against sliding-window logs in Redis. It is safe for concurrent
// use by multiple goroutines.
type Limiter struct {
	rdb     redis.UniversalClient
	prefix  string
	clock   Clock
	now     func() time.Time
	maxSkew time.Duration // <= 0: no check
	grace   time.Duration // how long entries outlive their window
}

// New returns a Limiter that keeps its window logs in rdb: a single node, a Sentinel
// failover client or a Redis Cluster client. It returns an error if cfg.Prefix contains
// '{' or '}' or cfg.Clock is unknown.
func New(rdb redis.UniversalClient, cfg Config) (*Limiter, error) {
	if strings.ContainsAny(cfg.Prefix, "{}") {
		return nil, fmt.Errorf("throttle: prefix %q must not contain '{' or '}': they would move the Redis Cluster hash tag", cfg.Prefix)
	}
	if cfg.Clock != ClockLocal && cfg.Clock != ClockRedis {
		return nil, fmt.Errorf("throttle: unknown Clock %d", cfg.Clock)
	}
	l := &Limiter{rdb: rdb, prefix: cfg.Prefix, clock: cfg.Clock, now: cfg.NowFunc, maxSkew: cfg.MaxSkew}
	if l.maxSkew == 0 {
		l.maxSkew = DefaultMaxSkew
	}
	// Two callers within MaxSkew of the server are within 2 x MaxSkew of each other: the
	// one behind must still find the entries of its whole window after the other trimmed.
	l.grace = 2 * DefaultMaxSkew
	if l.maxSkew > 0 {
		l.grace = 2 * l.maxSkew
	}
	if l.prefix == "" {
		l.prefix = DefaultPrefix
	}
	if l.now == nil {
		l.now = time.Now
	}
	return l, nil
}

// Allow decides req now: by the local clock, or by the Redis server's TIME with
// ClockRedis. A denial is a Decision with Allowed false, not an error. The error is
// ErrInvalid (before any Redis call) or a Redis error; on an error the Decision is the zero
// value and must never be read as an admission.
func (l *Limiter) Allow(ctx context.Context, req Request) (Decision, error) {
	if l.clock == ClockRedis {
		return l.decide(ctx, req, "", 0)
	}
	return l.decide(ctx, req, strconv.FormatInt(l.now().UnixMilli(), 10), l.maxSkew)
}

// AllowAt decides req as of now, whatever the Config's Clock: tests drive time with it.
// now is truncated to the millisecond. Errors are as for Allow.
func (l *Limiter) AllowAt(ctx context.Context, req Request, now time.Time) (Decision, error) {
	return l.decide(ctx, req, strconv.FormatInt(now.UnixMilli(), 10), 0)
}

// Cancel gives up req's reservation (req.Reservation, with req's Key, Quotas and Cost),
// so that the slot it held goes to the next event instead of staying blocked for a
// window. It is a no-op without a reservation. The error is ErrInvalid or Redis's.
func (l *Limiter) Cancel(ctx context.Context, req Request) error {
	cost, err := validate(req)
	if err != nil || req.Reservation == "" {
		return err
	}
	entries := make([]any, cost)
	for c := range cost {
		entries[c] = strconv.Itoa(c+1) + "@" + req.Reservation // a reservation's entries, as sliding_window.lua names them
	}
	_, err = l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		done := map[Scope]bool{}
		for _, q := range req.Quotas {
			if !done[q.Scope] {
				done[q.Scope] = true
				p.ZRem(ctx, l.RedisKey(req.Key, q.Scope), entries...)
				p.ZRem(ctx, reservationKey(l.prefix, req.Key, q.Scope), entries...)
			}
		}
		if done[ScopeType] {
			p.HDel(ctx, ownersKey(l.prefix, req.Key), req.Reservation)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("throttle: cancel reservation %q of %s for tenant %q: %w", req.Reservation, req.Key.TaskType, req.Key.Tenant, err)
	}
	return nil
}

// RedisKey returns the Redis key of the window log that holds key's events at scope, of
// the form "<prefix>:{<task type>}:tenant:<tenant>" or "<prefix>:{<task type>}:type"
// with both parts escaped by url.PathEscape.
func (l *Limiter) RedisKey(key Key, scope Scope) string { return redisKey(l.prefix, key, scope) }

// decide runs the script for req at nowMS ("" for the server's TIME), falling back to the
// server's TIME if nowMS is more than maxSkew (when > 0) from it.
func (l *Limiter) decide(ctx context.Context, req Request, nowMS string, maxSkew time.Duration) (Decision, error) {
	cost, err := validate(req)
	if err != nil {
		return Decision{}, err
	}
	member := req.Member
	if member == "" {
		member = xid.New().String()
	}
	var keys []string
	var scopes []Scope
	var tenantLog, typeLog int // 1-based index into keys, 0 while unused
	args := make([]any, 8, 8+3*len(req.Quotas))
	args[0], args[1], args[2], args[3], args[4] = nowMS, member, cost, max(maxSkew.Milliseconds(), 0), req.Reservation
	args[6], args[7] = tenantTag(req.Key.Tenant), l.grace.Milliseconds()
	for _, q := range req.Quotas {
		slot := &tenantLog
		if q.Scope == ScopeType {
			slot = &typeLog
		}
		if *slot == 0 {
			keys = append(keys, l.RedisKey(req.Key, q.Scope))
			scopes = append(scopes, q.Scope)
			*slot = len(keys)
		}
		args = append(args, *slot, q.Limit.Events, q.Limit.Window.Milliseconds())
	}
	args[5] = typeLog
	for _, scope := range scopes { // trimmed with their logs, reservation or not
		keys = append(keys, reservationKey(l.prefix, req.Key, scope))
	}
	if req.Reservation != "" && typeLog > 0 {
		keys = append(keys, ownersKey(l.prefix, req.Key))
	}
	r, err := lua.SlidingWindow.Run(ctx, l.rdb, keys, args...).Int64Slice()
	if err != nil {
		return Decision{}, fmt.Errorf("throttle: allow %s for tenant %q: %w", req.Key.TaskType, req.Key.Tenant, err)
	}
	if len(r) != 12 || r[2] < 1 || int(r[2]) > len(req.Quotas) {
		return Decision{}, fmt.Errorf("throttle: allow %s for tenant %q: malformed script reply %v", req.Key.TaskType, req.Key.Tenant, r)
	}
	d := Decision{
		Allowed:      r[0] == 1,
		Replay:       r[1] == 1,
		Quota:        req.Quotas[r[2]-1],
		Count:        int(r[3]),
		Remaining:    int(r[4]),
		RetryAfter:   time.Duration(r[5]) * time.Millisecond,
		ResetAfter:   time.Duration(r[6]) * time.Millisecond,
		At:           time.UnixMilli(r[7]),
		ServerTime:   time.UnixMilli(r[8]),
		SkewFallback: r[9] == 1,
		Reserved:     r[10] == 1,
		Held:         r[11] == 1,
	}
	if nowMS != "" {
		ms, _ := strconv.ParseInt(nowMS, 10, 64)
		d.skew = time.Duration(ms-r[8]) * time.Millisecond
	}
	return d, nil
}

// validate checks req before any Redis call and returns its cost.
func validate(req Request) (int, error) {
	invalid := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s for tenant %q: %s", ErrInvalid, req.Key.TaskType, req.Key.Tenant, fmt.Sprintf(format, a...))
	}
	if req.Key.TaskType == "" {
		return 0, invalid("empty task type")
	}
	if len(req.Quotas) == 0 {
		return 0, invalid("no quota")
	}
	cost := req.Cost
	if cost == 0 {
		cost = 1
	}
	if cost < 1 {
		return 0, invalid("cost %d is less than 1", cost)
	}
	for _, q := range req.Quotas {
		if err := q.Validate(); err != nil {
			return 0, invalid("%v", err)
		}
		if cost > q.Limit.Events {
			return 0, fmt.Errorf("%w: %w", invalid("cost %d exceeds quota %s", cost, q), ErrCostOverLimit)
		}
	}
	return cost, nil
}
