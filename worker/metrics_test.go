package worker_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

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
	// Three limiter calls, one per task. With 1 task a minute the second and third tasks
	// (in the order they were decided) were given the next slots, up to 1m and up to 2m
	// ahead (their reservations' instants).
	if h := histogram(t, reg, "asynq_throttle_script_duration_seconds", map[string]string{"task_type": "m:call", "call": worker.CallAllow}); h.GetSampleCount() != 3 {
		t.Errorf("script duration: %d calls observed, want 3", h.GetSampleCount())
	}
	var count, within30, within60, within300 uint64
	for _, outcome := range []string{worker.OutcomeDenied, worker.OutcomeDeferred} {
		h := histogram(t, reg, "asynq_throttle_delay_seconds", map[string]string{"task_type": "m:call", "outcome": outcome})
		if h.GetSampleCount() != 1 {
			t.Errorf("delays of %s tasks: %d observed, want 1", outcome, h.GetSampleCount())
		}
		count, within30, within60, within300 = count+h.GetSampleCount(), within30+bucket(t, h, 30), within60+bucket(t, h, 60), within300+bucket(t, h, 300)
	}
	if count != 2 || within30 != 0 || within60 != 1 || within300 != 2 {
		t.Errorf("delays: %d observed, %d within 30s, %d within 60s, %d within 300s; want 2, 0, 1, 2", count, within30, within60, within300)
	}
	// Both held back tasks hold a reservation (the copy keeps the third task's).
	if got := gauge(t, reg, "asynq_throttle_reservations_held", map[string]string{"task_type": "m:call"}); got != 2 {
		t.Errorf("reservations held = %g, want 2", got)
	}
	for _, call := range []string{worker.CallAllow, worker.CallCancel, worker.CallReservations} {
		if got := counter(t, reg, "asynq_throttle_redis_errors_total", map[string]string{"task_type": "m:call", "call": call}); got != 0 {
			t.Errorf("redis errors of %s = %g, want 0", call, got)
		}
	}
	if got := gauge(t, reg, "asynq_throttle_tasks_waiting", map[string]string{"task_type": "m:call"}); got != 0 {
		t.Errorf("tasks waiting = %g, want 0", got)
	}
}

// TestMetrics_waited sends two tasks of one tenant against "w:call tenant=1/2s" without
// reservations: the second is admitted for the slot 2s after the first and waits for it
// in its handler, counted in asynq_throttle_tasks_waiting meanwhile and then in the
// waited delay histogram.
func TestMetrics_waited(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "w:call tenant=1/2s"), Redis: rdb,
		Metrics: metrics, NoReservations: true, MaxWait: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error { ran.Add(1); return nil }, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	for range 2 {
		if _, err := client.Enqueue(producer.NewTask("w:call", nil, "acme")); err != nil {
			t.Fatal(err)
		}
	}
	waiting := metrics.TasksWaiting.WithLabelValues("w:call")
	waitUntil(t, 10*time.Second, "one task waits in its handler", func() bool { return toFloat64(t, waiting) == 1 && ran.Load() == 1 })
	waitUntil(t, 10*time.Second, "both tasks ran", func() bool { return ran.Load() == 2 })
	if got := toFloat64(t, waiting); got != 0 {
		t.Errorf("tasks waiting after both ran = %g, want 0", got)
	}
	want := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 1, worker.OutcomeWaited: 1})
	if got := outcomes(t, metrics, "w:call"); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	h := histogram(t, reg, "asynq_throttle_delay_seconds", map[string]string{"task_type": "w:call", "outcome": worker.OutcomeWaited})
	// The second task waits until the first's admission leaves the 2s window: at most 2s
	// after its own call, plus the ms by which that call may have been stamped before the
	// first's admission (asynq dequeues both at once; such a call is decided at the log's
	// high-water instant, so its Delay counts from its own stamp).
	if h.GetSampleCount() != 1 || bucket(t, h, 2.5) != 1 || h.GetSampleSum() <= 0 || h.GetSampleSum() > 2.1 {
		t.Errorf("waited delay: %d observed, %d within 2.5s, sum %gs; want 1, 1, in (0, 2.1s]",
			h.GetSampleCount(), bucket(t, h, 2.5), h.GetSampleSum())
	}
	if f := family(t, reg, "asynq_throttle_reservations_held"); f != nil {
		t.Errorf("reservations held listed without reservations: %v", f.GetMetric())
	}
}

// TestMetrics_redisErrors decides two tasks against a Redis that is down, with FailOpen
// and an UnavailableWait too short for a second attempt: each makes exactly one limiter
// call, counted as a Redis error, and runs unthrottled. A scrape then fails to list the
// reservations and counts that too.
func TestMetrics_redisErrors(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	srv.Stop()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "e:call tenant=5/1s"), Redis: rdb,
		Metrics: metrics, FailOpen: true, UnavailableWait: time.Millisecond, SweepInterval: -1,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	for range 2 {
		if err := h.ProcessTask(context.Background(), producer.NewTask("e:call", nil, "acme")); err != nil {
			t.Fatal(err)
		}
	}
	if ran != 2 {
		t.Errorf("handler ran %d times, want 2 (fail open)", ran)
	}
	want := wantOutcomes(map[string]float64{worker.OutcomeFailedOpen: 2})
	if got := outcomes(t, metrics, "e:call"); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	if got := toFloat64(t, metrics.RedisErrors.WithLabelValues("e:call", worker.CallAllow)); got != 2 {
		t.Errorf("redis errors of allow = %g, want 2", got)
	}
	// Each scrape reports its own failed listing: 1 in the first, 2 in the second (the
	// counter used to be collected beside the listing, and could lag a scrape behind).
	reservationErrors := map[string]string{"task_type": "e:call", "call": worker.CallReservations}
	for scrape := 1; scrape <= 2; scrape++ {
		if got := counter(t, reg, "asynq_throttle_redis_errors_total", reservationErrors); got != float64(scrape) {
			t.Errorf("scrape %d reports %g Redis errors of reservations, want %d", scrape, got, scrape)
		}
	}
	if f := family(t, reg, "asynq_throttle_reservations_held"); f != nil {
		t.Errorf("reservations held reported although Redis is down: %v", f.GetMetric())
	}
	if h := histogram(t, reg, "asynq_throttle_script_duration_seconds", map[string]string{"task_type": "e:call", "call": worker.CallAllow}); h.GetSampleCount() != 2 {
		t.Errorf("script duration: %d calls observed, want 2", h.GetSampleCount())
	}
}

// TestMetrics_tenantLabel counts decisions by tenant with MetricsConfig{TenantLabel: true,
// MaxTenants: 3}: the first three distinct label values keep theirs, later tenants count as
// "other", a long tenant is cut to MaxTenantLabelBytes and bad UTF-8 is replaced.
func TestMetrics_tenantLabel(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetricsWithConfig(reg, worker.MetricsConfig{TenantLabel: true, MaxTenants: 3})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "l:call tenant=100/1m"), Redis: rdb,
		Metrics: metrics, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	long := strings.Repeat("é", 100) // 200 bytes; its first 64 are 32 é
	for _, tenant := range []string{"acme", "acme", long, "bad\xffutf8", "initech", "acme", "globex", long + "x"} {
		if err := h.ProcessTask(context.Background(), producer.NewTask("l:call", nil, tenant)); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]float64{}
	for _, m := range family(t, reg, "asynq_throttle_decisions_total").GetMetric() {
		labels := labelMap(m)
		if labels["task_type"] != "l:call" || labels["outcome"] != worker.OutcomeAdmitted {
			t.Errorf("unexpected series %v", labels)
		}
		got[labels["tenant"]] = m.GetCounter().GetValue()
	}
	want := map[string]float64{"acme": 3, strings.Repeat("é", 32): 2, "bad\uFFFDutf8": 1, worker.OtherTenant: 2}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("decisions by tenant: %v, want %v", got, want)
	}
}

func TestNewMetricsWithConfig_negativeMaxTenants(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := worker.NewMetricsWithConfig(reg, worker.MetricsConfig{TenantLabel: true, MaxTenants: -1})
	if err == nil || m != nil || err.Error() != "worker: MetricsConfig.MaxTenants -1 < 0" {
		t.Fatalf("got %v, %v; want nil and the error worker: MetricsConfig.MaxTenants -1 < 0", m, err)
	}
	if fams, err := reg.Gather(); err != nil || len(fams) != 0 {
		t.Errorf("registry after the error: %d families (%v), want none", len(fams), err)
	}
}

// TestNewMetrics_nilRegisterer: a nil Registerer is an error, not a panic.
func TestNewMetrics_nilRegisterer(t *testing.T) {
	t.Parallel()
	m, err := worker.NewMetrics(nil)
	if err == nil || m != nil || err.Error() != "worker: NewMetrics: a nil prometheus.Registerer" {
		t.Fatalf("got %v, %v; want nil and the error worker: NewMetrics: a nil prometheus.Registerer", m, err)
	}
}

// TestNewMetrics_hooks checks that the metrics other code sets exist from the start, at 0,
// under their fixed names.
func TestNewMetrics_hooks(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	if got := gauge(t, reg, "asynq_throttle_pauses_active", nil); got != 0 {
		t.Errorf("pauses active = %g, want 0", got)
	}
	for _, result := range []string{worker.ReloadOK, worker.ReloadError} {
		if got := counter(t, reg, "asynq_throttle_override_reloads_total", map[string]string{"result": result}); got != 0 {
			t.Errorf("override reloads{result=%s} = %g, want 0", result, got)
		}
	}
	m.PausesActive.Inc()
	m.OverrideReloads.WithLabelValues(worker.ReloadError).Inc()
	if got := gauge(t, reg, "asynq_throttle_pauses_active", nil); got != 1 {
		t.Errorf("pauses active after Inc = %g, want 1", got)
	}
	if got := counter(t, reg, "asynq_throttle_override_reloads_total", map[string]string{"result": worker.ReloadError}); got != 1 {
		t.Errorf("override reloads{result=error} after Inc = %g, want 1", got)
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

// TestMetrics_overdueCancel runs two tasks of one tenant against "o:call tenant=1/1m
// max-delay=1s overdue=drop": the second would wait a minute, so it is dropped and gives
// up the reservation its decision made. That is two allow calls and one cancel, and no
// reservation is left.
func TestMetrics_overdueCancel(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "o:call tenant=1/1m max-delay=1s overdue=drop"),
		Redis: rdb, Metrics: metrics, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	runAsynq(t, rdb, mw, func(context.Context, *asynq.Task) error { ran.Add(1); return nil }, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range 2 {
		if _, err := client.Enqueue(producer.NewTask("o:call", nil, "acme")); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 10*time.Second, "the task was decided", func() bool {
			got := outcomes(t, metrics, "o:call")
			return got[worker.OutcomeAdmitted]+got[worker.OutcomeOverdue] == float64(i+1)
		})
	}
	want := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 1, worker.OutcomeOverdue: 1})
	if got := outcomes(t, metrics, "o:call"); !reflect.DeepEqual(got, want) {
		t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	for call, want := range map[string]uint64{worker.CallAllow: 2, worker.CallCancel: 1} {
		if h := histogram(t, reg, "asynq_throttle_script_duration_seconds", map[string]string{"task_type": "o:call", "call": call}); h.GetSampleCount() != want {
			t.Errorf("script duration of %s: %d calls observed, want %d", call, h.GetSampleCount(), want)
		}
	}
	if got := gauge(t, reg, "asynq_throttle_reservations_held", map[string]string{"task_type": "o:call"}); got != 0 {
		t.Errorf("reservations held after the cancel = %g, want 0", got)
	}
	if n := ran.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}
