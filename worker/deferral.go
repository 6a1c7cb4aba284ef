package worker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// deferTask replaces a task that must wait but has no retry left (asynq would archive it)
// with a copy due at retryAt, then returns an error that wraps cause and asynq.RevokeTask,
// so asynq marks the original done instead of archiving it.
//
// The copy keeps the type, payload, headers, queue, and the retries the original had left
// (MaxRetry = MaxRetry - Retried, so real failures are still bounded as before), and, read
// with the Inspector, its Timeout, Deadline and Retention. Its ID is the first task's ID
// plus ":deferred:<n>" (see copyID and freeCopy): running the same attempt twice (asynq
// delivers at least once) finds its copy live and enqueues none, while a copy that an
// earlier task of the same ID left done (completed and kept by Retention, or archived) is
// passed over for the next n, so it never makes a new task look already enqueued.
//
// A Unique task's lock (asynq:{<queue>}:unique:...) goes to the copy: it is released if it
// names this task and the copy is enqueued with Unique for what was left of it, so the
// same type and payload still get asynq.ErrDuplicateTask until the copy is done. A task
// enqueued meanwhile by someone else with the same uniqueness (the copy then gets
// ErrDuplicateTask) holds the same work: this one is revoked all the same.
//
// If the copy cannot be enqueued the original is left to asynq (archived, from where it
// can be run again, its lock given back if the copy took it): never lost.
func (m *middleware) deferTask(ctx context.Context, task *asynq.Task, cause error, retryAt time.Time, retriesLeft int) error {
	id, _ := asynq.GetTaskID(ctx)
	queue, _ := asynq.GetQueueName(ctx)
	headers := maps.Clone(task.Headers())
	if headers == nil {
		headers = map[string]string{}
	}
	if headers[HeaderOriginID] == "" {
		headers[HeaderOriginID] = id
	}
	copyID, n, live := m.freeCopy(queue, task, id)
	if live {
		return fmt.Errorf("%w; deferred as task %s, already enqueued: %w", cause, copyID, asynq.RevokeTask)
	}
	headers[HeaderDeferrals] = strconv.Itoa(n)
	due := copyDue(retryAt, time.Now())
	opts := []asynq.Option{
		asynq.Queue(queue),
		asynq.TaskID(copyID),
		asynq.MaxRetry(max(retriesLeft, 0)),
		asynq.ProcessAt(due),
	}
	if info, err := m.inspector.GetTaskInfo(queue, id); err == nil {
		if info.Timeout > 0 {
			opts = append(opts, asynq.Timeout(info.Timeout))
		}
		if !info.Deadline.IsZero() {
			opts = append(opts, asynq.Deadline(info.Deadline))
		}
		if info.Retention > 0 {
			opts = append(opts, asynq.Retention(info.Retention))
		}
	}
	lock, left, err := m.releaseUnique(ctx, queue, id)
	if err != nil {
		return fmt.Errorf("worker: task %s has no retry left and its uniqueness lock could not be read: %w (%w)", id, cause, err)
	}
	if lock != "" {
		// asynq schedules a Unique task's lock to end its TTL after the task is due.
		opts = append(opts, asynq.Unique(max(left-time.Until(due), time.Second)))
	}
	_, err = m.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders(task.Type(), task.Payload(), headers), opts...)
	switch {
	case err == nil, errors.Is(err, asynq.ErrTaskIDConflict):
	case lock != "" && errors.Is(err, asynq.ErrDuplicateTask):
		return fmt.Errorf("%w; a task of the same uniqueness was enqueued meanwhile and holds its work: %w", cause, asynq.RevokeTask)
	default:
		if lock != "" { // give the lock back to the original, which asynq keeps (archived)
			_ = m.rdb.SetNX(context.WithoutCancel(ctx), lock, id, max(left, time.Second)).Err()
		}
		return fmt.Errorf("worker: task %s has no retry left and its copy %s could not be enqueued: %w (%w)", id, copyID, cause, err)
	}
	return fmt.Errorf("%w; deferred as task %s due %s: %w", cause, copyID, due.Format(time.RFC3339), asynq.RevokeTask)
}

// maxStaleCopies bounds how many done copies (of earlier tasks of one ID) freeCopy passes over.
const maxStaleCopies = 100

// freeCopy returns the id of the copy that replaces task (whose asynq id is id), the n of
// its ":deferred:<n>", and whether that copy is live already (pending, active, scheduled,
// retry or aggregating: this attempt ran before and enqueued it). It starts at copyID's
// name and passes over copies that asynq keeps done (completed, archived): those of an
// earlier task that had the same TaskID, kept by Retention. A lookup that fails other than
// with asynq.ErrTaskNotFound ends the search: the enqueue decides.
func (m *middleware) freeCopy(queue string, task *asynq.Task, id string) (string, int, bool) {
	origin, n := copyName(task, id)
	for k := n; k < n+maxStaleCopies; k++ {
		name := origin + ":deferred:" + strconv.Itoa(k)
		info, err := m.inspector.GetTaskInfo(queue, name)
		switch {
		case err != nil:
			return name, k, false
		case info.State != asynq.TaskStateCompleted && info.State != asynq.TaskStateArchived:
			return name, k, true
		}
	}
	k := n + maxStaleCopies
	return origin + ":deferred:" + strconv.Itoa(k), k, false
}

// releaseUnique releases the uniqueness lock of the task id of queue if the task has one
// (asynq's task hash names it, field unique_key) and the lock still names the task, and
// returns the lock's key and what was left of its TTL; "" if there was none to release.
// It reads asynq v0.26.0's keys (asynq:{<queue>}:t:<id>), in one WATCH transaction on
// the lock so that nothing else takes it in between.
func (m *middleware) releaseUnique(ctx context.Context, queue, id string) (string, time.Duration, error) {
	ctx = context.WithoutCancel(ctx)
	lock, err := m.rdb.HGet(ctx, "asynq:{"+queue+"}:t:"+id, "unique_key").Result()
	if errors.Is(err, redis.Nil) || err == nil && lock == "" {
		return "", 0, nil
	}
	if err != nil {
		return "", 0, err
	}
	var left time.Duration
	err = m.rdb.Watch(ctx, func(tx *redis.Tx) error {
		holder, err := tx.Get(ctx, lock).Result()
		if errors.Is(err, redis.Nil) || err == nil && holder != id {
			lock = "" // expired, or another task's
			return nil
		}
		if err != nil {
			return err
		}
		if left, err = tx.PTTL(ctx, lock).Result(); err != nil {
			return err
		}
		_, err = tx.TxPipelined(ctx, func(p redis.Pipeliner) error { return p.Del(ctx, lock).Err() })
		return err
	}, lock)
	if err != nil {
		return "", 0, err
	}
	return lock, left, nil
}

// copyID is the id of the copy that replaces task (whose asynq id is id) when it has no
// retry left, as far as the task itself says: the first task's id plus ":deferred:<n>",
// n counting the copies (freeCopy may pass over done copies of an earlier task of the
// same ID, so the copy may get a later n).
func copyID(task *asynq.Task, id string) string {
	origin, n := copyName(task, id)
	return origin + ":deferred:" + strconv.Itoa(n)
}

// copyName returns the first task's id and the n of the next copy of task (id id).
func copyName(task *asynq.Task, id string) (string, int) {
	origin := task.Headers()[HeaderOriginID]
	if origin == "" {
		origin = id
	}
	n, _ := strconv.Atoi(task.Headers()[HeaderDeferrals])
	return origin, n + 1
}

// copyDue is when a copy replacing a task re-queued for retryAt is due, at now:
// retryAt rounded up to a whole second (asynq keeps a scheduled task's instant in whole
// seconds, rounded down, so the copy would otherwise come back before retryAt), or, if
// that is not after now (a task re-queued at once: no waiting slot free, or woken for a
// slot already near), copyDueMargin after now. asynq's client enqueues a task due at or
// before its own clock as pending, to be dequeued again within milliseconds (a trial saw
// 700-900 deferrals a second of 60 tasks waiting), but schedules one due after it, which its
// forwarder moves at its next tick: about a forwarder interval later, as the retry of a
// task with retries left (RetryDelayFunc) comes back.
func copyDue(retryAt, now time.Time) time.Time {
	if due := ceilSecond(retryAt); due.After(now) {
		return due
	}
	return now.Add(copyDueMargin)
}

// copyDueMargin is how far after now copyDue sets a copy that is due already: enough
// that asynq's client, reading its clock a little later, still finds it ahead (else it
// is pending at once, the loop copyDue avoids), and at most that much later than a
// forwarder tick would have moved it.
const copyDueMargin = 100 * time.Millisecond

// ceilSecond rounds t up to a whole second: asynq stores retry and scheduled times as
// whole Unix seconds, truncated, so a task due at t must be scheduled at ceilSecond(t) or
// it may run up to 1s early.
func ceilSecond(t time.Time) time.Time {
	if s := t.Truncate(time.Second); !s.Equal(t) {
		return s.Add(time.Second)
	}
	return t
}
