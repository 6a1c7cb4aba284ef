package throttle

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
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
	// negative disables the check, and with it the keys' TTL slack of 2 * MaxSkew (keys
	// expire on the server's clock, entries are scored on the callers'): only for clocks
	// that agree to the millisecond. AllowAt never checks: its time is deliberate. A clock
	// behind the server's within MaxSkew logs its admissions that far before they start
	// (README, Clocks and skew).
	//
	// The check needs the server's TIME, which costs the script a command: a Limiter
	// reads it on one write in ClockCheckInterval (1s) and checks the other calls itself,
	// tracking its clock from that measure with the process's monotonic clock (a step of
	// the local clock is seen at once). On a *redis.ClusterClient every write reads TIME,
	// as each master has its own clock.
	//
	// Within MaxSkew, a call whose clock is behind the latest instant a window log was
	// written at is decided at that instant instead (Decision.At, Decision.Delay): logs are
	// trimmed only up to that instant minus their window, so no call ever counts a window
	// another call has trimmed, and a log keeps no entry beyond its longest window.
	MaxSkew time.Duration
	// AutoPipeline sends the script calls through go-redis's automatic pipelining
	// (redis.Client.AutoPipeline, go-redis v9.22+): decisions made at once by many
	// goroutines share round trips, so Redis spends less time per decision on reading
	// and writing sockets. The autopipeliner is closed with the client. Supported for a
	// *redis.Client and a *redis.ClusterClient; New returns an error for other clients.
	// On a *redis.ClusterClient every call is looked for as a replay (Request.Fresh is
	// ignored): go-redis sends a node's whole batch again when its first command gets a
	// retryable error (TRYAGAIN while a slot moves, CLUSTERDOWN during a failover), so a
	// call may run twice, and the second run must find the first's admission.
	AutoPipeline bool
	// MinReplicas, when > 0, turns on durable mode: an admission counts only once at least
	// MinReplicas replicas of the primary acknowledged it, so that a failover cannot lose
	// it (Redis replicates asynchronously: a write the primary took but had not yet sent is
	// lost when a replica is promoted, and the slot it held is admitted again). Each
	// decision sends the script and then "WAIT MinReplicas ReplicaTimeout" in one pipeline
	// on one connection (WAIT counts only the writes of its own connection), to the master
	// of the keys' slot on a Redis Cluster: one round trip, as without it, but the reply
	// comes once the replicas have acknowledged (or ReplicaTimeout has passed). An
	// admission they did not acknowledge is returned as an error matching ErrNotReplicated,
	// never as an admission: the task does not run (fail closed). A denial writes nothing
	// and is returned whatever WAIT says; so is a reservation (losing one in a failover only
	// delays its task: it comes back at its instant and is decided afresh). A repeated call
	// (Request.Fresh false) also writes a small key, "<prefix>:{<task type>}:ack" with a 1s
	// TTL, before the WAIT, so that a replay is only reported once the replicas have the
	// admission it replays. Pause, Resume, Release and Cancel do not wait. With more
	// MinReplicas than the primary has replicas, every admission fails. Defaults to 0: off,
	// no WAIT, decisions cost what they cost without it. AutoPipeline does not apply to
	// durable decisions, which need their own pipeline. Negative is an error.
	MinReplicas int
	// ReplicaTimeout is how long a durable decision (MinReplicas > 0) waits for the
	// replicas' acknowledgement: WAIT's timeout, whole milliseconds, at least 1ms.
	// Defaults to DefaultReplicaTimeout (100ms). It must be shorter than the client's
	// ReadTimeout (go-redis v9.23: 5s by default), which bounds the pipeline's reply; New returns
	// an error otherwise.
	ReplicaTimeout time.Duration
}

// DefaultMaxSkew is Config.MaxSkew when left zero: NTP keeps clocks within milliseconds,
// so a second off means a broken clock, and still leaves room for a slow round trip.
const DefaultMaxSkew = time.Second

// DefaultClaimTimeout is Request.ClaimTimeout when left zero.
const DefaultClaimTimeout = 5 * time.Second

// MaxWeight is the largest Request.Weight.
const MaxWeight = 1_000_000

// MaxPriority is the largest Request.Priority.
const MaxPriority = 1000

// Request is one event to decide.
type Request struct {
	// Key is the event's task type and tenant. Key.TaskType must not be empty.
	Key Key
	// Quotas lists every limit the event must fit, at least one. Quotas at one Scope
	// share one window log, so "10/1s and 500/1h per tenant" is two ScopeTenant quotas.
	Quotas []Quota
	// Cost is the number of slots the event takes in every quota. Defaults to 1 when
	// zero; otherwise it must be between 1 and the smallest quota's Events. Whatever the
	// cost, the event is one entry in each log.
	Cost int
	// Member is the event's id in the window logs: at most 200 bytes, not starting with
	// '@', '*', '~', '#' or '!'. Defaults to NewMember(), 96 random bits. Pass the same
	// Member to repeat a call whose reply was lost: an admission is never made twice.
	Member string
	// Fresh says that no call with this Member was made before (this is not the repeat of a
	// call whose reply was lost), so the script need not look for it as a replay: in a
	// small log (a listpack, up to 128 entries) a member lookup is a scan of the log. A
	// default Member is always fresh. Set it on a first attempt only: a repeat that set it
	// could admit the event twice. Ignored with Config.AutoPipeline on a Redis Cluster.
	Fresh bool
	// Reservation, if set, is the id of the waiting task the event belongs to (an asynq
	// task id). A denied event then reserves the earliest instant at which every quota has
	// room, counting every slot promised before, and RetryAfter says when that is. Called
	// again with the same Reservation (and Cost) from ClaimWait before that instant, it is
	// admitted for it; a little late, it is decided afresh without its own reservation.
	// A reservation not claimed within ClaimTimeout after its instant stops counting.
	// Empty: a denial writes nothing.
	Reservation string
	// Holder names, for a Reservation, what holds it (package worker: the asynq queue and
	// task id), so that Limiter.Reservations can tell who to ask whether it still exists.
	Holder string
	// Weight is the tenant's share of a ScopeType quota: tenants with waiting tasks get its
	// slots in proportion to their weights (see the fairness section of the README).
	// Defaults to 1; at most MaxWeight.
	Weight int
	// Priority ranks the event's Reservation among those waiting on the same logs: from 0
	// (the default, the lowest) to MaxPriority. A denied event of cost 1 with a Reservation
	// and a Priority above 0 takes the earliest slot after now, before its own earliest
	// instant, that a pending reservation of lower priority holds on the same logs (cost
	// 1, the same scopes, among the first 8 pending after now; on another tenant's only if
	// this event's tenant quotas have room there): it reserves it, or is admitted for it
	// within MaxWait. The reservation it displaces moves to its own earliest instant, so
	// its task, coming back for the old instant, is denied until the new one. A fair share
	// (Weight) never displaces a reservation of higher priority. A priority sends the call
	// to the script's general path (about twice the work of a plain reservation).
	Priority int
	// MaxWait is how far ahead a slot may be for an event to be admitted for it rather than
	// denied: Decision.Allowed with Decision.Delay > 0, and the caller must not start the
	// event before the delay has passed. Zero: admitted only for now.
	MaxWait time.Duration
	// ClaimWait is MaxWait for an event coming back for its Reservation: from ClaimWait
	// before the reserved instant on, it is admitted for that instant. Zero: only at or
	// after the instant.
	ClaimWait time.Duration
	// ClaimTimeout is how long after its instant a reservation may still be claimed; then it
	// lapses and stops counting. Defaults to DefaultClaimTimeout.
	ClaimTimeout time.Duration
	// Spread spaces new reservations out: a Reservation made by this call that a
	// ScopeTenant quota holds back (its binding quota, Decision.Quota) is placed no earlier
	// than Cost x Window/Events of that quota (rounded down to the ms) after the latest
	// instant its log holds (an admission's or a reservation's), at the earliest instant
	// from there on at which it fits every quota, instead of the earliest after now.
	// Reserving later than the earliest never breaks a window; a backlog's reservations so
	// go one step of the binding quota apart rather than many to an instant, repeating the
	// instants of the admissions that filled its window, window after window (with one
	// quota it drains evenly at that quota's rate; with two, at the longer one's rate in
	// its bursts, each spaced at the shorter one's step). The
	// middleware sets it with a bounded Concurrency, whose waiting slots cannot hold a
	// burst of tasks due at one instant (worker.Config.Concurrency). Admissions (at now or
	// within MaxWait), claims, a slot taken from a lower priority (Priority), a reservation
	// a fair rank displaces, and one a ScopeType quota holds back (its fair ranks
	// interleave the tenants) are not spaced. False: the earliest instant.
	Spread bool
}

// ErrInvalid matches, under errors.Is, every error that Allow returns for a request that
// could never be decided: no task type, a tenant longer than MaxTenantBytes, no quota, a
// bad Limit or Scope, a cost outside [1, Events], a bad Member, Weight, Priority or wait, or an
// instant outside 1970-2109. Such errors are returned before any Redis command is sent.
var ErrInvalid = errors.New("throttle: invalid request")

// ErrCostOverLimit matches (as well as ErrInvalid) the error for a request whose cost is
// more than some quota's Events: no window could ever admit it, so it must not be retried.
var ErrCostOverLimit = errors.New("throttle: cost exceeds limit")

// maxMS bounds every instant, window and wait (2^42 ms, about 139 years): the script keeps
// instants exact in a double and encodes its sentinels below -2^50.
const maxMS = 1 << 42

// MaxTime is the first instant the limiter cannot hold, 2^42 ms after the Unix epoch
// (2109-05-15T07:35:11.104Z): AllowAt, Pause and PauseAt return ErrInvalid for an instant
// from it on or before the epoch, as does Allow for a local clock outside that range.
var MaxTime = time.UnixMilli(maxMS).UTC()

// Limiter decides events against sliding-window logs in Redis. It is safe for concurrent
// use by multiple goroutines.
type Limiter struct {
	rdb     redis.UniversalClient
	run     redis.Scripter // rdb, or its autopipeliner
	prefix  string
	clock   Clock
	now     func() time.Time
	maxSkew time.Duration // <= 0: no check
	resends bool          // a call may run twice (AutoPipeline on a cluster): never fresh

	// The script's ARGV[4] for Allow: maxSkew in ms, for the script to check ("0": no
	// check), or after "~", vouched for by measured (see clockCheck); vouch is false on a
	// Redis Cluster, whose masters each have a clock.
	skewArg, vouchArg string
	vouch             bool
	measured          clockCheck
	mono              func() time.Time // time.Now; tests step it

	minReplicas    int           // Config.MinReplicas: 0, not durable
	replicaTimeout time.Duration // Config.ReplicaTimeout, defaulted
}

// New returns a Limiter that keeps its window logs in rdb: a single node, a Sentinel
// failover client or a Redis Cluster client. It returns an error if rdb is nil (a nil
// interface, or a nil *redis.Client or *redis.ClusterClient in it), cfg.Prefix contains
// '{' or '}', cfg.Clock is unknown, cfg.AutoPipeline is set for a client that has no
// autopipeliner, cfg.MinReplicas is negative, or cfg.ReplicaTimeout is negative, under 1ms
// (when set) or not shorter than the client's ReadTimeout.
func New(rdb redis.UniversalClient, cfg Config) (*Limiter, error) {
	switch c := rdb.(type) {
	case nil:
		return nil, errors.New("throttle: New: nil Redis client")
	case *redis.Client:
		if c == nil {
			return nil, errors.New("throttle: New: nil *redis.Client")
		}
	case *redis.ClusterClient:
		if c == nil {
			return nil, errors.New("throttle: New: nil *redis.ClusterClient")
		}
	}
	if strings.ContainsAny(cfg.Prefix, "{}") {
		return nil, fmt.Errorf("throttle: prefix %q must not contain '{' or '}': they would move the Redis Cluster hash tag", cfg.Prefix)
	}
	if cfg.Clock != ClockLocal && cfg.Clock != ClockRedis {
		return nil, fmt.Errorf("throttle: unknown Clock %d", cfg.Clock)
	}
	if cfg.MinReplicas < 0 {
		return nil, fmt.Errorf("throttle: MinReplicas %d is negative", cfg.MinReplicas)
	}
	replicaTimeout := cfg.ReplicaTimeout
	if replicaTimeout == 0 {
		replicaTimeout = DefaultReplicaTimeout
	}
	if replicaTimeout < time.Millisecond {
		return nil, fmt.Errorf("throttle: ReplicaTimeout %s is under 1ms (WAIT takes whole milliseconds; 0 blocks forever)", cfg.ReplicaTimeout)
	}
	if rt := clientReadTimeout(rdb); cfg.MinReplicas > 0 && rt > 0 && replicaTimeout >= rt {
		return nil, fmt.Errorf("throttle: ReplicaTimeout %s is not shorter than the client's ReadTimeout %s: WAIT's reply would time out", replicaTimeout, rt)
	}
	l := &Limiter{rdb: rdb, run: rdb, prefix: cfg.Prefix, clock: cfg.Clock, now: cfg.NowFunc, maxSkew: cfg.MaxSkew,
		minReplicas: cfg.MinReplicas, replicaTimeout: replicaTimeout}
	if cfg.AutoPipeline {
		var ap *redis.AutoPipeliner
		var err error
		switch c := rdb.(type) {
		case *redis.Client:
			ap, err = c.AutoPipeline()
		case *redis.ClusterClient:
			ap, err = c.AutoPipeline()
			l.resends = true
		default:
			err = fmt.Errorf("%T has no autopipeliner", rdb)
		}
		if err != nil {
			return nil, fmt.Errorf("throttle: AutoPipeline: %w", err)
		}
		l.run = ap
	}
	if l.maxSkew == 0 {
		l.maxSkew = DefaultMaxSkew
	}
	ms := strconv.FormatInt(max(l.maxSkew.Milliseconds(), 0), 10)
	_, cluster := rdb.(*redis.ClusterClient)
	l.skewArg, l.vouchArg, l.vouch = ms, "~"+ms, l.maxSkew > 0 && !cluster
	if l.prefix == "" {
		l.prefix = DefaultPrefix
	}
	if l.now == nil {
		l.now = time.Now
	}
	l.mono = time.Now
	return l, nil
}

// NewMember returns a fresh event id: 12 bytes from crypto/rand (96 random bits) in
// base64url, 16 characters. Unlike an xid (4 bytes of time, 3 of machine id, 2 of process
// id and a 3-byte counter), two processes cannot repeat one except by a 2^-96 chance,
// whatever their hosts and process ids.
func NewMember() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// Allow decides req now: by the local clock, or by the Redis server's TIME with
// ClockRedis. A denial is a Decision with Allowed false, not an error. The error is
// ErrInvalid (before any Redis call) or a Redis error; on an error the Decision is the zero
// value and must never be read as an admission.
func (l *Limiter) Allow(ctx context.Context, req Request) (Decision, error) {
	if l.clock == ClockRedis {
		return l.decide(ctx, req, 0, true, "0")
	}
	mono := l.mono()
	nowMS := l.now().UnixMilli()
	if !l.vouch {
		return l.decide(ctx, req, nowMS, false, l.skewArg)
	}
	skew, vouched := l.measured.estimate(mono, l.mono(), nowMS, l.maxSkew.Milliseconds())
	arg := l.skewArg
	if vouched {
		arg = l.vouchArg
	}
	d, err := l.decide(ctx, req, nowMS, false, arg)
	switch {
	case err != nil:
	case !d.ServerTime.IsZero(): // the script read TIME: a new measure
		l.measured.record(mono, nowMS, d.ServerTime.UnixMilli(), l.mono().Sub(mono))
	case vouched:
		d.ServerTime, d.skew = time.UnixMilli(nowMS-skew), time.Duration(skew)*time.Millisecond
	}
	return d, err
}

// AllowAt decides req as of now, whatever the Config's Clock: tests drive time with it.
// now is truncated to the millisecond. Errors are as for Allow.
func (l *Limiter) AllowAt(ctx context.Context, req Request, now time.Time) (Decision, error) {
	return l.decide(ctx, req, now.UnixMilli(), false, "0")
}

// Cancel gives up req's reservation (req.Reservation, of req.Key's task type), so that the
// slot it held goes to the next event instead of staying blocked. It is a no-op without a
// reservation. The error is ErrInvalid or Redis's.
func (l *Limiter) Cancel(ctx context.Context, req Request) error {
	if _, err := validate(req); err != nil || req.Reservation == "" {
		return err
	}
	_, err := l.Release(ctx, req.Key.TaskType, req.Reservation)
	return err
}

// Release gives up the reservation of token on taskType's logs, whatever its tenant,
// quotas and cost (the lease records them), and reports whether there was one. The error
// is ErrInvalid for an empty task type or token, or Redis's.
func (l *Limiter) Release(ctx context.Context, taskType, token string) (bool, error) {
	if taskType == "" || token == "" {
		return false, fmt.Errorf("%w: release needs a task type and a token", ErrInvalid)
	}
	n, err := lua.SlidingWindow.Run(ctx, l.run, []string{leasesKey(l.prefix, taskType)}, "r", token).Int64()
	if err != nil {
		return false, fmt.Errorf("throttle: release reservation %q of %s: %w", token, quote.Name(taskType), err)
	}
	return n == 1, nil
}

// Pause denies every event on key's window log at scope until until, on every limiter
// that shares the Redis: for an upstream API that answers 429 or 503 with a Retry-After.
// A decision on a paused log is a denial with Decision.Paused and RetryAfter up to until
// (the latest pause of its logs), writing nothing; a pause never shortens one in force
// (the later until stays), and the log's TTL grows to outlast it. The instant is the
// caller's clock (Config.NowFunc), like Allow's. The error is ErrInvalid for an empty task
// type or an until outside 1970-2109, or Redis's.
func (l *Limiter) Pause(ctx context.Context, key Key, scope Scope, until time.Time) error {
	return l.PauseAt(ctx, key, scope, until, l.now())
}

// PauseAt is Pause as of now (tests drive time with it, as with AllowAt).
func (l *Limiter) PauseAt(ctx context.Context, key Key, scope Scope, until, now time.Time) error {
	if key.TaskType == "" {
		return fmt.Errorf("%w: pause needs a task type", ErrInvalid)
	}
	u := until.UnixMilli()
	if u < 0 || u >= maxMS {
		return fmt.Errorf("%w: pause of %s until %s: outside 1970-2109", ErrInvalid,
			logOf(key, scope), time.UnixMilli(u).UTC().Format(time.RFC3339Nano)) // in ms, as the log would hold it
	}
	if err := lua.SlidingWindow.Run(ctx, l.run, []string{redisKey(l.prefix, key, scope)}, "p", u, now.UnixMilli()).Err(); err != nil {
		return fmt.Errorf("throttle: pause %s: %w", logOf(key, scope), err)
	}
	return nil
}

// Resume lifts a pause of key's window log at scope and reports whether there was one
// (in force or past). The error is ErrInvalid for an empty task type, or Redis's.
func (l *Limiter) Resume(ctx context.Context, key Key, scope Scope) (bool, error) {
	if key.TaskType == "" {
		return false, fmt.Errorf("%w: resume needs a task type", ErrInvalid)
	}
	n, err := lua.SlidingWindow.Run(ctx, l.run, []string{redisKey(l.prefix, key, scope)}, "u").Int64()
	if err != nil {
		return false, fmt.Errorf("throttle: resume %s: %w", logOf(key, scope), err)
	}
	return n == 1, nil
}

// PausedUntil returns the instant until which key's window log at scope is paused, and
// false if it has no pause (a past one is returned, with true, until the log's next write
// after it, Resume or the log's expiry removes it). The error is ErrInvalid for an empty task type, or Redis's.
func (l *Limiter) PausedUntil(ctx context.Context, key Key, scope Scope) (time.Time, bool, error) {
	if key.TaskType == "" {
		return time.Time{}, false, fmt.Errorf("%w: a pause needs a task type", ErrInvalid)
	}
	s, err := l.rdb.ZScore(ctx, redisKey(l.prefix, key, scope), "#p").Result()
	if errors.Is(err, redis.Nil) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("throttle: pause of %s: %w", logOf(key, scope), err)
	}
	return time.UnixMilli(int64(s) + 1<<51), true, nil
}

// logOf names key's window log at scope in an error: `api:call for tenant "acme"`, or
// `api:call (the type's log)`, whose tenant does not matter.
func logOf(key Key, scope Scope) string {
	if scope == ScopeType {
		return quote.Name(key.TaskType) + " (the type's log)"
	}
	return quote.Name(key.TaskType) + " for tenant " + quote.Quote(key.Tenant)
}

// Reservation is a reservation held on a task type's logs, as Limiter.Reservations lists it.
type Reservation struct {
	Token  string // Request.Reservation
	Key    Key    // its task type and tenant
	Cost   int    // slots it takes in every quota
	Holder string // Request.Holder
	// Created is when it was reserved, to the millisecond: the Redis server's TIME, or the
	// Limiter's own clock when its clock check vouched for it (within Config.MaxSkew of
	// TIME), which saves the script a TIME call.
	Created  time.Time
	Priority int // Request.Priority
}

// Reservations calls fn for every reservation held on taskType's logs, in no particular
// order, reading them in pages (HSCAN) until fn returns false or none are left. A
// reservation made or claimed meanwhile may be listed or not. The error is ErrInvalid for
// an empty task type, or Redis's.
func (l *Limiter) Reservations(ctx context.Context, taskType string, fn func(Reservation) bool) error {
	if taskType == "" {
		return fmt.Errorf("%w: reservations need a task type", ErrInvalid)
	}
	key := leasesKey(l.prefix, taskType)
	var cursor uint64
	for {
		kv, next, err := l.rdb.HScan(ctx, key, cursor, "*", 200).Result()
		if err != nil {
			return fmt.Errorf("throttle: list reservations of %s: %w", quote.Name(taskType), err)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			r, ok := parseLease(taskType, kv[i], kv[i+1])
			if ok && !fn(r) {
				return nil
			}
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// parseLease reads a lease record, "<cost>:<scopes>:<created ms>:<n>:<holder><tenant>"
// with the holder n bytes long and the tenant escaped, after "p<priority>:" for a priority
// above 0 (sliding_window.lua writes it).
func parseLease(taskType, token, rec string) (Reservation, bool) {
	priority := 0
	if p, rest, ok := strings.Cut(rec, ":"); ok && strings.HasPrefix(p, "p") {
		n, err := strconv.Atoi(p[1:])
		if err != nil || n < 1 {
			return Reservation{}, false
		}
		priority, rec = n, rest
	}
	parts := strings.SplitN(rec, ":", 5)
	if len(parts) != 5 {
		return Reservation{}, false
	}
	cost, err1 := strconv.Atoi(parts[0])
	created, err2 := strconv.ParseInt(parts[2], 10, 64)
	n, err3 := strconv.Atoi(parts[3])
	if err1 != nil || err2 != nil || err3 != nil || n < 0 || n > len(parts[4]) {
		return Reservation{}, false
	}
	tenant, err := url.PathUnescape(parts[4][n:])
	if err != nil {
		return Reservation{}, false
	}
	return Reservation{Token: token, Key: Key{TaskType: taskType, Tenant: tenant}, Cost: cost,
		Holder: parts[4][:n], Created: time.UnixMilli(created), Priority: priority}, true
}

// RedisKey returns the Redis key of the window log that holds key's events at scope, of
// the form "<prefix>:{<task type>}:tenant:<tenant>" or "<prefix>:{<task type>}:type"
// with both parts escaped by url.PathEscape.
func (l *Limiter) RedisKey(key Key, scope Scope) string { return redisKey(l.prefix, key, scope) }

// decide runs the script for req at nowMS (or the server's TIME, with serverClock), with
// skewArg as its ARGV[4]: "0", no skew check; "<ms>", falling back to the server's TIME
// if nowMS is more than ms from it; "~<ms>", trusting nowMS (see clockCheck).
func (l *Limiter) decide(ctx context.Context, req Request, nowMS int64, serverClock bool, skewArg string) (Decision, error) {
	cost, err := validate(req)
	if err != nil {
		return Decision{}, err
	}
	if !serverClock && (nowMS < 0 || nowMS >= maxMS) {
		return Decision{}, fmt.Errorf("%w: %s for tenant %s: instant %s is outside 1970-2109", ErrInvalid,
			quote.Name(req.Key.TaskType), quote.Quote(req.Key.Tenant), time.UnixMilli(nowMS).UTC().Format(time.RFC3339Nano))
	}
	member, fresh := req.Member, req.Fresh
	if member == "" {
		member, fresh = NewMember(), true
	}
	if fresh && !l.resends { // the script's mark: not looked for (a member never starts with '!')
		member = "!" + member
	}
	weight := max(req.Weight, 1)
	claimTimeout := req.ClaimTimeout
	if claimTimeout == 0 {
		claimTimeout = DefaultClaimTimeout
	}
	var keys []string
	var tenantLog, typeLog int // 1-based log indexes, 0 while unused
	args := make([]any, 5, 6+3*len(req.Quotas))
	qlogs := make([]byte, 0, len(req.Quotas))
	for _, q := range req.Quotas {
		slot := &tenantLog
		if q.Scope == ScopeType {
			slot = &typeLog
		}
		if *slot == 0 {
			keys = append(keys, redisKey(l.prefix, req.Key, q.Scope))
			*slot = len(keys)
		}
		w := q.Limit.Window.Milliseconds()
		args = append(args, q.Limit.Events, w, nowMS-w) // now - w: a bound the script need not format
		qlogs = append(qlogs, byte('0'+*slot))
	}
	if len(req.Quotas) > 1 {
		args = append(args, string(qlogs))
	}
	now, sentinel := "", ""
	if !serverClock {
		now, sentinel = strconv.FormatInt(nowMS, 10), strconv.FormatInt(16*nowMS-1<<51, 10)
	}
	// extra is empty for the commonest call; the script's header documents its fields.
	extra := ""
	if cost != 1 || req.Reservation != "" || req.MaxWait != 0 || claimTimeout != DefaultClaimTimeout || req.Priority != 0 || req.Spread {
		var buf [128]byte
		extra = string(appendExtra(buf[:0], &req, cost, weight, claimTimeout))
	}
	args[0], args[1], args[2], args[3], args[4] = now, member, sentinel, skewArg, extra
	r, acked, err := l.script(ctx, req.Key.TaskType, !fresh, keys, args)
	if err != nil {
		return Decision{}, fmt.Errorf("throttle: allow %s for tenant %s: %w", quote.Name(req.Key.TaskType), quote.Quote(req.Key.Tenant), err)
	}
	binding := int64(1)
	if len(r) > 4 {
		binding = r[4]
	}
	if len(r) < 4 || binding < 1 || int(binding) > len(req.Quotas) {
		return Decision{}, fmt.Errorf("throttle: allow %s for tenant %s: malformed script reply %v", quote.Name(req.Key.TaskType), quote.Quote(req.Key.Tenant), r)
	}
	code, quota := r[0], req.Quotas[binding-1]
	serverMS := int64(0)
	if len(r) > 5 {
		serverMS = r[5]
	}
	skewed := code&4 != 0
	called := nowMS
	if serverClock || skewed { // the script decided by the server's TIME
		called = serverMS
	}
	d := Decision{
		Allowed:      code&1 != 0,
		Replay:       code&2 != 0,
		SkewFallback: skewed,
		Reserved:     code&8 != 0,
		Held:         code&16 != 0,
		Paused:       code&32 != 0,
		Quota:        quota,
		Count:        int(r[1]),
		Remaining:    max(quota.Limit.Events-int(r[1]), 0),
		RetryAfter:   time.Duration(r[2]) * time.Millisecond,
		At:           time.UnixMilli(r[3]),
		called:       time.UnixMilli(called),
	}
	if serverMS > 0 { // the script read the server's TIME
		d.ServerTime = time.UnixMilli(serverMS)
		if !serverClock {
			d.skew = time.Duration(nowMS-serverMS) * time.Millisecond
		}
	}
	if d.Allowed && !d.Replay {
		d.Delay = max(d.At.Sub(d.called), 0)
	}
	if d.Allowed && acked >= 0 && acked < l.minReplicas {
		return Decision{}, &NotReplicatedError{Key: req.Key, Acked: acked, Want: l.minReplicas, Timeout: l.replicaTimeout, Replayed: d.Replay}
	}
	return d, nil
}

// appendExtra appends to b the script's extra argument (ARGV[5]) for req, of cost, weight
// and claimTimeout (defaulted):
//
//	[p<priority>:][s:]<cost>:<max wait ms>:<claim timeout ms>:<claim wait ms>:<weight>:<n>:<reservation><m>:<holder><tenant>
//
// with n and m the bytes of the reservation and the holder, the tenant escaped by
// url.PathEscape, "p<priority>:" only for a priority above 0 (first: the fast and
// one-log paths hand it to the general path) and "s:" only with Spread. It is what fmt.Sprintf with
// "%d:%d:%d:%d:%d:%d:%s%d:%s%s" writes, without boxing eleven values per decision.
func appendExtra(b []byte, req *Request, cost, weight int, claimTimeout time.Duration) []byte {
	if req.Priority != 0 {
		b = append(b, 'p')
		b = strconv.AppendInt(b, int64(req.Priority), 10)
		b = append(b, ':')
	}
	if req.Spread {
		b = append(b, 's', ':')
	}
	for _, n := range [...]int64{int64(cost), req.MaxWait.Milliseconds(), claimTimeout.Milliseconds(),
		req.ClaimWait.Milliseconds(), int64(weight), int64(len(req.Reservation))} {
		b = strconv.AppendInt(b, n, 10)
		b = append(b, ':')
	}
	b = append(b, req.Reservation...)
	b = strconv.AppendInt(b, int64(len(req.Holder)), 10)
	b = append(b, ':')
	b = append(b, req.Holder...)
	return append(b, url.PathEscape(req.Key.Tenant)...)
}

// validate checks req before any Redis call and returns its cost.
func validate(req Request) (int, error) {
	invalid := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s for tenant %s: %s", ErrInvalid, quote.Name(req.Key.TaskType), quote.Quote(req.Key.Tenant), fmt.Sprintf(format, a...))
	}
	if req.Key.TaskType == "" {
		return 0, invalid("empty task type")
	}
	if len(req.Key.Tenant) > MaxTenantBytes {
		return 0, invalid("tenant of %d bytes, more than MaxTenantBytes (%d)", len(req.Key.Tenant), MaxTenantBytes)
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
	if len(req.Member) > 200 || req.Member != "" && strings.ContainsAny(req.Member[:1], "@*~#!") {
		return 0, invalid("member %s: at most 200 bytes, not starting with '@', '*', '~', '#' or '!'", quote.Quote(req.Member))
	}
	if req.Weight < 0 || req.Weight > MaxWeight {
		return 0, invalid("weight %d is outside [1, %d]", req.Weight, MaxWeight)
	}
	if req.Priority < 0 || req.Priority > MaxPriority {
		return 0, invalid("priority %d is outside [0, %d]", req.Priority, MaxPriority)
	}
	for _, w := range [...]struct {
		name string
		d    time.Duration
	}{{"MaxWait", req.MaxWait}, {"ClaimWait", req.ClaimWait}, {"ClaimTimeout", req.ClaimTimeout}} {
		if w.d < 0 || w.d.Milliseconds() >= maxMS {
			return 0, invalid("%s %s is negative or too long", w.name, w.d)
		}
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
