package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// times returns at(ms) for each of ms.
func times(ms ...int64) []time.Time {
	out := make([]time.Time, len(ms))
	for i, m := range ms {
		out[i] = at(m)
	}
	return out
}

func TestBusyRate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		ts       []time.Time
		w        time.Duration
		wantBusy time.Duration
		wantRate float64
	}{
		{"Empty", nil, time.Second, 0, 0},
		{"One", times(5000), time.Second, time.Second, 1},
		{"Three", times(0, 500, 1000), time.Second, 2 * time.Second, 1.5},
		// 10 per 1s exactly at the limit, 3 windows: 30 in 2s + 1s = 10/s, 100% of it.
		{"AtLimit", append(append(times(0, 0, 0, 0, 0, 0, 0, 0, 0, 0), times(1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000)...),
			times(2000, 2000, 2000, 2000, 2000, 2000, 2000, 2000, 2000, 2000)...), time.Second, 3 * time.Second, 10},
	}
	for _, tc := range tests {
		busy, rate := busyRate(tc.ts, tc.w)
		if busy != tc.wantBusy || rate != tc.wantRate {
			t.Errorf("%s: busyRate = %s, %v; want %s, %v", tc.name, busy, rate, tc.wantBusy, tc.wantRate)
		}
	}
}

// sampleRun is a run of two tenants against an API of 2/1s with a 2/1.1s rule: acme went
// fine, globex did not.
func sampleRun() runData {
	return runData{
		Backend:     "test",
		Queue:       "q",
		TaskType:    taskType,
		APILimit:    throttle.Limit{Events: 2, Window: time.Second},
		WorkerLimit: throttle.Limit{Events: 2, Window: 1100 * time.Millisecond},
		Rule:        "demo:call tenant=2/1.1s",
		Tenants:     []string{"acme", "globex"},
		Enqueued:    map[string]int{"acme": 4, "globex": 4},
		Admissions: map[string][]time.Time{
			"acme":   times(2200, 0, 1100, 50, 1150), // unsorted on purpose
			"globex": times(0, 10, 990, 1060),        // 3 in (-10ms, 990ms], 4 in (-40ms, 1060ms]
		},
		Throttled: map[string]int{"acme": 3, "globex": 1},
		API: map[string]apiStats{
			"acme":   {Accepted: times(1, 51, 1101, 1151, 2201)},
			"globex": {Accepted: times(1, 11, 1061), Rejected: 1},
		},
		States: map[string]taskStates{
			"acme":   {Completed: 4},
			"globex": {Completed: 2, Archived: 1},
		},
		Elapsed: 2500 * time.Millisecond,
	}
}

func TestBuildReport(t *testing.T) {
	t.Parallel()
	r := buildReport(sampleRun())
	wantAcme := TenantReport{
		Tenant: "acme", Enqueued: 4, Completed: 4, Throttled: 3, Admitted: 5,
		APIAccepted: 5,
		BusySeconds: 3.2, RatePerSecond: 1.563, RateOfAPILimit: 0.781, // 5 / (2.2s + 1s)
		MaxInWorkerWindow: 2, MaxInAPIWindow: 2, MaxArrivalsInAPIWindow: 2,
	}
	wantGlobex := TenantReport{
		Tenant: "globex", Enqueued: 4, Completed: 2, Throttled: 1, Archived: 1, Lost: 1, Admitted: 4,
		APIAccepted: 3, API429: 1,
		BusySeconds: 2.06, RatePerSecond: 1.942, RateOfAPILimit: 0.971, // 4 / (1.06s + 1s)
		MaxInWorkerWindow: 4, MaxInAPIWindow: 3, MaxArrivalsInAPIWindow: 2,
	}
	if !reflect.DeepEqual(r.Tenants, []TenantReport{wantAcme, wantGlobex}) {
		t.Errorf("tenants =\n%+v\nwant\n%+v", r.Tenants, []TenantReport{wantAcme, wantGlobex})
	}
	wantTotal := Totals{Enqueued: 8, Completed: 6, Throttled: 4, Archived: 1, Lost: 1, Admitted: 9, APIAccepted: 8, API429: 1}
	if r.Total != wantTotal {
		t.Errorf("total = %+v, want %+v", r.Total, wantTotal)
	}
	wantFailures := []string{
		"globex: 2 of 4 tasks completed",
		"globex: 1 tasks archived",
		"globex: 1 tasks lost",
		"globex: 4 admissions in one 1.1s window, the rule allows 2",
		"globex: 3 admissions in one 1s API window, the API allows 2",
		"globex: the API answered 429 Too Many Requests 1 times",
	}
	if r.OK || !reflect.DeepEqual(r.Failures, wantFailures) {
		t.Errorf("OK = %v, failures =\n%q\nwant\n%q", r.OK, r.Failures, wantFailures)
	}
	if r.MarginMS != 100 || r.ElapsedSeconds != 2.5 || r.WorkerLimit != (LimitJSON{Events: 2, WindowMS: 1100}) {
		t.Errorf("report header = %+v", r)
	}
}

func TestBuildReport_ok(t *testing.T) {
	t.Parallel()
	d := sampleRun()
	d.Tenants = []string{"acme"}
	r := buildReport(d)
	if !r.OK || len(r.Failures) != 0 {
		t.Errorf("OK = %v, failures %q; want OK", r.OK, r.Failures)
	}
	d.Stopped = "timed out after 2m0s with 4 of 4 tasks completed"
	if r := buildReport(d); r.OK || r.Failures[0] != d.Stopped {
		t.Errorf("stopped run: OK = %v, failures %q", r.OK, r.Failures)
	}
}

func TestWriteJSON(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	if err := writeJSON(&buf, buildReport(sampleRun())); err != nil {
		t.Fatal(err)
	}
	checkJSONShape(t, buf.Bytes())
}

// checkJSONShape checks that out is one JSON object and nothing else, with every field of
// the report, and returns it decoded.
func checkJSONShape(t *testing.T, out []byte) Report {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(out))
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("output is not a JSON object: %v\n%s", err, out)
	}
	if dec.More() {
		t.Fatalf("output has more than one JSON value:\n%s", out)
	}
	for _, k := range []string{"backend", "queue", "task_type", "api_limit", "worker_rule", "worker_limit",
		"margin_ms", "jitter_ms", "elapsed_seconds", "tenants", "total", "ok", "failures"} {
		if _, ok := m[k]; !ok {
			t.Errorf("JSON report has no %q", k)
		}
	}
	tenants, _ := m["tenants"].([]any)
	if len(tenants) == 0 {
		t.Fatalf("JSON report has no tenants:\n%s", out)
	}
	for _, k := range []string{"tenant", "enqueued", "completed", "throttled", "archived", "pending", "lost",
		"admitted", "api_accepted", "api_429", "busy_seconds", "rate_per_second", "rate_of_api_limit",
		"max_in_worker_window", "max_in_api_window", "max_api_arrivals_in_api_window"} {
		if _, ok := tenants[0].(map[string]any)[k]; !ok {
			t.Errorf("JSON tenant has no %q", k)
		}
	}
	var r Report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func TestWriteTable(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	if err := writeTable(&buf, buildReport(sampleRun())); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{
		"worker rule  demo:call tenant=2/1.1s  (API window + 100ms margin for network jitter)",
		"tenant  completed  throttled  archived  pending  lost  API 429  rate/s  of API limit  max in 1.1s (worker)  max in 1s (API)\n",
		"acme          4/4          3         0        0     0        0    1.56           78%                   2/2              2/2\n",
		"globex        2/4          1         1        0     1        1    1.94           97%                   4/2              3/2\n",
		"total         6/8          4         1        0     1        1\n",
		"FAIL: globex: 2 of 4 tasks completed; ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}
