package worker_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestPause_recheck: acme's log is paused for 1h; a task of acme is denied by the pause
// and re-queued for PauseRecheck (1 min) later, rounded up to a whole second as every
// denial is, not for the pause's end, so that a resume reaches it within a minute. It
// has not run, and no retry is spent.
func TestPause_recheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	key := throttle.Key{TaskType: "p:call", Tenant: "acme"}
	if err := lim.Pause(ctx, key, throttle.ScopeTenant, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "p:call tenant=5/1s"), Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error { ran.Add(1); return nil }, nil)
	before := time.Now()
	info, err := producer.Enqueue(ctx, asynq.NewClientFromRedisClient(rdb), "p:call", nil, "acme")
	if err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	var ti *asynq.TaskInfo
	waitUntil(t, 10*time.Second, "the task was denied and re-queued", func() bool {
		ti, err = insp.GetTaskInfo("default", info.ID)
		return err == nil && ti.State == asynq.TaskStateRetry
	})
	after := time.Now()
	// The retry instant: the decision's now + 1 min, rounded up to a whole second.
	earliest, latest := before.Add(worker.PauseRecheck).Truncate(time.Second), after.Add(worker.PauseRecheck+time.Second)
	if ti.NextProcessAt.Before(earliest) || ti.NextProcessAt.After(latest) {
		t.Errorf("re-queued for %s; want %s to %s: PauseRecheck after its decision, not the pause's end (in 1h)",
			ti.NextProcessAt.Format(time.RFC3339), earliest.Format(time.RFC3339), latest.Format(time.RFC3339))
	}
	if ti.Retried != 0 || ran.Load() != 0 {
		t.Errorf("Retried %d, handler runs %d; want 0 and 0", ti.Retried, ran.Load())
	}
}
