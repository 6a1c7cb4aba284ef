package worker_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestClockSkew: a worker whose clock is 10 minutes ahead of the Redis server decides by
// the server's TIME instead (throttle.Config.MaxSkew), and says so once in its log (at most
// once a minute) and in asynq_throttle_clock_skew_fallbacks_total for every decision, with
// the skew in asynq_throttle_clock_skew_seconds. The 3 tasks against 1/1m: one runs, and
// the others wait, as with a right clock.
func TestClockSkew(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	const ahead = 10 * time.Minute
	lim, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return time.Now().Add(ahead) }})
	if err != nil {
		t.Fatal(err)
	}
	metrics, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	var logs syncBuffer
	mw, err := worker.New(lim, worker.Config{
		Rules:   mustRules(t, "s:call tenant=1/1m"),
		Redis:   rdb,
		Metrics: metrics,
		Logger:  slog.New(slog.NewJSONHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	var at atomic.Int64
	runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		d, _ := worker.DecisionFrom(ctx)
		at.Store(d.At.UnixMilli())
		ran.Add(1)
		return nil
	}, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	for range 3 {
		if _, err := client.Enqueue(producer.NewTask("s:call", nil, "acme")); err != nil {
			t.Fatal(err)
		}
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	waitUntil(t, 10*time.Second, "one task ran and two wait in retry", func() bool {
		qi := queueInfo(insp)
		return ran.Load() == 1 && qi.Retry == 2 && qi.Active == 0 && qi.Pending == 0
	})
	if off := time.Until(time.UnixMilli(at.Load())); off > time.Second || off < -5*time.Second {
		t.Errorf("admitted at %v, %v from now: want the server's (real) time, not 10 minutes ahead", time.UnixMilli(at.Load()), off)
	}
	if got := toFloat64(t, metrics.SkewFallbacks.WithLabelValues("s:call")); got != 3 {
		t.Errorf("clock skew fallbacks = %v, want 3 (every decision)", got)
	}
	if got := toFloat64(t, metrics.ClockSkew); got < (ahead-time.Second).Seconds() || got > (ahead+time.Second).Seconds() {
		t.Errorf("clock skew gauge = %vs, want within 1s of %v", got, ahead)
	}
	var warned int
	for _, r := range logs.records(t) {
		if strings.Contains(r["msg"].(string), "clock is off") {
			warned++
		}
	}
	if warned != 1 {
		t.Errorf("%d clock-skew log lines, want 1 (at most one a minute): %v", warned, logs.records(t))
	}
}
