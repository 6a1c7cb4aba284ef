package worker_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestRun_slowReplyStartsAtItsInstant: an admission for a slot ahead waits Decision.Delay
// counted from the call that decided, not from its reply. Rule tenant=1/1s: task 1 is
// admitted at once (At a); task 2, asked right after, is admitted for a + 1s, and its
// reply takes 600ms to come back (a loaded machine, a slow network). It starts at a + 1s,
// within 150ms, never before; waiting the whole Delay after the reply, as before, it
// started about 600ms late (TestFastClock under CI load saw 202ms over its 200ms bound).
func TestRun_slowReplyStartsAtItsInstant(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	hook := &scriptReply{delay: 600 * time.Millisecond} // slow, not lost
	lrdb := redis.NewClient(&redis.Options{Addr: rdb.Options().Addr})
	t.Cleanup(func() { _ = lrdb.Close() })
	lrdb.AddHook(hook)
	lim := newLimiter(t, lrdb)
	var mu sync.Mutex
	var decisions []throttle.Decision
	mw, err := worker.New(lim, worker.Config{
		Rules: mustRules(t, "api:call tenant=1/1s"), Redis: rdb, NoReservations: true, SweepInterval: -1,
		Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil)),
		DecisionFunc: func(_ context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			mu.Lock()
			decisions = append(decisions, d)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var ran []time.Time
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		mu.Lock()
		ran = append(ran, time.Now())
		mu.Unlock()
		return nil
	}))
	for i := range 2 {
		hook.on.Store(i == 1)
		if err := h.ProcessTask(context.Background(), producer.NewTask("api:call", nil, "acme")); err != nil {
			t.Fatalf("task %d: ProcessTask = %v, want nil (run, the second for the next slot)", i+1, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(decisions) != 2 || !decisions[0].Allowed || decisions[0].Delay != 0 || !decisions[1].Allowed ||
		decisions[1].At.Sub(decisions[0].At) != time.Second || decisions[1].Delay < 900*time.Millisecond {
		t.Fatalf("decisions %+v; want an admission now, then one for 1s later with a Delay of about 1s", decisions)
	}
	if len(ran) != 2 {
		t.Fatalf("handler ran %d times, want 2", len(ran))
	}
	if late := ran[1].Sub(decisions[1].At); late < 0 || late > 150*time.Millisecond {
		t.Errorf("task 2 started %s after its instant; want 0 to 150ms (its reply took 600ms)", late.Round(time.Millisecond))
	}
}
