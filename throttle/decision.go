package throttle

import (
	"errors"
	"fmt"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
)

// Decision is the outcome of one Allow call.
type Decision struct {
	// Allowed reports that the event was admitted into every window log (or that this
	// call replayed an admission already made: see Replay). The event may start at At:
	// after the call if Delay > 0.
	Allowed bool
	// Replay reports that the request's Member was already admitted, so nothing was
	// written: a retried call never takes a second slot.
	Replay bool
	// Quota is the quota that decided. On a denial, the one that holds the event back:
	// the first (in Request.Quotas order) with no room a millisecond before the earliest
	// instant it fits at (RetryAt, unless a fair share or a priority gave its reservation
	// an earlier slot held by another), so that with type=4/1s and tenant=3/1m both full, a wait of a
	// minute names the tenant's quota (else, as for a weighted event placed after the
	// instant it first fits at, the first with no room at the decision instant). When
	// allowed, the one with the fewest slots left in its window ending at At.
	Quota Quota
	// Count is the number of slots in use in Quota's window ending at At, after this call.
	Count int
	// Remaining is Quota's limit minus Count, at least 0.
	Remaining int
	// RetryAfter is zero when Allowed; otherwise the wait, at least 1ms, from the caller's
	// clock at the call until the event may be admitted: until its reservation's instant
	// if Reserved, else until every quota would have room if nothing else were admitted.
	RetryAfter time.Duration
	// Delay is how long after the call, on the caller's clock, an admitted event may start:
	// zero for an admission now; the wait until a slot at most Request.MaxWait (or, coming
	// back for a reservation, Request.ClaimWait) ahead, for which the event was admitted;
	// or the few milliseconds by which the caller's clock is behind the log's (see At).
	Delay time.Duration
	// Reserved reports that the denied event holds a reservation (Request.Reservation) at
	// RetryAt: called again with the same Reservation up to Request.ClaimWait before that
	// instant (or on time), it is admitted for it.
	Reserved bool
	// Held reports that the event already held a reservation when the call began: it came
	// back for a slot it was given earlier (whether or not it is due yet).
	Held bool
	// Paused reports a denial because Quota's window log is paused (Limiter.Pause) until
	// RetryAt: nothing was written, and a reservation the event holds is left as it was.
	Paused bool
	// At is the instant the decision was made for, and an admission logged at: the
	// caller's clock (or the now given to AllowAt), or the Redis server's TIME with
	// ClockRedis; or the latest instant another call wrote the logs at, if the caller's
	// clock is behind it (so no window is ever counted after another call trimmed it); or,
	// for an admission for a later slot, that slot.
	At time.Time
	// ServerTime is the Redis server's TIME during the call, to observe clock skew, or,
	// when the Limiter vouched for its clock without asking (Config.MaxSkew,
	// ClockCheckInterval), its estimate of it from its last measure, to the millisecond.
	// It is the zero Time after AllowAt (its instant is deliberate), and on a Redis
	// Cluster on a denial that wrote nothing (TIME is read, for the skew check, only
	// before a write: a read-only denial cannot corrupt a log whatever the caller's clock).
	ServerTime time.Time
	// SkewFallback reports that the caller's clock was further than Config.MaxSkew from
	// ServerTime, so the decision was made, and logged, at ServerTime instead.
	SkewFallback bool

	skew   time.Duration // caller's clock minus ServerTime; 0 with ClockRedis
	called time.Time     // the caller's clock at the call (At, unless the logs' high-water was later)
}

// RetryAt is the instant the request can first be admitted, on the caller's clock: the
// caller's instant at the call plus RetryAfter. It is At when Allowed.
func (d Decision) RetryAt() time.Time {
	if d.Allowed {
		return d.At
	}
	return d.called.Add(d.RetryAfter)
}

// Skew is how far the caller's clock (or the time given to AllowAt) was ahead of the Redis
// server's TIME during the call (negative: behind), to one millisecond, including the
// time the command took to reach the server. With ClockRedis it is 0.
func (d Decision) Skew() time.Duration { return d.skew }

// ErrDenied matches every *DeniedError under errors.Is.
var ErrDenied = errors.New("throttle: denied")

// DeniedError reports that an event for Key did not fit Quota and may be retried at
// RetryAt. Package worker returns it from a throttled handler; read it with errors.As.
type DeniedError struct {
	Key   Key   // the event's task type and tenant
	Quota Quota // the quota that denied it (Decision.Quota)
	// RetryAfter is Decision.RetryAfter, at least 1ms: the wait from the decision until
	// its reservation's instant if it holds one, else until every quota would have room.
	RetryAfter time.Duration
	// RetryAt is when to come back, on the caller's clock: its time after the decision
	// plus RetryAfter, or earlier for a task that holds a reservation (package worker
	// wakes it WakeLead early, to wait the rest in its handler).
	RetryAt time.Time
	// Paused is true when Quota's window log is paused (Limiter.Pause: package worker's
	// Backpressure after an upstream 429 or 503, or cmd/throttle pause), not full: the
	// denial is Decision.Paused's.
	Paused bool
}

// Error names the task type, tenant, quota (full, or paused) and wait.
func (e *DeniedError) Error() string {
	how := "over"
	if e.Paused {
		how = "paused on"
	}
	return fmt.Sprintf("throttle: %s for tenant %s %s %s, retry after %s",
		quote.Name(e.Key.TaskType), quote.Quote(e.Key.Tenant), how, e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrDenied.
func (e *DeniedError) Is(target error) bool { return target == ErrDenied }
