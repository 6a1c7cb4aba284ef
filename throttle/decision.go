package throttle

import (
	"errors"
	"fmt"
	"time"
)

// Decision is the outcome of one Allow call.
type Decision struct {
	// Allowed reports that the event was admitted into every window log (or that this
	// call replayed an admission already made: see Replay).
	Allowed bool
	// Replay reports that the request's Member was already admitted, so nothing was
	// written: a retried call never takes a second slot.
	Replay bool
	// Quota is the quota that decided: on a denial the one that needs the longest wait;
	// when allowed the one with the fewest slots left.
	Quota Quota
	// Count is the number of slots in use in Quota's window after this call.
	Count int
	// Remaining is the number of slots still free in Quota's window after this call.
	Remaining int
	// RetryAfter is zero when Allowed; otherwise the wait, at least 1ms, until every quota
	// has room for the request's cost if nothing else is admitted meanwhile.
	RetryAfter time.Duration
	// Reserved reports that the denied event holds a reservation (Request.Reservation) at
	// RetryAt: called again then with the same Reservation, it is admitted unless
	// admissions made since leave no room.
	Reserved bool
	// Held reports that the event already held a reservation when the call began: it came
	// back for a slot it was given earlier (whether or not it is due yet).
	Held bool
	// ResetAfter is how long until every quota's window is empty if nothing more is
	// admitted.
	ResetAfter time.Duration
	// At is the instant the decision was made for: the caller's clock (or the now given to
	// AllowAt), or the Redis server's TIME with ClockRedis. An admission is logged at At.
	At time.Time
	// ServerTime is the Redis server's TIME during the call, to observe clock skew.
	ServerTime time.Time
	// SkewFallback reports that the caller's clock was further than Config.MaxSkew from
	// ServerTime, so the decision was made, and logged, at ServerTime instead.
	SkewFallback bool

	skew time.Duration // caller's clock minus ServerTime; 0 with ClockRedis
}

// RetryAt is the instant the request can first be admitted: At + RetryAfter. It is At
// when Allowed.
func (d Decision) RetryAt() time.Time { return d.At.Add(d.RetryAfter) }

// Skew is how far the caller's clock (or the time given to AllowAt) was ahead of the Redis
// server's TIME during the call (negative: behind), to one millisecond, including the
// time the command took to reach the server. With ClockRedis it is 0.
func (d Decision) Skew() time.Duration { return d.skew }

// ErrDenied matches every *DeniedError under errors.Is.
var ErrDenied = errors.New("throttle: denied")

// DeniedError reports that an event for Key did not fit Quota and may be retried at
// RetryAt. Package worker returns it from a throttled handler; read it with errors.As.
type DeniedError struct {
	Key        Key
	Quota      Quota
	RetryAfter time.Duration // wait from the decision until every quota has room, >= 1ms
	// RetryAt is when to come back, on the caller's clock: its time after the decision
	// plus RetryAfter, or earlier for a task that holds a reservation (package worker
	// wakes it WakeLead early, to wait the rest in its handler).
	RetryAt time.Time
}

// Error names the task type, tenant, quota and wait.
func (e *DeniedError) Error() string {
	return fmt.Sprintf("throttle: %s for tenant %q over %s, retry after %s",
		e.Key.TaskType, e.Key.Tenant, e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrDenied.
func (e *DeniedError) Is(target error) bool { return target == ErrDenied }
