package worker_test

import (
	"context"
	"log/slog"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestShadowRule runs 10 tasks of one tenant, and 2 whose cost could never fit, through a
// real asynq server under "s:call tenant=3/1m cost=header:n mode=shadow": every task
// runs and completes, none is retried or archived; the limiter admitted exactly 3
// (logged in the window log, the only entries there) and the other 9 are counted as
// would-be denials; no reservation was written; a would-be denial is logged with its
// quota.
func TestShadowRule(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	metrics, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "s:call tenant=3/1m cost=header:n mode=shadow"), Redis: rdb,
		Metrics: metrics, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran, withDecision := 0, 0
	runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		mu.Lock()
		defer mu.Unlock()
		ran++
		if _, ok := worker.DecisionFrom(ctx); ok {
			withDecision++
		}
		return nil
	}, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	tasks := []*asynq.Task{
		asynq.NewTaskWithHeaders("s:call", nil, map[string]string{producer.TenantHeader: "acme", "n": "5"}), // over the limit 3
		asynq.NewTaskWithHeaders("s:call", nil, map[string]string{producer.TenantHeader: "acme", "n": "x"}), // not a cost
	}
	for range 10 {
		tasks = append(tasks, producer.NewTask("s:call", nil, "acme"))
	}
	for _, task := range tasks {
		if _, err := client.Enqueue(task, asynq.Retention(time.Hour), asynq.MaxRetry(0)); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 10*time.Second, "12 tasks completed", func() bool { return queueInfo(insp).Completed == 12 })
	if qi := queueInfo(insp); qi.Retry != 0 || qi.Archived != 0 || qi.Scheduled != 0 || qi.Pending != 0 {
		t.Errorf("queue %+v; want all 12 completed, nothing retried, archived or scheduled", qi)
	}
	mu.Lock()
	if ran != 12 || withDecision != 3 {
		t.Errorf("handler ran %d times, %d with an admission; want 12 and 3", ran, withDecision)
	}
	mu.Unlock()
	if got, want := outcomes(t, metrics, "s:call"), wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 3}); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	if got := toFloat64(t, metrics.Decisions.WithLabelValues("s:call", worker.OutcomeShadowDenied)); got != 9 {
		t.Errorf("%s = %g, want 9 (7 over the limit, 2 with a cost that can never fit)", worker.OutcomeShadowDenied, got)
	}
	logKey := lim.RedisKey(throttle.Key{TaskType: "s:call", Tenant: "acme"}, throttle.ScopeTenant)
	if n := len(logEntries(t, rdb, logKey)); n != 3 {
		t.Errorf("window log %s holds %d entries, want the 3 admissions", logKey, n)
	}
	keys, err := rdb.Keys(context.Background(), "throttle:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || keys[0] != logKey {
		t.Errorf("throttle keys %q; want only the window log %s: no reservation, lease or fair tag", keys, logKey)
	}
	var lines []map[string]any
	for _, r := range logs.records(t) {
		if r["task_type"] == "s:call" && r["level"] == "INFO" {
			lines = append(lines, r)
		}
	}
	if len(lines) == 0 {
		t.Fatal("no log line of a would-be denial")
	}
	logged := 0
	for _, l := range lines {
		if l["tenant"] != "acme" || l["rule"] != "s:call tenant=3/1m cost=header:n mode=shadow" || l["task_id"] == "" {
			t.Errorf("log line %v: want tenant acme, the rule and the task id", l)
		}
		if q, ok := l["quota"]; ok && q != "tenant=3/1m" {
			t.Errorf("log line %v: quota %v, want tenant=3/1m", l, q)
		}
		logged += 1 + int(l["not_logged_since_last"].(float64))
	}
	if logged > 9 {
		t.Errorf("log lines account for %d would-be denials, more than the 9 counted", logged)
	}
}

// TestShadowRule_unavailable: with its Redis down, a shadow rule runs the task at once
// (not after UnavailableWait) and counts it as failed_open.
func TestShadowRule_unavailable(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "u:call tenant=1/1m mode=shadow"), Redis: rdb,
		Metrics: metrics, SweepInterval: -1, UnavailableWait: time.Hour, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	ran := 0
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	for range 2 {
		if err := h.ProcessTask(context.Background(), producer.NewTask("u:call", nil, "acme")); err != nil {
			t.Fatalf("ProcessTask: %v", err)
		}
	}
	if ran != 2 {
		t.Errorf("handler ran %d times, want 2", ran)
	}
	if got, want := outcomes(t, metrics, "u:call"), wantOutcomes(map[string]float64{worker.OutcomeFailedOpen: 2}); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	if n := countMsg(t, &logs, "throttle: limiter unavailable; running tasks of a shadow rule undecided (logged at most once a minute)"); n != 1 {
		t.Errorf("%d log lines of the outage, want 1", n)
	}
	// Both tasks' calls failed (one at a time: the second is the outage's probe). A shadow
	// rule's calls are in the call metrics as an enforced one's:
	// a trial saw redis_errors_total 0 and no script_duration series for a shadow rollout
	// whose Redis was down.
	labels := map[string]string{"task_type": "u:call", "call": worker.CallAllow}
	if got := counter(t, reg, "asynq_throttle_redis_errors_total", labels); got != 2 {
		t.Errorf("redis_errors_total{call=allow} = %v, want 2", got)
	}
	if got := histogram(t, reg, "asynq_throttle_script_duration_seconds", labels).GetSampleCount(); got != 2 {
		t.Errorf("script_duration_seconds{call=allow} has %d samples, want 2", got)
	}
}
