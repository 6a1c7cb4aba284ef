package worker

import (
	"context"
	"errors"
	"sync/atomic"
)

// errProbing is the cause of ErrUnavailable for a task that did not ask the limiter at
// all: its Redis was failing and another task's call was already probing it.
var errProbing = errors.New("worker: the limiter's Redis is failing and another task is probing it")

// limiterHealth lets one call at a time reach a limiter whose Redis is failing, as a
// circuit breaker's half-open state does. While Redis answers, every task asks it. Once a
// call fails with a Redis error, the limiter is down: one task, the probe, keeps asking
// for up to UnavailableWait (with the same member, as before); every other task whose
// decision needs the limiter is re-queued at once (ErrUnavailable, retried after
// UnavailableRetryDelay, no retry spent), or runs unthrottled with FailOpen, without a
// call. The first call that succeeds makes it up again.
//
// Without it, during an outage every worker slot of a server would hold a task asking a
// dead Redis for UnavailableWait (5s), and tasks with no rule, which need no limiter,
// would queue behind them; and each of those calls costs a dial (and a timeout, when
// Redis hangs rather than refuses).
type limiterHealth struct {
	down    atomic.Bool // the last call failed with a Redis error
	probing atomic.Bool // a task holds the probe
}

// enter reports whether a task may call the limiter now, and whether it does so as the
// probe (then it calls leave when done). While the limiter is up every task may.
func (h *limiterHealth) enter() (call, probe bool) {
	if !h.down.Load() {
		return true, false
	}
	if h.probing.CompareAndSwap(false, true) {
		return true, true
	}
	return false, false
}

// failed records that a call failed with err, and reports whether the caller may go on
// asking (as the probe, taking it if it was not one yet). An error of ctx's own (the
// task's deadline, a shutdown) says nothing about Redis: it changes nothing, and the
// caller stops.
func (h *limiterHealth) failed(ctx context.Context, probe *bool) bool {
	if ctx.Err() != nil {
		return false
	}
	h.down.Store(true)
	if !*probe {
		*probe = h.probing.CompareAndSwap(false, true)
	}
	return *probe
}

// ok records a call that Redis answered.
func (h *limiterHealth) ok() { h.down.Store(false) }

// leave gives the probe back.
func (h *limiterHealth) leave(probe bool) {
	if probe {
		h.probing.Store(false)
	}
}
