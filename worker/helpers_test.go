package worker_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// This file holds helpers shared by the tests that run a real asynq server.

// newLimiter returns a Limiter on rdb with the default Config, failing t on error.
func newLimiter(t *testing.T, rdb redis.UniversalClient) *throttle.Limiter {
	t.Helper()
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return lim
}

// mustRules parses THROTTLE_RULES text or fails t.
func mustRules(t *testing.T, s string) []worker.Rule {
	t.Helper()
	rules, err := worker.ParseRules(s)
	if err != nil {
		t.Fatal(err)
	}
	return rules
}

// runAsynq starts an asynq server on rdb that runs every task through mw and then h,
// with the fast polling the throttle needs in tests (forwarder 100ms, idle poll ~50ms),
// configured through worker.WrapConfig; tweak, if not nil, edits the Config first. The
// server is shut down at cleanup.
func runAsynq(t *testing.T, rdb redis.UniversalClient, mw asynq.MiddlewareFunc, h asynq.HandlerFunc, tweak func(*asynq.Config)) *asynq.Server {
	t.Helper()
	cfg := asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{"default": 1},
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          2 * time.Second,
		LogLevel:                 asynq.FatalLevel,
	}
	if tweak != nil {
		tweak(&cfg)
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(cfg))
	if err := srv.Start(mw(h)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// waitUntil polls cond every 20ms until it is true, and fails t with what if it is
// still false after timeout.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %s waiting until %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// queueInfo returns the default queue's counts, or zero counts if the queue does not
// exist yet (or Redis cannot answer).
func queueInfo(insp *asynq.Inspector) asynq.QueueInfo {
	qi, err := insp.GetQueueInfo("default")
	if err != nil {
		return asynq.QueueInfo{}
	}
	return *qi
}

// syncBuffer is a bytes.Buffer safe for the concurrent writes of a slog handler and the
// reads of a test.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns what was written so far.
func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// records returns the JSON log records written so far (slog.NewJSONHandler lines).
func (b *syncBuffer) records(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	data := bytes.Clone(b.buf.Bytes())
	b.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var rec map[string]any
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			t.Fatalf("log line %q is not JSON: %v", sc.Text(), err)
		}
		out = append(out, rec)
	}
	return out
}

// toFloat64 returns the value of the one Counter or Gauge that c collects, as
// prometheus/testutil.ToFloat64 does. (testutil itself imports
// github.com/kylelemons/godebug, which is not in go.sum; these tests may not edit go.mod.)
func toFloat64(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 16)
	go func() { c.Collect(ch); close(ch) }()
	var ms []prometheus.Metric
	for m := range ch {
		ms = append(ms, m)
	}
	if len(ms) != 1 {
		t.Fatalf("collector yields %d metrics, want 1", len(ms))
	}
	var pb dto.Metric
	if err := ms[0].Write(&pb); err != nil {
		t.Fatal(err)
	}
	switch {
	case pb.Counter != nil:
		return pb.Counter.GetValue()
	case pb.Gauge != nil:
		return pb.Gauge.GetValue()
	case pb.Untyped != nil:
		return pb.Untyped.GetValue()
	}
	t.Fatalf("metric %v is neither a Counter nor a Gauge", &pb)
	return 0
}

// outcomes returns the value of every outcome series of m.Decisions for taskType.
func outcomes(t *testing.T, m *worker.Metrics, taskType string) map[string]float64 {
	t.Helper()
	got := map[string]float64{}
	for _, o := range allOutcomes {
		got[o] = toFloat64(t, m.Decisions.WithLabelValues(taskType, o))
	}
	return got
}

// allOutcomes lists every outcome label.
var allOutcomes = []string{worker.OutcomeAdmitted, worker.OutcomeWaited, worker.OutcomeDenied, worker.OutcomeDeferred,
	worker.OutcomeUnavailable, worker.OutcomeFailedOpen, worker.OutcomeRejected, worker.OutcomeOverdue,
	worker.OutcomeBackpressure, worker.OutcomePaused}

// wantOutcomes returns every outcome at 0 except those given.
func wantOutcomes(nonZero map[string]float64) map[string]float64 {
	want := map[string]float64{}
	for _, o := range allOutcomes {
		want[o] = 0
	}
	for k, v := range nonZero {
		want[k] = v
	}
	return want
}

func fmtOutcomes(m map[string]float64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b bytes.Buffer
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%g ", k, m[k])
	}
	return b.String()
}

// admissions returns the scores (ms) of the admission entries in the window log key, one
// per slot: an admission of cost c ("*<c>:<id>", or "<id>" for cost 1) counts c times.
// Reservations ("@...", "~...") and the log's sentinels ("#", "#f") are left out.
func admissions(t *testing.T, rdb redis.UniversalClient, key string) []int64 {
	t.Helper()
	var out []int64
	for _, z := range logEntries(t, rdb, key) {
		m := z.Member.(string)
		switch m[0] {
		case '@', '~':
			continue
		case '*':
			n, _ := strconv.Atoi(m[1:strings.IndexByte(m, ':')])
			for range n {
				out = append(out, int64(z.Score))
			}
		default:
			out = append(out, int64(z.Score))
		}
	}
	return out
}

// logEntries returns the entries of the window log key, one per event, without its
// sentinels (scored below -2^50, see lua/sliding_window.lua).
func logEntries(t *testing.T, rdb redis.UniversalClient, key string) []redis.Z {
	t.Helper()
	zs, err := rdb.ZRangeByScoreWithScores(context.Background(), key, &redis.ZRangeBy{Min: "-1e15", Max: "+inf"}).Result()
	if err != nil {
		t.Fatal(err)
	}
	return zs
}

// family returns the metric family called name that reg gathers, or nil if it has no
// series.
func family(t *testing.T, reg prometheus.Gatherer, name string) *dto.MetricFamily {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return f
		}
	}
	return nil
}

// labelMap returns m's labels by name.
func labelMap(m *dto.Metric) map[string]string {
	labels := map[string]string{}
	for _, l := range m.GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	return labels
}

// metric returns the series of the family name whose labels are exactly labels, failing t
// if there is none.
func metric(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	if labels == nil {
		labels = map[string]string{}
	}
	for _, m := range family(t, reg, name).GetMetric() {
		if reflect.DeepEqual(labelMap(m), labels) {
			return m
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return nil
}

func histogram(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) *dto.Histogram {
	t.Helper()
	return metric(t, reg, name, labels).GetHistogram()
}

func gauge(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	return metric(t, reg, name, labels).GetGauge().GetValue()
}

func counter(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	return metric(t, reg, name, labels).GetCounter().GetValue()
}

// bucket returns h's cumulative count of observations <= le, failing t if h has no such
// bucket.
func bucket(t *testing.T, h *dto.Histogram, le float64) uint64 {
	t.Helper()
	for _, b := range h.GetBucket() {
		if b.GetUpperBound() == le {
			return b.GetCumulativeCount()
		}
	}
	t.Fatalf("histogram has no bucket le=%g", le)
	return 0
}
