package worker_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestOverrides_lowerBindsWaiting: a quota lowered while tasks wait binds them too. The
// rule "api:call tenant=10/1s" and 24 tasks of one tenant at once: 10 run, 14 reserve
// slots of 10/1s (10 at about 1 s, 4 at about 2 s). Before the first of those slots, a
// type override lowers the rule to tenant=2/1s. Every task still runs once, none is
// archived, and the admissions decided after the override was in force (the claims, and
// the new reservations of those whose old slot no longer fits) hold at most 2 in any 1 s:
// before the claim check, the 10 tasks holding slots at about 1 s all ran there.
func TestOverrides_lowerBindsWaiting(t *testing.T) {
	t.Parallel()
	const tasks = 24
	rdb := redistest.Start(t)
	ctx := context.Background()
	store, err := worker.NewOverrideStore(rdb, "")
	if err != nil {
		t.Fatal(err)
	}
	var inForce atomic.Int64 // UnixNano of the reload that read the override; 0 before
	var want atomic.Int64    // the override's version
	var mu sync.Mutex
	var after []time.Time // Decision.At of the admissions decided once it was in force
	before := 0
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{
		Rules: mustRules(t, "api:call tenant=10/1s"), Redis: rdb, Concurrency: 20,
		Overrides: store, OverrideInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil)),
		OverrideReloadFunc: func(v int64, err error) {
			if err == nil && v > 0 && v == want.Load() {
				inForce.CompareAndSwap(0, time.Now().UnixNano())
			}
		},
		DecisionFunc: func(_ context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			if !d.Allowed {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if inForce.Load() != 0 {
				after = append(after, d.At)
			} else {
				before++
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error {
		ran.Add(1)
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 20 })

	client := asynq.NewClientFromRedisClient(rdb)
	t.Cleanup(func() { _ = client.Close() })
	for i := range tasks {
		if _, err := producer.Enqueue(ctx, client, "api:call", []byte(fmt.Sprint(i)), "acme"); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 5*time.Second, "the first 10 tasks ran", func() bool { return ran.Load() >= 10 })
	c, err := store.Set(ctx, worker.OverrideType, "api:call", "tenant=2/1s")
	if err != nil {
		t.Fatal(err)
	}
	want.Store(c.Version)
	waitUntil(t, 2*time.Second, "the override is in force", func() bool { return inForce.Load() != 0 })
	// 14 tasks at 2/1s after the first second: about 8 s more.
	waitUntil(t, 30*time.Second, "every task ran", func() bool { return ran.Load() == tasks })

	mu.Lock()
	defer mu.Unlock()
	// A task woken early for its slot can claim it (under 10/1s) before the reload that
	// reads the override: it counts before, and the claims after it still fit 2/1s.
	if before < 10 || before+len(after) != tasks {
		t.Fatalf("%d admissions before the override was in force and %d after, want 10 or more before and %d in all (one per task)",
			before, len(after), tasks)
	}
	if got := throttle.MaxInWindow(after, time.Second); got != 2 {
		t.Errorf("the admissions decided under tenant=2/1s: %d within 1s, want 2", got)
	}
	if qi, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo("default"); err != nil || qi.Archived != 0 || ran.Load() != tasks {
		t.Errorf("queue %+v, %v, %d runs; want none archived and %d runs", qi, err, ran.Load(), tasks)
	}
}
