package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Report is the outcome of one demo run, printed as a table or, with -json, as one JSON
// object. Durations are in the unit their name says.
type Report struct {
	Backend        string         `json:"backend"`           // the Redis the run used
	Queue          string         `json:"queue"`             // the asynq queue of the run
	TaskType       string         `json:"task_type"`         // the asynq task type
	APILimit       LimitJSON      `json:"api_limit"`         // what the fake API allows per tenant
	WorkerRule     string         `json:"worker_rule"`       // the worker's rule, THROTTLE_RULES syntax
	WorkerLimit    LimitJSON      `json:"worker_limit"`      // the rule's per-tenant limit
	MarginMS       int64          `json:"margin_ms"`         // worker window minus API window
	JitterMS       int64          `json:"jitter_ms"`         // simulated network latency, up to
	ElapsedSeconds float64        `json:"elapsed_seconds"`   // from the first enqueue to the report
	Stopped        string         `json:"stopped,omitempty"` // why the run ended early, if it did
	Tenants        []TenantReport `json:"tenants"`
	Total          Totals         `json:"total"`
	OK             bool           `json:"ok"`       // exit status 0
	Failures       []string       `json:"failures"` // why not OK; empty when OK
}

// LimitJSON is a throttle.Limit in JSON.
type LimitJSON struct {
	Events   int   `json:"events"`
	WindowMS int64 `json:"window_ms"`
}

func limitJSON(l throttle.Limit) LimitJSON {
	return LimitJSON{Events: l.Events, WindowMS: l.Window.Milliseconds()}
}

// TenantReport is one tenant's line of the report.
type TenantReport struct {
	Tenant    string `json:"tenant"`
	Enqueued  int    `json:"enqueued"`  // tasks enqueued
	Completed int    `json:"completed"` // tasks asynq holds as completed (distinct tasks)
	Throttled int    `json:"throttled"` // denials: times the limiter made a task wait (re-queued, or in its handler)
	Archived  int    `json:"archived"`  // tasks asynq archived
	Pending   int    `json:"pending"`   // tasks still pending, active, scheduled or in retry
	Lost      int    `json:"lost"`      // enqueued - completed - archived - pending
	Admitted  int    `json:"admitted"`  // handler runs (admissions by the limiter)

	APIAccepted int `json:"api_accepted"` // requests the fake API accepted
	API429      int `json:"api_429"`      // requests the fake API answered 429

	// BusySeconds is the time the tenant's quota was in use: first admission to last
	// admission, plus one API window.
	BusySeconds float64 `json:"busy_seconds"`
	// RatePerSecond is Admitted / BusySeconds.
	RatePerSecond float64 `json:"rate_per_second"`
	// RateOfAPILimit is RatePerSecond / (API events per API window): at most 1 when the
	// API's limit holds; with the margin a long run tops out near API window / worker window.
	RateOfAPILimit float64 `json:"rate_of_api_limit"`

	// MaxInWorkerWindow is the most admissions in any (t - worker window, t]: the rule
	// allows WorkerLimit.Events.
	MaxInWorkerWindow int `json:"max_in_worker_window"`
	// MaxInAPIWindow is the most admissions in any (t - API window, t]: the API allows
	// APILimit.Events.
	MaxInAPIWindow int `json:"max_in_api_window"`
	// MaxArrivalsInAPIWindow is the most requests the API accepted in any of its windows.
	MaxArrivalsInAPIWindow int `json:"max_api_arrivals_in_api_window"`
}

// Totals sums the counts of all tenants.
type Totals struct {
	Enqueued    int `json:"enqueued"`
	Completed   int `json:"completed"`
	Throttled   int `json:"throttled"`
	Archived    int `json:"archived"`
	Pending     int `json:"pending"`
	Lost        int `json:"lost"`
	Admitted    int `json:"admitted"`
	APIAccepted int `json:"api_accepted"`
	API429      int `json:"api_429"`
}

// taskStates counts one tenant's distinct tasks by the state asynq holds them in.
type taskStates struct {
	Completed int
	Archived  int
	Pending   int // pending, active, scheduled or retry
}

// runData is what a run observed, the input of buildReport.
type runData struct {
	Backend, Queue, TaskType string
	APILimit, WorkerLimit    throttle.Limit
	Rule                     string
	Jitter                   time.Duration
	Tenants                  []string
	Enqueued                 map[string]int
	Admissions               map[string][]time.Time // limiter decision instants of handler runs
	Throttled                map[string]int
	API                      map[string]apiStats
	States                   map[string]taskStates
	Elapsed                  time.Duration
	Stopped                  string // why the run ended before every task completed, if so
}

// buildReport computes the report of d and decides whether the run passed: every task
// completed, none archived or lost, no window over its limit, no 429.
func buildReport(d runData) Report {
	r := Report{
		Backend:        d.Backend,
		Queue:          d.Queue,
		TaskType:       d.TaskType,
		APILimit:       limitJSON(d.APILimit),
		WorkerRule:     d.Rule,
		WorkerLimit:    limitJSON(d.WorkerLimit),
		MarginMS:       (d.WorkerLimit.Window - d.APILimit.Window).Milliseconds(),
		JitterMS:       d.Jitter.Milliseconds(),
		ElapsedSeconds: round(d.Elapsed.Seconds(), 3),
		Stopped:        d.Stopped,
		Tenants:        []TenantReport{},
		Failures:       []string{},
	}
	if d.Stopped != "" {
		r.Failures = append(r.Failures, d.Stopped)
	}
	apiRate := float64(d.APILimit.Events) / d.APILimit.Window.Seconds()
	for _, name := range d.Tenants {
		adm := slices.Clone(d.Admissions[name])
		slices.SortFunc(adm, time.Time.Compare)
		st, api := d.States[name], d.API[name]
		t := TenantReport{
			Tenant:                 name,
			Enqueued:               d.Enqueued[name],
			Completed:              st.Completed,
			Throttled:              d.Throttled[name],
			Archived:               st.Archived,
			Pending:                st.Pending,
			Lost:                   d.Enqueued[name] - st.Completed - st.Archived - st.Pending,
			Admitted:               len(adm),
			APIAccepted:            len(api.Accepted),
			API429:                 api.Rejected,
			MaxInWorkerWindow:      throttle.MaxInWindow(adm, d.WorkerLimit.Window),
			MaxInAPIWindow:         throttle.MaxInWindow(adm, d.APILimit.Window),
			MaxArrivalsInAPIWindow: throttle.MaxInWindow(api.Accepted, d.APILimit.Window),
		}
		busy, rate := busyRate(adm, d.APILimit.Window)
		t.BusySeconds = round(busy.Seconds(), 3)
		t.RatePerSecond = round(rate, 3)
		t.RateOfAPILimit = round(rate/apiRate, 3)
		r.Tenants = append(r.Tenants, t)
		r.Failures = append(r.Failures, tenantFailures(t, d)...)

		r.Total.Enqueued += t.Enqueued
		r.Total.Completed += t.Completed
		r.Total.Throttled += t.Throttled
		r.Total.Archived += t.Archived
		r.Total.Pending += t.Pending
		r.Total.Lost += t.Lost
		r.Total.Admitted += t.Admitted
		r.Total.APIAccepted += t.APIAccepted
		r.Total.API429 += t.API429
	}
	r.OK = len(r.Failures) == 0
	return r
}

// tenantFailures says what is wrong with t, one reason each.
func tenantFailures(t TenantReport, d runData) []string {
	var f []string
	if t.Completed != t.Enqueued {
		f = append(f, fmt.Sprintf("%s: %d of %d tasks completed", t.Tenant, t.Completed, t.Enqueued))
	}
	if t.Archived > 0 {
		f = append(f, fmt.Sprintf("%s: %d tasks archived", t.Tenant, t.Archived))
	}
	if t.Lost != 0 {
		f = append(f, fmt.Sprintf("%s: %d tasks lost", t.Tenant, t.Lost))
	}
	if t.MaxInWorkerWindow > d.WorkerLimit.Events {
		f = append(f, fmt.Sprintf("%s: %d admissions in one %s window, the rule allows %d",
			t.Tenant, t.MaxInWorkerWindow, d.WorkerLimit.Window, d.WorkerLimit.Events))
	}
	if t.MaxInAPIWindow > d.APILimit.Events {
		f = append(f, fmt.Sprintf("%s: %d admissions in one %s API window, the API allows %d",
			t.Tenant, t.MaxInAPIWindow, d.APILimit.Window, d.APILimit.Events))
	}
	if t.API429 > 0 {
		f = append(f, fmt.Sprintf("%s: the API answered 429 Too Many Requests %d times", t.Tenant, t.API429))
	}
	return f
}

// busyRate returns the busy period of the ascending admission times ts (first to last,
// plus w: the time a quota of window w was in use) and the admissions per second over
// it. Over a busy period so defined, a log that never held more than L events in any
// window w has a rate of at most L/w. No admissions: zero and zero.
func busyRate(ts []time.Time, w time.Duration) (busy time.Duration, perSecond float64) {
	if len(ts) == 0 {
		return 0, 0
	}
	busy = ts[len(ts)-1].Sub(ts[0]) + w
	return busy, float64(len(ts)) / busy.Seconds()
}

func round(x float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	return float64(int64(x*p+0.5)) / p
}

// writeJSON writes r as one indented JSON object and a newline.
func writeJSON(w io.Writer, r Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// writeTable writes r for people: the setup, one line per tenant, the totals, what the
// columns mean, and the verdict.
func writeTable(w io.Writer, r Report) error {
	apiW := time.Duration(r.APILimit.WindowMS) * time.Millisecond
	wrkW := time.Duration(r.WorkerLimit.WindowMS) * time.Millisecond
	var b strings.Builder
	fmt.Fprintf(&b, "asynq-throttle demo on %s, queue %s\n", r.Backend, r.Queue)
	fmt.Fprintf(&b, "  fake API     %d requests per %s per tenant in any sliding window, else 429\n", r.APILimit.Events, apiW)
	fmt.Fprintf(&b, "  worker rule  %s  (API window + %dms margin for network jitter)\n", r.WorkerRule, r.MarginMS)
	if r.JitterMS > 0 {
		fmt.Fprintf(&b, "  jitter       each call waits a random 0-%dms before reaching the API\n", r.JitterMS)
	}
	fmt.Fprintf(&b, "  elapsed      %.1fs\n\n", r.ElapsedSeconds)

	// The tenant column is padded here so that it reads left-aligned in a right-aligned table.
	name := len("tenant")
	for _, t := range r.Tenants {
		name = max(name, len(t.Tenant))
	}
	var tb strings.Builder
	tw := tabwriter.NewWriter(&tb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\tcompleted\tthrottled\tarchived\tpending\tlost\tAPI 429\trate/s\tof API limit\tmax in %s (worker)\tmax in %s (API)\t\n", name, "tenant", wrkW, apiW)
	for _, t := range r.Tenants {
		fmt.Fprintf(tw, "%-*s\t%d/%d\t%d\t%d\t%d\t%d\t%d\t%.2f\t%.0f%%\t%d/%d\t%d/%d\t\n",
			name, t.Tenant, t.Completed, t.Enqueued, t.Throttled, t.Archived, t.Pending, t.Lost, t.API429,
			t.RatePerSecond, 100*t.RateOfAPILimit,
			t.MaxInWorkerWindow, r.WorkerLimit.Events, t.MaxInAPIWindow, r.APILimit.Events)
	}
	tt := r.Total
	fmt.Fprintf(tw, "%-*s\t%d/%d\t%d\t%d\t%d\t%d\t%d\t\t\t\t\t\n",
		name, "total", tt.Completed, tt.Enqueued, tt.Throttled, tt.Archived, tt.Pending, tt.Lost, tt.API429)
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, line := range strings.Split(strings.TrimSuffix(tb.String(), "\n"), "\n") {
		b.WriteString(strings.TrimRight(line, " ") + "\n")
	}

	fmt.Fprintf(&b, "\n  throttled     denials by the limiter: the task waited for a slot, in its handler or re-queued (no retry spent, no failure)\n")
	fmt.Fprintf(&b, "  rate/s        admissions per second over the tenant's busy period (first to last admission + %s)\n", apiW)
	fmt.Fprintf(&b, "  of API limit  rate/s divided by %d/%s; with the margin a long run tops out near %.0f%%\n", r.APILimit.Events, apiW, 100*apiW.Seconds()/wrkW.Seconds())
	fmt.Fprintf(&b, "  max in ...    most admissions (limiter decision instants) in any window (t-W, t], against the limit\n")
	fmt.Fprintf(&b, "  lost          enqueued - completed - archived - pending\n\n")
	if r.OK {
		fmt.Fprintf(&b, "OK: every task completed, none archived or lost, no window over its limit, no 429\n")
	} else {
		fmt.Fprintf(&b, "FAIL: %s\n", strings.Join(r.Failures, "; "))
	}
	_, err := io.WriteString(w, b.String())
	return err
}
