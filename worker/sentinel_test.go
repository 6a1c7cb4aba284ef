package worker_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
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

// TestEndToEndSentinel runs the whole path through a Sentinel failover client
// (redistest.StartSentinel) and, beside it, on a single node: one client shared by asynq's
// server, client and inspector, the limiter and the middleware. The workload and every
// expected value are the same on both (see endToEndHA). On Sentinel the keys of asynq and
// of the limiter are on the primary, and reach the replica.
func TestEndToEndSentinel(t *testing.T) {
	t.Parallel()
	t.Run("single node", func(t *testing.T) {
		t.Parallel()
		endToEndHA(t, redistest.Start(t), "e2e:ha")
	})
	t.Run("sentinel", func(t *testing.T) {
		t.Parallel()
		s := redistest.StartSentinel(t)
		rdb := s.Client()
		endToEndHA(t, rdb, "e2e:ha")

		ctx := context.Background()
		if n, err := rdb.Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
			t.Fatalf("WAIT 1 5000 = %d, %v; want the replica caught up", n, err)
		}
		primary, replica := s.Primary.Client(), s.Replica.Client()
		taskKeys, throttleKeys := 0, map[string]bool{}
		it := primary.Scan(ctx, 0, "*", 100).Iterator()
		for it.Next(ctx) {
			k := it.Val()
			switch {
			case strings.HasPrefix(k, "asynq:{default}:t:"):
				taskKeys++
			case strings.HasPrefix(k, "asynq:"):
			case strings.HasPrefix(k, "throttle:{e2e:ha}:"):
				throttleKeys[k] = true
			default:
				t.Errorf("key %q on the primary is neither asynq's nor the limiter's", k)
			}
			if n, err := replica.Exists(ctx, k).Result(); err != nil || n != 1 {
				t.Errorf("key %q is on the primary, not on the replica (%d, %v)", k, n, err)
			}
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		// asynq keeps the 18 completed tasks for their Retention (the two revoked
		// originals of the copies are deleted); the limiter, among others, the window log
		// of each tenant.
		if taskKeys != 18 {
			t.Errorf("the primary holds %d asynq task hashes, want 18", taskKeys)
		}
		lim := newLimiter(t, rdb)
		for _, tenant := range []string{"acme", "globex"} {
			if k := lim.RedisKey(throttle.Key{TaskType: "e2e:ha", Tenant: tenant}, throttle.ScopeTenant); !throttleKeys[k] {
				t.Errorf("window log %s is not on the primary (the limiter's keys there: %v)", k, throttleKeys)
			}
		}
	})
}

// endToEndHA runs rule "<taskType> tenant=3/1s", 2 tenants x 9 tasks, with reservations, on an
// asynq server, client and inspector that all use rdb, as do the limiter and the
// middleware. The ninth task of each tenant has MaxRetry(0) and is enqueued once its
// tenant's first 3 ran, so it is denied and replaced by a copy. Every task completes
// exactly once, none is archived, no retry is spent, each tenant has exactly 3 admissions
// in its busiest 1s window, and asynq logs no error.
func endToEndHA(t *testing.T, rdb redis.UniversalClient, taskType string) {
	t.Helper()
	var mu sync.Mutex
	starts := map[string][]time.Time{} // tenant -> admission instants
	completed := map[string]int{}      // "tenant/seq" -> successful runs
	handler := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		var p clusterPayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return err
		}
		d, ok := worker.DecisionFrom(ctx)
		if !ok || !d.Allowed {
			return fmt.Errorf("handler ran without an admission: %+v", d)
		}
		mu.Lock()
		defer mu.Unlock()
		starts[p.Tenant] = append(starts[p.Tenant], d.At)
		completed[fmt.Sprintf("%s/%d", p.Tenant, p.Seq)]++
		return nil
	})
	admittedOf := func(tenant string) int {
		mu.Lock()
		defer mu.Unlock()
		return len(starts[tenant])
	}
	total := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, c := range completed {
			n += c
		}
		return n
	}

	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, taskType+" tenant=3/1s"), Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	logger := &clusterLogger{}
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{"default": 1},
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          2 * time.Second,
		Logger:                   logger,
	}))
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.Handle(taskType, handler)
	if err := srv.Start(mux); err != nil {
		t.Fatalf("asynq server: %v", err)
	}
	t.Cleanup(srv.Shutdown)

	client := asynq.NewClientFromRedisClient(rdb)
	tenants := []string{"acme", "globex"}
	originID := map[string]string{} // tenant -> ID of its MaxRetry(0) task
	enqueue := func(seq, maxRetry int) {
		for _, tenant := range tenants {
			payload, _ := json.Marshal(clusterPayload{Tenant: tenant, Seq: seq})
			info, err := producer.Enqueue(context.Background(), client, taskType, payload, tenant,
				asynq.MaxRetry(maxRetry), asynq.Retention(time.Hour))
			if err != nil {
				t.Fatalf("enqueue %s/%d: %v", tenant, seq, err)
			}
			if maxRetry == 0 {
				originID[tenant] = info.ID
			}
		}
	}
	for seq := 1; seq <= 8; seq++ {
		enqueue(seq, 3)
	}
	// Once a tenant's first 3 ran, its window and the reservations of seq 4..8 leave no
	// room before t+2s: the MaxRetry(0) task is denied for sure.
	waitUntil(t, 15*time.Second, "each tenant has 3 admissions", func() bool {
		return admittedOf(tenants[0]) >= 3 && admittedOf(tenants[1]) >= 3
	})
	enqueue(9, 0)

	waitUntil(t, 15*time.Second, "all 18 tasks completed", func() bool { return total() >= 18 })
	time.Sleep(500 * time.Millisecond) // let a duplicate run, if any, show up

	mu.Lock()
	for _, tenant := range tenants {
		for seq := 1; seq <= 9; seq++ {
			if n := completed[fmt.Sprintf("%s/%d", tenant, seq)]; n != 1 {
				t.Errorf("task %s/%d completed %d times, want 1", tenant, seq, n)
			}
		}
		if n := len(starts[tenant]); n != 9 {
			t.Errorf("tenant %s: %d admissions, want 9 (one per task)", tenant, n)
		}
		if got := throttle.MaxInWindow(starts[tenant], time.Second); got != 3 {
			t.Errorf("tenant %s: most admissions in a 1s window = %d, want 3 (the limit, reached)", tenant, got)
		}
	}
	mu.Unlock()

	insp := asynq.NewInspectorFromRedisClient(rdb)
	qi, err := insp.GetQueueInfo("default")
	if err != nil {
		t.Fatalf("inspector: %v", err)
	}
	if qi.Archived != 0 || qi.Completed != 18 || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
		t.Errorf("queue: archived=%d completed=%d pending=%d active=%d scheduled=%d retry=%d; want 0 archived, 18 completed, nothing left",
			qi.Archived, qi.Completed, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
	}
	done, err := insp.ListCompletedTasks("default", asynq.PageSize(100))
	if err != nil {
		t.Fatal(err)
	}
	for _, info := range done {
		var p clusterPayload
		_ = json.Unmarshal(info.Payload, &p)
		deferrals, _ := strconv.Atoi(info.Headers[worker.HeaderDeferrals])
		switch {
		case p.Seq == 9 && (deferrals < 1 || info.Headers[worker.HeaderOriginID] != originID[p.Tenant] || info.MaxRetry != 0 || info.Retried != 0):
			t.Errorf("task %s/9 (MaxRetry 0): completed as %s with %d deferrals, origin %q, MaxRetry %d, Retried %d; want a copy of %s, deferred at least once, MaxRetry 0, Retried 0",
				p.Tenant, info.ID, deferrals, info.Headers[worker.HeaderOriginID], info.MaxRetry, info.Retried, originID[p.Tenant])
		case p.Seq != 9 && (deferrals != 0 || info.MaxRetry != 3 || info.Retried != 0):
			t.Errorf("task %s/%d: %d deferrals, MaxRetry %d, Retried %d; want no deferral and no retry spent by throttling (3, 0)",
				p.Tenant, p.Seq, deferrals, info.MaxRetry, info.Retried)
		}
	}
	if servers, err := insp.Servers(); err != nil || len(servers) != 1 {
		t.Errorf("Inspector.Servers() = %d servers, %v; want this one", len(servers), err)
	}
	if errs := logger.logged(); len(errs) > 0 {
		t.Errorf("asynq logged %d errors, first: %s", len(errs), errs[0])
	}
}
