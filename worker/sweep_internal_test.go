package worker

import (
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/hibiken/asynq"
)

// answer is one reply of asynq's Inspector about a task: a state, or an error.
type answer struct {
	state asynq.TaskState
	err   error
}

var (
	notFound   = answer{err: fmt.Errorf("asynq: %w", asynq.ErrTaskNotFound)}
	noQueue    = answer{err: fmt.Errorf("asynq: %w", asynq.ErrQueueNotFound)}
	redisDown  = answer{err: errors.New("asynq: dial tcp 127.0.0.1:6379: connect: connection refused")}
	pending    = answer{state: asynq.TaskStatePending}
	active     = answer{state: asynq.TaskStateActive}
	scheduled  = answer{state: asynq.TaskStateScheduled}
	retry      = answer{state: asynq.TaskStateRetry}
	aggregated = answer{state: asynq.TaskStateAggregating}
	archived   = answer{state: asynq.TaskStateArchived}
	completed  = answer{state: asynq.TaskStateCompleted}
)

// TestSweepJudge: a reservation is released only when none of the tasks that may hold it is
// live, asked in the order asynq holds them, and kept whenever asynq cannot answer.
// answers lists, per task id, the Inspector's replies to successive lookups (the last
// one repeats; an id not listed is not found).
func TestSweepJudge(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name         string
		token, id    string // the reservation's token and its holder's task id
		answers      map[string][]answer
		release, err bool
		lookups      []string
	}{
		// A task with a retry left holds its own reservation.
		{name: "HolderPending", token: "T", id: "T", answers: map[string][]answer{"T": {pending}}, lookups: []string{"T"}},
		{name: "HolderActive", token: "T", id: "T", answers: map[string][]answer{"T": {active}}, lookups: []string{"T"}},
		{name: "HolderScheduled", token: "T", id: "T", answers: map[string][]answer{"T": {scheduled}}, lookups: []string{"T"}},
		{name: "HolderRetry", token: "T", id: "T", answers: map[string][]answer{"T": {retry}}, lookups: []string{"T"}},
		{name: "HolderAggregating", token: "T", id: "T", answers: map[string][]answer{"T": {aggregated}}, lookups: []string{"T"}},
		{name: "HolderDeleted", token: "T", id: "T", release: true,
			lookups: []string{"T", "T:deferred:1"}},
		{name: "HolderArchived", token: "T", id: "T", answers: map[string][]answer{"T": {archived}}, release: true,
			lookups: []string{"T", "T:deferred:1"}},
		{name: "HolderCompleted", token: "T", id: "T", answers: map[string][]answer{"T": {completed}}, release: true,
			lookups: []string{"T", "T:deferred:1"}},
		// The holder came back too early for its reservation with no retry left: replaced by
		// a copy that the reservation's Holder does not name.
		{name: "HolderReplaced", token: "T", id: "T", answers: map[string][]answer{"T:deferred:1": {scheduled}},
			lookups: []string{"T", "T:deferred:1"}},

		// A task with no retry left names its copy: the copy is not there yet while the
		// task (the token) enqueues it.
		{name: "CopyBeingEnqueued", token: "T", id: "T:deferred:1", answers: map[string][]answer{"T": {active}},
			lookups: []string{"T:deferred:1", "T"}},
		{name: "CopyScheduled", token: "T", id: "T:deferred:1", answers: map[string][]answer{"T:deferred:1": {scheduled}},
			lookups: []string{"T:deferred:1"}},
		// Not there when first asked, and the task revoked when asked next: the copy was
		// enqueued in between, and is there when asked again.
		{name: "CopyEnqueuedMeanwhile", token: "T", id: "T:deferred:1",
			answers: map[string][]answer{"T:deferred:1": {notFound, scheduled}},
			lookups: []string{"T:deferred:1", "T", "T:deferred:1"}},
		{name: "CopyDeleted", token: "T", id: "T:deferred:1", release: true,
			lookups: []string{"T:deferred:1", "T", "T:deferred:1", "T:deferred:2"}},
		{name: "CopyReplacedEarly", token: "T", id: "T:deferred:1", answers: map[string][]answer{"T:deferred:2": {scheduled}},
			lookups: []string{"T:deferred:1", "T", "T:deferred:1", "T:deferred:2"}},
		// The copy of a copy: while it is enqueued, the copy before it is alive.
		{name: "CopyOfCopyBeingEnqueued", token: "T", id: "T:deferred:3", answers: map[string][]answer{"T:deferred:2": {active}},
			lookups: []string{"T:deferred:3", "T", "T:deferred:2"}},
		{name: "CopyOfCopyDeleted", token: "T", id: "T:deferred:3", answers: map[string][]answer{"T:deferred:2": {completed}},
			release: true, lookups: []string{"T:deferred:3", "T", "T:deferred:2", "T:deferred:3", "T:deferred:4"}},
		// The original task, alive under its token, whatever the holder.
		{name: "TokenRetry", token: "T", id: "T:deferred:3", answers: map[string][]answer{"T": {retry}},
			lookups: []string{"T:deferred:3", "T"}},
		// A holder id that is no copy of the token: the token and the holder.
		{name: "OtherShapeGone", token: "T", id: "U:deferred:1", release: true,
			lookups: []string{"U:deferred:1", "T", "U:deferred:1"}},
		{name: "NotACopyNumber", token: "T", id: "T:deferred:01", release: true,
			lookups: []string{"T:deferred:01", "T", "T:deferred:01"}},

		// Errors keep the reservation, and stop the lookups.
		{name: "HolderRedisDown", token: "T", id: "T", answers: map[string][]answer{"T": {redisDown}}, err: true,
			lookups: []string{"T"}},
		{name: "NoSuchQueue", token: "T", id: "T:deferred:1", answers: map[string][]answer{"T:deferred:1": {noQueue}}, err: true,
			lookups: []string{"T:deferred:1"}},
		{name: "TokenRedisDown", token: "T", id: "T:deferred:1", answers: map[string][]answer{"T": {redisDown}}, err: true,
			lookups: []string{"T:deferred:1", "T"}},
		{name: "SuccessorRedisDown", token: "T", id: "T", answers: map[string][]answer{"T:deferred:1": {redisDown}}, err: true,
			lookups: []string{"T", "T:deferred:1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var lookups []string
			release, err := judge(c.token, c.id, func(id string) (asynq.TaskState, error) {
				as := c.answers[id]
				a := notFound
				if n := len(as); n > 0 {
					a = as[min(countOf(lookups, id), n-1)]
				}
				lookups = append(lookups, id)
				return a.state, a.err
			})
			if release != c.release || (err != nil) != c.err {
				t.Errorf("judge(%q, %q) = %v, %v; want release %v, error %v", c.token, c.id, release, err, c.release, c.err)
			}
			if !slices.Equal(lookups, c.lookups) {
				t.Errorf("looked up %q, want %q", lookups, c.lookups)
			}
		})
	}
}

func countOf(ids []string, id string) int {
	n := 0
	for _, x := range ids {
		if x == id {
			n++
		}
	}
	return n
}
