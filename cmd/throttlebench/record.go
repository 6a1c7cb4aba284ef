package main

import (
	"time"
)

// Outcomes of one delivery of a task to a worker's handler chain.
const (
	outcomeRan      = "ran"      // admitted: the handler ran and returned nil
	outcomeRequeued = "requeued" // denied and returned to asynq to come back later
	outcomeError    = "error"    // any other error (none expected)
)

// record is one delivery of a task to a worker process's handler chain: what the
// throttle decided and what became of it. A worker writes one JSON line per delivery;
// the parent merges the lines of all workers. Instants are Unix milliseconds, the
// limiter's resolution, so that windows are counted exactly.
type record struct {
	Strategy string `json:"strategy,omitempty"` // set by the parent
	Worker   int    `json:"w"`                  // worker process index
	ID       string `json:"id"`                 // asynq task ID
	Tenant   string `json:"tenant"`
	Seq      int    `json:"seq"`      // the task's number among its tenant's tasks
	StartMS  int64  `json:"start_ms"` // the handler chain got the task
	EndMS    int64  `json:"end_ms"`   // the handler chain returned
	Outcome  string `json:"outcome"`
	// AtMS is the admission instant of a task that ran: the Decision's At for package
	// worker, the instant Allow said yes for x/time/rate.
	AtMS int64 `json:"at_ms,omitempty"`
	// ServerMS is, for package worker, the Redis server's TIME during the admitting call:
	// the order in which Redis ran the decisions, which may differ from the order of
	// their AtMS, taken on each worker's clock before the round trip.
	ServerMS int64 `json:"server_ms,omitempty"`
	// WakeMS is, for a requeued delivery, the instant the task asked to come back: the
	// DeniedError's RetryAt (WrapConfig rounds it up to a whole second), or the denial
	// instant plus RetryIn for x/time/rate.
	WakeMS int64 `json:"wake_ms,omitempty"`
	// Denials lists every denied decision of this delivery, in order. All but the last of
	// a requeued delivery, and all of one that ran, were waited out in the handler.
	Denials []denial `json:"denials,omitempty"`
	Err     string   `json:"err,omitempty"`
}

// denial is one denied decision.
type denial struct {
	AtMS         int64 `json:"at_ms"`               // the decision's instant
	ServerMS     int64 `json:"server_ms,omitempty"` // the Redis server's TIME during the call
	RetryAfterMS int64 `json:"retry_after_ms"`      // what the limiter said to wait
	Reserved     bool  `json:"reserved,omitempty"`  // the task holds a reservation at AtMS+RetryAfterMS
}

// requeued reports whether the delivery returned the task to asynq.
func (r record) requeued() bool { return r.Outcome == outcomeRequeued }

// waits is the number of denials of the delivery that were waited out in the handler.
func (r record) waits() int {
	if r.requeued() {
		return max(len(r.Denials)-1, 0)
	}
	return len(r.Denials)
}

func msTime(ms int64) time.Time { return time.UnixMilli(ms) }
