package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
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

// pickUpBound is how soon after `throttle limits set` returns every worker decides by
// the change: the default check interval (worker.DefaultOverrideInterval, 1s) plus a
// second for the read and a loaded machine. It is the bound.
const pickUpBound = 2 * time.Second

// TestLimits_runningWorkerPicksUpChange runs a worker (an asynq server with the
// middleware, its overrides checked at the default interval, as cmd/worker does) under
// "o:call tenant=2/1m", changes its limits with the CLI while it runs, and enqueues tasks
// pickUpBound after each change returned: the exact new limit decides them.
//
//  1. acme, default 2/1m: 3 tasks, 2 run, 1 denied.
//  2. tier pro (tenant=5/1m) and globex in it: 6 tasks, 5 run, 1 denied.
//  3. the type's rule becomes tenant=3/1m: acme (2 used) runs 1 more of 2.
func TestLimits_runningWorkerPicksUpChange(t *testing.T) {
	srv := redistest.StartServer(t)
	setEnv(t, "REDIS_ADDR", srv.Addr)
	rdb := srv.Client()
	var reloads sync.Map // version -> time put in force
	w := startWorker(t, rdb, "o:call tenant=2/1m", func(c *worker.Config) {
		c.OverrideReloadFunc = func(v int64, err error) {
			if err == nil {
				reloads.Store(v, time.Now())
			}
		}
	})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	// enqueue adds n tasks of tenant and waits until the worker ran wantRan of that
	// tenant's in all and wantRetry tasks in all wait denied (retry state).
	enqueue := func(tenant string, n, wantRan, wantRetry int) {
		t.Helper()
		for range n {
			if _, err := client.Enqueue(producer.NewTask("o:call", nil, tenant)); err != nil {
				t.Fatal(err)
			}
		}
		deadline := time.Now().Add(15 * time.Second)
		for {
			qi, err := insp.GetQueueInfo("default")
			got := w.ran(tenant)
			if err == nil && qi.Pending == 0 && qi.Active == 0 && qi.Retry == wantRetry && got == wantRan {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: ran %d, queue %+v; want %d run and %d waiting in retry", tenant, got, qi, wantRan, wantRetry)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// change runs the CLI, then waits pickUpBound.
	setAt := map[int64]time.Time{} // version -> when the CLI returned
	change := func(args ...string) {
		t.Helper()
		code, out, errOut := cli(t, append([]string{"-json", "limits", "set"}, args...)...)
		var c worker.Change
		if err := json.Unmarshal([]byte(out), &c); code != exitOK || err != nil {
			t.Fatalf("throttle limits set %q: exit %d, %s%s", args, code, out, errOut)
		}
		setAt[c.Version] = time.Now()
		time.Sleep(pickUpBound)
	}

	enqueue("acme", 3, 2, 1)
	change("tier", "pro", "tenant=5/1m")
	change("tenant-tier", "globex", "pro")
	enqueue("globex", 6, 5, 2)
	change("type", "o:call", "tenant=3/1m")
	enqueue("acme", 2, 3, 3)

	if ran := w.all(); ran["acme"] != 3 || ran["globex"] != 5 || len(ran) != 2 {
		t.Errorf("ran %v, want acme 3 and globex 5", ran)
	}
	for v := int64(1); v <= 3; v++ {
		at, ok := reloads.Load(v)
		if !ok {
			t.Errorf("the worker never put version %d in force", v)
			continue
		}
		t.Logf("version %d in force %v after the CLI returned", v, at.(time.Time).Sub(setAt[v]).Round(time.Millisecond))
	}
}

// testWorker is a worker started by startWorker: the handler runs it counted, by tenant.
type testWorker struct {
	mu   sync.Mutex
	runs map[string]int
}

// ran returns how many tasks of tenant the handler ran so far.
func (w *testWorker) ran(tenant string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.runs[tenant]
}

// all returns a copy of the runs so far, by tenant.
func (w *testWorker) all() map[string]int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.runs)
}

// startWorker runs a worker as cmd/worker does, on rdb (THROTTLE_PREFIX's default): the
// middleware under rules, its overrides checked at the default interval (tweak, if not
// nil, changes its Config), on an asynq server of Concurrency 10 on the default queue whose handler
// counts each run by tenant. Both stop at the test's end.
func startWorker(t *testing.T, rdb *redis.Client, rules string, tweak func(*worker.Config)) *testWorker {
	t.Helper()
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store, err := worker.NewOverrideStore(rdb, "throttle")
	if err != nil {
		t.Fatal(err)
	}
	rs, err := worker.ParseRules(rules)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cfg := worker.Config{Rules: rs, Redis: rdb, Overrides: store, Context: ctx,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if tweak != nil {
		tweak(&cfg)
	}
	mw, err := worker.New(lim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := &testWorker{runs: map[string]int{}}
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{
		Concurrency: 10, Queues: map[string]int{"default": 1}, LogLevel: asynq.FatalLevel, ShutdownTimeout: 2 * time.Second,
		TaskCheckInterval: 50 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond,
	}))
	if err := srv.Start(mw(asynq.HandlerFunc(func(_ context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		w.mu.Lock()
		defer w.mu.Unlock()
		w.runs[tenant]++
		return nil
	}))); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return w
}
