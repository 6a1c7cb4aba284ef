package worker_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestDurableNotReplicated runs a task through the middleware with a durable limiter
// (throttle.Config.MinReplicas 1) on a Redis that has no replica yet, rule tenant=2/1m.
// Its admission is written but not acknowledged: throttle.ErrNotReplicated, which the
// middleware handles as the limiter being unavailable (fail closed). The task does not
// run; it waits in state retry, Retried 0, its LastErr naming both errors, counted once as
// unavailable; its repeats within UnavailableWait were replays, so the log holds its one
// entry. Then a replica is attached, in sync well before the task comes back after
// UnavailableRetryDelay (5s) with a new event id: admitted and acknowledged at once, it
// runs once. The log then holds 2
// entries for 1 run: the unacknowledged admission keeps its slot on the primary.
func TestDurableNotReplicated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)                                             // asynq's
	limSrv := redistest.StartServer(t, "--repl-diskless-sync-delay", "0") // syncs a replica at once
	limRDB := limSrv.Client()
	// A replica in sync acknowledges in well under 1ms: 500ms is a wide margin for the
	// run's admission, and lets UnavailableWait (1.5s) make a few attempts first.
	lim, err := throttle.New(limRDB, throttle.Config{MinReplicas: 1, ReplicaTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	metrics, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "dur:call tenant=2/1m"), Redis: rdb,
		UnavailableWait: 1500 * time.Millisecond, Metrics: metrics, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran := 0
	runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		if d, ok := worker.DecisionFrom(ctx); !ok || !d.Allowed || d.Replay {
			t.Errorf("ran without a fresh admission: %+v, %v", d, ok)
		}
		mu.Lock()
		defer mu.Unlock()
		ran++
		return nil
	}, nil)
	runs := func() int {
		mu.Lock()
		defer mu.Unlock()
		return ran
	}
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if _, err := producer.Enqueue(ctx, client, "dur:call", nil, "acme", asynq.TaskID("a"), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
		t.Fatal(err)
	}
	info := func() *asynq.TaskInfo {
		ti, err := insp.GetTaskInfo("default", "a")
		if err != nil {
			return &asynq.TaskInfo{}
		}
		return ti
	}
	waitUntil(t, 10*time.Second, "the task waits in retry", func() bool { return info().State == asynq.TaskStateRetry })
	ti := info()
	if ti.Retried != 0 || !strings.Contains(ti.LastErr, worker.ErrUnavailable.Error()) || !strings.Contains(ti.LastErr, "0 of 1 replicas acknowledged it within 500ms") {
		t.Errorf("task: Retried %d, LastErr %q; want 0, naming %q and the replicas", ti.Retried, ti.LastErr, worker.ErrUnavailable)
	}
	if got := toFloat64(t, metrics.Decisions.WithLabelValues("dur:call", worker.OutcomeUnavailable)); got != 1 {
		t.Errorf("%g decisions counted unavailable, want 1", got)
	}
	// One warning says why the task went back (at most one per 10s).
	if out := logs.String(); strings.Count(out, "the limiter could not decide") != 1 || !strings.Contains(out, "0 of 1 replicas acknowledged it within 500ms") {
		t.Errorf("log:\n%s\nwant one line saying the limiter could not decide, with the replicas' count", out)
	}
	logKey := lim.RedisKey(throttle.Key{TaskType: "dur:call", Tenant: "acme"}, throttle.ScopeTenant)
	if got := len(admissions(t, limRDB, logKey)); got != 1 || runs() != 0 {
		t.Fatalf("%d entries in the log and %d runs, want 1 (written, not acknowledged) and 0", got, runs())
	}

	// A replica: the next decision is acknowledged.
	host, port, _ := strings.Cut(limSrv.Addr, ":")
	redistest.StartServer(t, "--replicaof", host, port)
	waitUntil(t, 10*time.Second, "the replica acknowledges a write", func() bool {
		var wait *redis.Cmd
		_, err := limRDB.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, "sync-probe", "1", time.Minute)
			wait = p.Do(ctx, "WAIT", 1, 100)
			return nil
		})
		n, _ := wait.Int()
		return err == nil && n == 1
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("task: %+v; log: %v", *info(), logEntries(t, limRDB, logKey))
		}
	})
	waitUntil(t, 20*time.Second, "the task completed", func() bool { return info().State == asynq.TaskStateCompleted })
	if ti := info(); ti.Retried != 0 || runs() != 1 {
		t.Errorf("task: Retried %d, %d runs; want 0 and 1", ti.Retried, runs())
	}
	if got := len(admissions(t, limRDB, logKey)); got != 2 {
		t.Errorf("%d entries in the log, want 2: the unacknowledged one and the run's", got)
	}
}
