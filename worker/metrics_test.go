package worker_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestMetrics runs 3 tasks of one tenant against "m:call tenant=1/1m" on a real asynq
// server: the first is admitted, the second (MaxRetry 3) denied and left to asynq's
// retry, the third (MaxRetry 0) deferred as a copy. Each outcome series counts exactly
// that, and nothing else is counted.
func TestMetrics(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "m:call tenant=1/1m"), Redis: rdb, Metrics: metrics})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	srv := runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error { ran.Add(1); return nil }, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	enqueue := func(id string, maxRetry int) {
		t.Helper()
		if _, err := client.Enqueue(producer.NewTask("m:call", nil, "acme"), asynq.TaskID(id), asynq.MaxRetry(maxRetry)); err != nil {
			t.Fatal(err)
		}
	}
	enqueue("first", 3)
	waitUntil(t, 10*time.Second, "the first task ran", func() bool { return ran.Load() == 1 })
	enqueue("second", 3)
	enqueue("third", 0)
	waitUntil(t, 10*time.Second, "the second task waits in retry and the third's copy is scheduled", func() bool {
		qi := queueInfo(insp)
		return qi.Retry == 1 && qi.Scheduled == 1 && qi.Active == 0 && qi.Pending == 0
	})
	srv.Shutdown() // the window is 1m: nothing else is decided before the test ends

	second, err := insp.GetTaskInfo("default", "second")
	if err != nil {
		t.Fatal(err)
	}
	if second.Retried != 0 {
		t.Errorf("denied task: Retried %d, want 0", second.Retried)
	}
	if _, err := insp.GetTaskInfo("default", "third:deferred:1"); err != nil {
		t.Errorf("deferred copy of the third task: %v", err)
	}
	if n := ran.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	// Only the series that were counted exist.
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "asynq_throttle_decisions_total" && len(f.GetMetric()) != 3 {
			t.Errorf("asynq_throttle_decisions_total has %d series, want 3: %v", len(f.GetMetric()), f.GetMetric())
		}
		if f.GetName() == "asynq_throttle_clock_skew_fallbacks_total" && len(f.GetMetric()) != 0 {
			t.Errorf("asynq_throttle_clock_skew_fallbacks_total has series %v, want none", f.GetMetric())
		}
	}
	want := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 1, worker.OutcomeDenied: 1, worker.OutcomeDeferred: 1})
	if got := outcomes(t, metrics, "m:call"); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	if got := toFloat64(t, metrics.SkewFallbacks.WithLabelValues("m:call")); got != 0 {
		t.Errorf("skew fallbacks = %g, want 0", got)
	}
	// The clock skew gauge was set by the decisions: this process and a loopback Redis
	// share a clock, so it is well under the 1s tolerance.
	if got := toFloat64(t, metrics.ClockSkew); got <= -1 || got >= 1 {
		t.Errorf("clock skew = %gs, want |skew| < 1s", got)
	}
}

func TestNewMetrics_twice(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	if _, err := worker.NewMetrics(reg); err != nil {
		t.Fatal(err)
	}
	m, err := worker.NewMetrics(reg)
	if err == nil {
		t.Fatal("second NewMetrics on one registry: no error")
	}
	if m != nil {
		t.Errorf("second NewMetrics returned %v with its error, want nil", m)
	}
	if !strings.HasPrefix(err.Error(), "worker: ") {
		t.Errorf("error %q does not start with \"worker: \"", err)
	}
	var already prometheus.AlreadyRegisteredError
	if !errors.As(err, &already) {
		t.Errorf("error %q does not wrap prometheus.AlreadyRegisteredError", err)
	}
	// Another registry is independent.
	if _, err := worker.NewMetrics(prometheus.NewRegistry()); err != nil {
		t.Errorf("NewMetrics on a second registry: %v", err)
	}
}
