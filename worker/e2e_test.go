package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

// e2ePayload is the payload of the end-to-end tasks: Fail real failures come before the
// task succeeds.
type e2ePayload struct {
	Tenant string `json:"tenant"`
	Seq    int    `json:"seq"`
	Fail   int    `json:"fail"`
}

// journal records, per tenant, what the handler saw.
type journal struct {
	mu        sync.Mutex
	starts    map[string][]time.Time // admission instants of successful runs
	completed map[string]int         // "tenant/seq" -> successful runs
}

func newJournal() *journal {
	return &journal{starts: map[string][]time.Time{}, completed: map[string]int{}}
}

func (j *journal) total() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for _, c := range j.completed {
		n += c
	}
	return n
}

// startServer runs an asynq server on rdb with the throttle middleware and h, configured
// through worker.WrapConfig, and stops it at cleanup.
func startServer(t *testing.T, rdb redis.UniversalClient, rules string, cfg worker.Config, h asynq.HandlerFunc) {
	t.Helper()
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := worker.ParseRules(rules)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Rules, cfg.Redis = parsed, rdb
	mw, err := worker.New(lim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{"default": 1},
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		// Real failures come back after 1s; throttled tasks when their slot frees.
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Second },
		LogLevel:       asynq.ErrorLevel,
	}))
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.Handle("e2e:call", h)
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
}

// TestEndToEnd runs 2 tenants x 30 tasks through a real asynq server with "tenant=5/2s":
// every task completes exactly once, none is archived, no task's retry budget is spent by
// throttling, and no tenant ever has more than 5 handler starts in any 2s window. Every
// fifth task has MaxRetry(0) and every seventh fails once for real with MaxRetry(1), so its
// retries are spent when the throttle denies it: asynq would archive both on a plain error.
// It runs twice: with the defaults, where most waits are sat out in the handler, and with
// MaxWait < 0, where every denied task is re-queued, and those with no retry left are
// replaced by copies.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	t.Run("defaults", func(t *testing.T) {
		t.Parallel()
		testEndToEnd(t, worker.Config{}, false)
	})
	t.Run("requeueEveryDenial", func(t *testing.T) {
		// Never waiting in a handler needs NoReservations: a task that cannot wait for its
		// reserved instant comes back after it, when its slot is promised to the next one.
		t.Parallel()
		testEndToEnd(t, worker.Config{MaxWait: -1, NoReservations: true}, true)
	})
}

func testEndToEnd(t *testing.T, cfg worker.Config, wantDeferrals bool) {
	rdb := redistest.Start(t)
	j := newJournal()
	startServer(t, rdb, "e2e:call tenant=5/2s", cfg, func(ctx context.Context, task *asynq.Task) error {
		var p e2ePayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return err
		}
		d, ok := worker.DecisionFrom(ctx)
		if !ok || !d.Allowed {
			return fmt.Errorf("handler ran without an admission: %+v", d)
		}
		j.mu.Lock()
		defer j.mu.Unlock()
		j.starts[p.Tenant] = append(j.starts[p.Tenant], d.At) // every admitted run takes a slot
		retried, _ := asynq.GetRetryCount(ctx)
		if task.Headers()[worker.HeaderDeferrals] == "" && retried < p.Fail {
			return errors.New("a real failure")
		}
		j.completed[fmt.Sprintf("%s/%d", p.Tenant, p.Seq)]++
		return nil
	})

	client := asynq.NewClientFromRedisClient(rdb)
	maxRetry := map[string]int{} // "tenant/seq" -> MaxRetry at enqueue
	tenants := []string{"acme", "globex"}
	for seq := 1; seq <= 30; seq++ {
		for _, tenant := range tenants {
			p := e2ePayload{Tenant: tenant, Seq: seq}
			n := 3
			switch {
			case seq%5 == 0:
				n = 0
			case seq%7 == 0:
				n, p.Fail = 1, 1
			}
			payload, _ := json.Marshal(p)
			if _, err := producer.Enqueue(context.Background(), client, "e2e:call", payload, tenant,
				asynq.MaxRetry(n), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
			maxRetry[fmt.Sprintf("%s/%d", tenant, seq)] = n
		}
	}

	deadline := time.Now().Add(60 * time.Second)
	for j.total() < 60 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // let a duplicate run, if any, show up
	j.mu.Lock()
	defer j.mu.Unlock()
	for key := range maxRetry {
		if n := j.completed[key]; n != 1 {
			t.Errorf("task %s completed %d times, want 1", key, n)
		}
	}
	for _, tenant := range tenants {
		if got := throttle.MaxInWindow(j.starts[tenant], 2*time.Second); got != 5 {
			t.Errorf("tenant %s: most handler starts in a 2s window = %d, want 5 (the limit, reached)", tenant, got)
		}
	}

	insp := asynq.NewInspectorFromRedisClient(rdb)
	qi, err := insp.GetQueueInfo("default")
	if err != nil {
		t.Fatal(err)
	}
	if qi.Archived != 0 || qi.Completed != 60 || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
		t.Errorf("queue: archived=%d completed=%d pending=%d active=%d scheduled=%d retry=%d; want 0 archived, 60 completed, nothing left",
			qi.Archived, qi.Completed, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
	}
	done, err := insp.ListCompletedTasks("default", asynq.PageSize(100))
	if err != nil {
		t.Fatal(err)
	}
	deferred := 0
	for _, info := range done {
		var p e2ePayload
		_ = json.Unmarshal(info.Payload, &p)
		key := fmt.Sprintf("%s/%d", p.Tenant, p.Seq)
		if info.Headers[worker.HeaderDeferrals] != "" {
			deferred++
		}
		// Throttling never spends a retry: what is left is what real failures left, on the
		// task itself or on the copy that replaced it.
		if left, want := info.MaxRetry-info.Retried, maxRetry[key]-p.Fail; left != want {
			t.Errorf("task %s: MaxRetry %d - Retried %d = %d retries left, want %d", key, info.MaxRetry, info.Retried, left, want)
		}
	}
	if wantDeferrals && deferred == 0 {
		t.Errorf("no task was deferred: the MaxRetry(0) and spent-retry cases were not exercised")
	}
}
