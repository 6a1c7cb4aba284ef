package worker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
)

// deferTask replaces a task that must wait but has no retry left (asynq would archive it)
// with a copy due at retryAt, then returns an error that wraps cause and asynq.RevokeTask,
// so asynq marks the original done instead of archiving it.
//
// The copy keeps the type, payload, headers, queue, and the retries the original had left
// (MaxRetry = MaxRetry - Retried, so real failures are still bounded as before), and, read
// with the Inspector, its Timeout, Deadline and Retention. Its ID is the first task's ID
// plus ":deferred:<n>", n counting deferrals (HeaderDeferrals), so running the same
// attempt twice (asynq delivers at least once) enqueues one copy: the second gets
// asynq.ErrTaskIDConflict, which means it is already there. If the copy cannot be enqueued
// the original is left to asynq (archived, from where it can be run again): never lost.
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
	n, _ := strconv.Atoi(headers[HeaderDeferrals])
	headers[HeaderDeferrals] = strconv.Itoa(n + 1)
	copyID := copyID(task, id)

	opts := []asynq.Option{
		asynq.Queue(queue),
		asynq.TaskID(copyID),
		asynq.MaxRetry(max(retriesLeft, 0)),
		asynq.ProcessAt(ceilSecond(retryAt)),
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
	_, err := m.client.EnqueueContext(ctx, asynq.NewTaskWithHeaders(task.Type(), task.Payload(), headers), opts...)
	if err != nil && !errors.Is(err, asynq.ErrTaskIDConflict) {
		return fmt.Errorf("worker: task %s has no retry left and its copy %s could not be enqueued: %w (%w)", id, copyID, cause, err)
	}
	return fmt.Errorf("%w; deferred as task %s due %s: %w", cause, copyID, ceilSecond(retryAt).Format(time.RFC3339), asynq.RevokeTask)
}

// copyID is the id of the copy that replaces task (whose asynq id is id) when it has no
// retry left: the first task's id plus ":deferred:<n>", n counting the copies.
func copyID(task *asynq.Task, id string) string {
	origin := task.Headers()[HeaderOriginID]
	if origin == "" {
		origin = id
	}
	n, _ := strconv.Atoi(task.Headers()[HeaderDeferrals])
	return origin + ":deferred:" + strconv.Itoa(n+1)
}

// ceilSecond rounds t up to a whole second: asynq stores retry and scheduled times as
// whole Unix seconds, truncated, so a task due at t must be scheduled at ceilSecond(t) or
// it may run up to 1s early.
func ceilSecond(t time.Time) time.Time {
	if s := t.Truncate(time.Second); !s.Equal(t) {
		return s.Add(time.Second)
	}
	return t
}
