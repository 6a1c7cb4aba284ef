package worker_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestFairTypeQuota: one limit for the whole task type (10/1s), a worker with 20 slots.
// Tenant A enqueues a backlog of 300 tasks (30s of the type's slots); a second later
// tenant B enqueues 10. Denied newcomers are re-queued rather than sitting in handlers, so
// B's tasks reach the limiter at once, and the limiter's fair share gives B half of the
// type's slots: B's 10 tasks all start within a few windows of being enqueued (2.1s
// measured), not after A's backlog (~29s). The type's limit holds throughout.
func TestFairTypeQuota(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "f:call type=10/1s"), Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	starts := map[string][]time.Time{}
	runAsynq(t, rdb, mw, func(ctx context.Context, task *asynq.Task) error {
		d, _ := worker.DecisionFrom(ctx)
		tenant, _ := producer.Tenant(task)
		mu.Lock()
		defer mu.Unlock()
		starts[tenant] = append(starts[tenant], d.At)
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 20 })
	client := asynq.NewClientFromRedisClient(rdb)
	enqueue := func(tenant string, n int) {
		for range n {
			if _, err := client.Enqueue(producer.NewTask("f:call", nil, tenant)); err != nil {
				t.Fatal(err)
			}
		}
	}
	enqueue("A", 300)
	time.Sleep(time.Second)
	bAt := time.Now()
	enqueue("B", 10)
	count := func(tenant string) int {
		mu.Lock()
		defer mu.Unlock()
		return len(starts[tenant])
	}
	waitUntil(t, 20*time.Second, "B's 10 tasks ran", func() bool { return count("B") == 10 })

	mu.Lock()
	defer mu.Unlock()
	var all []time.Time
	for _, ts := range starts {
		all = append(all, ts...)
	}
	if got := throttle.MaxInWindow(all, time.Second); got > 10 {
		t.Errorf("%d starts of the type in one 1s window, over the limit 10", got)
	}
	last := slices.MaxFunc(starts["B"], time.Time.Compare)
	// Fair shares start B's 10 tasks within about 2 windows; allow 8 for a loaded machine,
	// still far from the ~29s that A's backlog would take first come, first served.
	if late := last.Sub(bAt); late > 8*time.Second {
		t.Errorf("B's last task started %v after B enqueued; want within 8 windows (A's backlog would take ~29s)", late)
	}
	t.Logf("B's 10 tasks started within %v of being enqueued, while A had run %d", last.Sub(bAt), len(starts["A"]))
}
