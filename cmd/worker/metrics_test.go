package main

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// metricsURL matches the startup line that says where the metrics are served.
var metricsURL = regexp.MustCompile(`metrics at (http://\S+/metrics)\n`)

// TestRun_metrics runs the worker with METRICS_ADDR on a free port, the tenant label on
// and capped at 2 tenants, and "api:call tenant=1/1m": two tasks each for acme, then
// globex, then initech (each pair once the previous one was decided). Each tenant gets
// one task admitted and one denied, holding a reservation up to 1m ahead. A scrape over
// HTTP, parsed by expfmt, counts exactly that, with initech, the third tenant, as "other".
func TestRun_metrics(t *testing.T) {
	redisSrv := redistest.StartServer(t)
	clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "THROTTLE_RULES", "api:call tenant=1/1m",
		"METRICS_ADDR", "127.0.0.1:0", "METRICS_TENANT_LABEL", "true", "METRICS_MAX_TENANTS", "2")
	rdb := redisSrv.Client()

	w := startWorker(t)
	ctx, stdout, stderr := context.Background(), &w.stdout, &w.stderr
	url := w.metricsURL(t)

	client := asynq.NewClientFromRedisClient(rdb)
	decided := func(fams map[string]*dto.MetricFamily) (n float64) {
		for _, m := range fams["asynq_throttle_decisions_total"].GetMetric() {
			n += m.GetCounter().GetValue()
		}
		return n
	}
	for i, tenant := range []string{"acme", "globex", "initech"} {
		for range 2 {
			if _, err := producer.Enqueue(ctx, client, "api:call", nil, tenant); err != nil {
				t.Fatal(err)
			}
		}
		want := float64(2 * (i + 1))
		waitFor(t, 10*time.Second, fmt.Sprintf("%g tasks decided", want), func() bool { return decided(scrape(t, url)) == want })
	}
	fams := scrape(t, url)

	type series struct{ labels, value string }
	values := func(name string) []series {
		var out []series
		for _, m := range fams[name].GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			var v string
			switch {
			case m.Counter != nil:
				v = fmt.Sprint(m.GetCounter().GetValue())
			case m.Gauge != nil:
				v = fmt.Sprint(m.GetGauge().GetValue())
			case m.Histogram != nil: // the count, then the cumulative counts up to 30s and to 300s (see deniedBuckets)
				h := m.GetHistogram()
				v = fmt.Sprint(h.GetSampleCount())
				for _, b := range h.GetBucket() {
					if b.GetUpperBound() <= 30 || b.GetUpperBound() == 300 {
						v += fmt.Sprintf(" le%g:%d", b.GetUpperBound(), b.GetCumulativeCount())
					}
				}
			}
			out = append(out, series{strings.Join(labels, ","), v})
		}
		sort.Slice(out, func(i, j int) bool { return out[i].labels < out[j].labels })
		return out
	}
	// 3 denials, each given a delay of about 60s: from its call to the slot of its
	// tenant's admitted task plus the 1m window. A few ms over 60s when the denied call
	// read the clock before the admitted one but reached Redis after it (it is decided at
	// the log's latest instant, and the delay counts from its own clock), so only the
	// buckets up to 30s and from 300s are exact.
	const deniedBuckets = " le0.005:0 le0.01:0 le0.025:0 le0.05:0 le0.1:0 le0.25:0 le0.5:0 le1:0 le2.5:0 le5:0 le10:0 le30:0 le300:3"
	tests := []struct {
		name string
		want []series
	}{
		{"asynq_throttle_decisions_total", []series{
			{"outcome=admitted,task_type=api:call,tenant=acme", "1"},
			{"outcome=admitted,task_type=api:call,tenant=globex", "1"},
			{"outcome=admitted,task_type=api:call,tenant=other", "1"},
			{"outcome=denied,task_type=api:call,tenant=acme", "1"},
			{"outcome=denied,task_type=api:call,tenant=globex", "1"},
			{"outcome=denied,task_type=api:call,tenant=other", "1"},
		}},
		{"asynq_throttle_delay_seconds", []series{{"outcome=denied,task_type=api:call", "3" + deniedBuckets}}},
		{"asynq_throttle_reservations_held", []series{{"task_type=api:call", "3"}}},
		{"asynq_throttle_tasks_waiting", []series{{"task_type=api:call", "0"}}},
		{"asynq_throttle_redis_errors_total", []series{
			{"call=allow,task_type=api:call", "0"},
			{"call=cancel,task_type=api:call", "0"},
			{"call=pause,task_type=api:call", "0"},
			{"call=reservations,task_type=api:call", "0"},
		}},
		{"asynq_throttle_pauses_active", []series{{"", "0"}}},
		// The read of the overrides at start (none stored) is a good reload.
		{"asynq_throttle_override_reloads_total", []series{{"result=error", "0"}, {"result=ok", "1"}}},
		{"asynq_throttle_eviction_policy_unsafe", []series{{"", "0"}}}, // redistest's servers run noeviction
		{"asynq_throttle_clock_skew_fallbacks_total", nil},
	}
	for _, tc := range tests {
		if got := values(tc.name); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.name, got, tc.want)
		}
	}
	// One limiter call per task, each timed; the histogram's buckets are the time.
	if got := values("asynq_throttle_script_duration_seconds"); len(got) != 1 || got[0].labels != "call=allow,task_type=api:call" ||
		!strings.HasPrefix(got[0].value, "6 ") {
		t.Errorf("asynq_throttle_script_duration_seconds: got %v, want one series call=allow,task_type=api:call with 6 calls", got)
	}
	for _, name := range []string{"asynq_throttle_clock_skew_seconds", "go_goroutines", "process_cpu_seconds_total"} {
		if fams[name] == nil {
			t.Errorf("no %s", name)
		}
	}

	w.stop(t, 15*time.Second)
	if stderr.String() != "" {
		t.Errorf("stderr: %s", stderr.String())
	}
	if t.Failed() {
		t.Logf("stdout:\n%s", stdout.String())
	}
}

// TestRun_overrideReloadsMetric: asynq_throttle_override_reloads_total counts the worker's
// reloads of the overrides by result: 1 ok at start (nothing stored), 2 once a tier is
// set (as cmd/throttle sets it), and 1 error once someone writes a field that does not
// parse, which the worker then keeps out of force (no second error until the next change).
func TestRun_overrideReloadsMetric(t *testing.T) {
	redisSrv := redistest.StartServer(t)
	clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "METRICS_ADDR", "127.0.0.1:0")
	rdb := redisSrv.Client()
	w := startWorker(t)
	ctx, stderr := context.Background(), &w.stderr
	url := w.metricsURL(t)
	reloads := func() (ok, bad float64) {
		for _, m := range scrape(t, url)["asynq_throttle_override_reloads_total"].GetMetric() {
			switch m.GetLabel()[0].GetValue() {
			case worker.ReloadOK:
				ok = m.GetCounter().GetValue()
			case worker.ReloadError:
				bad = m.GetCounter().GetValue()
			}
		}
		return ok, bad
	}
	if ok, bad := reloads(); ok != 1 || bad != 0 {
		t.Errorf("at start: ok=%g error=%g, want 1 and 0", ok, bad)
	}
	store, err := worker.NewOverrideStore(rdb, "throttle")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Set(ctx, worker.OverrideTier, "pro", "tenant=50/1s"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the tier put in force", func() bool { ok, _ := reloads(); return ok == 2 })
	// By hand, as Set would never store it: a tier that does not parse, and a new version.
	if err := rdb.HSet(ctx, store.Key(), "tier:broken", "tenant=five/1s").Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HIncrBy(ctx, store.Key(), "version", 1).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the broken set counted", func() bool { _, bad := reloads(); return bad == 1 })
	time.Sleep(2 * worker.DefaultOverrideInterval) // two more checks: the same version, nothing counted
	if ok, bad := reloads(); ok != 2 || bad != 1 {
		t.Errorf("after the broken set: ok=%g error=%g, want 2 and 1", ok, bad)
	}
	w.stop(t, 15*time.Second)
	if want := "throttle: cannot read the overrides; the set read last stays in force until they can be read (logged once)"; strings.Count(stderr.String(), want) != 1 {
		t.Errorf("stderr should hold one warning %q:\n%s", want, stderr.String())
	}
}

// scrape GETs url and parses the Prometheus text format with expfmt.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return fams
}

// waitFor polls cond every 20ms until it holds, failing t after timeout.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %s waiting until %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
