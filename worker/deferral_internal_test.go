package worker

import (
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestCopyDue: a copy is due at its retry instant rounded up to a whole second, unless
// that is not after now: then 100 ms after now (copyDueMargin), so that asynq schedules
// it (its forwarder moves it at its next tick) instead of enqueueing it as pending at once.
func TestCopyDue(t *testing.T) {
	t.Parallel()
	at := func(ms int64) time.Time { return time.UnixMilli(1_800_000_000_000 + ms) }
	for _, c := range []struct{ retryAt, now, want time.Time }{
		{at(10_200), at(10_000), at(11_000)}, // ahead: rounded up
		{at(11_000), at(10_000), at(11_000)}, // a whole second ahead: itself
		{at(10_000), at(10_000), at(10_100)}, // now: not after it
		{at(9_000), at(10_000), at(10_100)},  // past (woken for a slot already near)
		{at(9_500), at(9_800), at(10_000)},   // past, but its second is not over
	} {
		if got := copyDue(c.retryAt, c.now); !got.Equal(c.want) {
			t.Errorf("copyDue(%d, %d) = %d, want %d", c.retryAt.UnixMilli(), c.now.UnixMilli(), got.UnixMilli(), c.want.UnixMilli())
		}
	}
}

// TestCopyDue_scheduledByAsynq: what copyDue relies on in asynq v0.26.0: a task due
// copyDueMargin after now is scheduled, not pending; one due at now is pending at once.
func TestCopyDue_scheduledByAsynq(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	now := time.Now()
	if _, err := client.Enqueue(asynq.NewTask("x", nil), asynq.ProcessAt(copyDue(now.Add(-time.Second), now))); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Enqueue(asynq.NewTask("x", nil), asynq.ProcessAt(now)); err != nil {
		t.Fatal(err)
	}
	qi, err := insp.GetQueueInfo("default")
	if err != nil {
		t.Fatal(err)
	}
	if qi.Scheduled != 1 || qi.Pending != 1 {
		t.Errorf("scheduled %d, pending %d; want 1 and 1 (the copy's due instant scheduled, now's pending)", qi.Scheduled, qi.Pending)
	}
}
