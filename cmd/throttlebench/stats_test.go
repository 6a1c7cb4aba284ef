package main

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// base is the epoch of the tests' instants: at(ms) is base + ms milliseconds.
var base = time.UnixMilli(1_800_000_000_000)

func at(ms ...int64) []time.Time {
	out := make([]time.Time, len(ms))
	for i, m := range ms {
		out[i] = base.Add(time.Duration(m) * time.Millisecond)
	}
	return out
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// TestMaxInWindow pins the measure behind "max window / limit", throttle.MaxInWindow, on
// explicit instants: the window is (t-w, t], exact to the millisecond.
func TestMaxInWindow(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		instants  []time.Time
		window    time.Duration
		wantCount int
	}{
		{name: "None", instants: nil, window: time.Second, wantCount: 0},
		{name: "One", instants: at(5), window: time.Second, wantCount: 1},
		// (t-W, t] excludes t-W: the admission at 0 no longer counts at 1000.
		{name: "BoundaryExcluded", instants: at(0, 500, 999, 1000, 1000, 1999, 2000), window: time.Second, wantCount: 4},
		{name: "OneMsInside", instants: at(1, 500, 999, 1000), window: time.Second, wantCount: 4},
		{name: "SpreadOut", instants: at(0, 1000, 2000, 3000), window: time.Second, wantCount: 1},
		{name: "Burst", instants: at(0, 0, 0, 0, 0), window: time.Millisecond, wantCount: 5},
		{name: "Unsorted", instants: at(1000, 0, 999, 500), window: time.Second, wantCount: 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := throttle.MaxInWindow(tc.instants, tc.window); got != tc.wantCount {
				t.Errorf("MaxInWindow = %d, want %d", got, tc.wantCount)
			}
		})
	}
}

func TestBusySpans(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name               string
		enqueued, admitted []time.Time
		want               []span
	}{
		{name: "OneBacklog", enqueued: at(0, 0, 100), admitted: at(50, 150, 300),
			want: []span{{at(0)[0], at(300)[0]}}},
		{name: "Gap", enqueued: at(0, 500), admitted: at(100, 600),
			want: []span{{at(0)[0], at(100)[0]}, {at(500)[0], at(600)[0]}}},
		// At one instant the enqueue counts first: the backlog does not end and restart.
		{name: "TieEnqueueFirst", enqueued: at(0, 100), admitted: at(100, 200),
			want: []span{{at(0)[0], at(200)[0]}}},
		{name: "NeverDrained", enqueued: at(0, 10, 20), admitted: at(30),
			want: []span{{at(0)[0], at(30)[0]}}},
		{name: "Nothing", want: nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := busySpans(tc.enqueued, tc.admitted); !slices.Equal(got, tc.want) {
				t.Errorf("busySpans = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestUtilization(t *testing.T) {
	t.Parallel()
	limit := throttle.Limit{Events: 5, Window: time.Second}
	every := func(from, to, step int64) []time.Time {
		var ms []int64
		for m := from; m <= to; m += step {
			ms = append(ms, m)
		}
		return at(ms...)
	}
	tests := []struct {
		name       string
		admissions []time.Time
		spans      []span
		want       float64
		wantBusy   float64
		wantOK     bool
	}{
		// 5 per window in bursts: [0, 2000) holds the bursts at 0 and 1000.
		{name: "Bursts", admissions: at(0, 0, 0, 0, 0, 1000, 1000, 1000, 1000, 1000, 2000, 2000, 2000, 2000, 2000),
			spans: []span{{at(0)[0], at(2000)[0]}}, want: 1, wantBusy: 2, wantOK: true},
		{name: "Even", admissions: every(0, 2000, 200),
			spans: []span{{at(0)[0], at(2000)[0]}}, want: 1, wantBusy: 2, wantOK: true},
		{name: "HalfRate", admissions: every(0, 2000, 400),
			spans: []span{{at(0)[0], at(2000)[0]}}, want: 0.5, wantBusy: 2, wantOK: true},
		// Idle time without a backlog does not count against the limiter.
		{name: "TwoSpans", admissions: append(every(0, 1000, 200), every(2000, 3000, 200)...),
			spans: []span{{at(0)[0], at(1000)[0]}, {at(2000)[0], at(3000)[0]}}, want: 1, wantBusy: 2, wantOK: true},
		// The span starts at the first enqueue; the time before the first admission counts.
		{name: "SlowStart", admissions: every(1000, 2000, 200),
			spans: []span{{at(0)[0], at(2000)[0]}}, want: 1, wantBusy: 1, wantOK: true},
		{name: "OneAdmission", admissions: at(0), spans: []span{{at(0)[0], at(0)[0]}}},
		{name: "None"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, busy, ok := utilization(tc.admissions, tc.spans, limit)
			if !near(got, tc.want) || !near(busy, tc.wantBusy) || ok != tc.wantOK {
				t.Errorf("utilization = %v, %vs, %t; want %v, %vs, %t", got, busy, ok, tc.want, tc.wantBusy, tc.wantOK)
			}
		})
	}
}

func TestLateness(t *testing.T) {
	t.Parallel()
	limit := throttle.Limit{Events: 2, Window: time.Second}
	// Earliest instants: 0, 0, 1000, 1000, 2000, 2000.
	got := lateness(at(0, 10, 1000, 1500, 2600, 2600), limit)
	want := []time.Duration{0, 10 * time.Millisecond, 0, 500 * time.Millisecond, 600 * time.Millisecond, 600 * time.Millisecond}
	if !slices.Equal(got, want) {
		t.Errorf("lateness = %v, want %v", got, want)
	}
	// Ahead of the schedule (more than the limit got through) is not negative.
	if got := lateness(at(0, 0, 1, 2), limit); !slices.Equal(got, []time.Duration{0, 0, 0, 0}) {
		t.Errorf("lateness of an over-admitting run = %v, want zeros", got)
	}
}

func TestPercentile(t *testing.T) {
	t.Parallel()
	ds := []time.Duration{5, 1, 4, 2, 3, 6, 7, 8, 9, 10} // unsorted: percentile sorts a copy
	tests := []struct {
		p    float64
		want time.Duration
	}{{0.5, 5}, {0.99, 10}, {0.1, 1}, {0.11, 2}, {1, 10}}
	for _, tc := range tests {
		if got := percentile(ds, tc.p); got != tc.want {
			t.Errorf("percentile(%v) = %v, want %v", tc.p, got, tc.want)
		}
	}
	if got := percentile(nil, 0.5); got != 0 {
		t.Errorf("percentile(nil) = %v, want 0", got)
	}
	if ds[0] != 5 {
		t.Errorf("percentile sorted its input")
	}
}

func TestFairness(t *testing.T) {
	t.Parallel()
	// Every tenant busy from 500 to 1000: counted in [500, 1000).
	adm := [][]time.Time{
		at(0, 500, 600, 700, 999, 1000),  // 4 in the period
		at(500, 550, 990, 1000, 1500),    // 3 (1000 is out)
		at(400, 600, 800, 900, 950, 980), // 5
	}
	busy := []span{{at(0)[0], at(1000)[0]}, {at(500)[0], at(1500)[0]}, {at(400)[0], at(2000)[0]}}
	lo, hi := fairness(adm, busy)
	if !near(lo, 3/4.0) || !near(hi, 5/4.0) { // fair share: 12/3 = 4
		t.Errorf("fairness = %v, %v; want 0.75, 1.25", lo, hi)
	}
	// No common busy period.
	if lo, hi := fairness(adm[:2], []span{{at(0)[0], at(100)[0]}, {at(200)[0], at(300)[0]}}); lo != 0 || hi != 0 {
		t.Errorf("fairness without overlap = %v, %v; want 0, 0", lo, hi)
	}
}

func TestDenialStats(t *testing.T) {
	t.Parallel()
	mean, most, repeat, overTwo := denialStats([]int{0, 1, 1, 3, 4})
	if !near(mean, 1.8) || most != 4 || !near(repeat, 1.0) || overTwo != 2 {
		t.Errorf("denialStats = %v, %d, %v, %d; want 1.8, 4, 1, 2", mean, most, repeat, overTwo)
	}
	if mean, most, repeat, overTwo := denialStats(nil); mean != 0 || most != 0 || repeat != 0 || overTwo != 0 {
		t.Errorf("denialStats(nil) = %v, %d, %v, %d; want zeros", mean, most, repeat, overTwo)
	}
}

func TestSummarize(t *testing.T) {
	t.Parallel()
	ms := func(m int64) int64 { return at(m)[0].UnixMilli() }
	d := runData{
		Limit:    throttle.Limit{Events: 2, Window: time.Second},
		Tenants:  []string{"a", "b"},
		Enqueued: map[string][]time.Time{"a": at(0, 0, 0), "b": at(0, 0, 0)},
		Records: []record{
			// a/0: admitted at once.
			{Tenant: "a", Seq: 0, StartMS: ms(0), Outcome: outcomeRan, AtMS: ms(0)},
			// a/1: waited once in the handler, then ran.
			{Tenant: "a", Seq: 1, StartMS: ms(0), Outcome: outcomeRan, AtMS: ms(400),
				Denials: []denial{{AtMS: ms(0), RetryAfterMS: 400}}},
			// a/2: re-queued to 1000, came back at 1100, waited, ran at 1200.
			{Tenant: "a", Seq: 2, StartMS: ms(0), Outcome: outcomeRequeued, WakeMS: ms(1000),
				Denials: []denial{{AtMS: ms(0), RetryAfterMS: 1000, Reserved: true}}},
			{Tenant: "a", Seq: 2, StartMS: ms(1100), Outcome: outcomeRan, AtMS: ms(1200),
				Denials: []denial{{AtMS: ms(1100), RetryAfterMS: 100, Reserved: true}}},
			// b/0..2: b/2 denied three times, came back early once; b/0 ran twice.
			{Tenant: "b", Seq: 0, StartMS: ms(0), Outcome: outcomeRan, AtMS: ms(0)},
			{Tenant: "b", Seq: 0, StartMS: ms(5), Outcome: outcomeRan, AtMS: ms(1000)},
			{Tenant: "b", Seq: 1, StartMS: ms(0), Outcome: outcomeRan, AtMS: ms(10)},
			{Tenant: "b", Seq: 2, StartMS: ms(0), Outcome: outcomeRequeued, WakeMS: ms(1000), Denials: []denial{{AtMS: ms(0)}}},
			{Tenant: "b", Seq: 2, StartMS: ms(900), Outcome: outcomeRequeued, WakeMS: ms(2000), Denials: []denial{{AtMS: ms(900)}}},
			{Tenant: "b", Seq: 2, StartMS: ms(2500), Outcome: outcomeRequeued, WakeMS: ms(3000), Denials: []denial{{AtMS: ms(2500)}}},
			{Tenant: "b", Seq: 2, StartMS: ms(3000), Outcome: outcomeRan, AtMS: ms(3000)},
		},
	}
	r := summarize(d)
	check := func(name string, got, want float64) {
		t.Helper()
		if !near(got, want) {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	check("Enqueued", float64(r.Enqueued), 6)
	check("Completed", float64(r.Completed), 6)
	check("CompletedTwice", float64(r.CompletedTwice), 1)
	check("Admissions", float64(r.Admissions), 7)
	check("Denials", float64(r.Denials), 4)       // a/2 once, b/2 three times
	check("DenialsMean", r.DenialsMean, 4.0/6)    // over completed tasks
	check("DenialsMax", float64(r.DenialsMax), 3) // b/2
	check("RepeatDenialsMean", r.RepeatDenialsMean, 2.0/6)
	check("DeniedMoreThanTwice", float64(r.DeniedMoreThanTwice), 1)
	check("Waits", float64(r.Waits), 2) // a/1 and a/2's last delivery
	check("WaitsMean", r.WaitsMean, 2.0/6)
	// Tenant b: 0, 10, 1000 and 3000 in (t-1s, t]: at most 2 (0 and 10; 1000 drops 0).
	check("MaxInWindow", float64(r.MaxInWindow), 2)
	check("MaxWindowRatio", r.MaxWindowRatio, 1)
	// Comebacks: a/2 100ms late; b/2 100ms early, 500ms late, on time: -100, 0, 100, 500.
	check("ComebackP50MS", r.ComebackP50MS, 0)
	check("ComebackP99MS", r.ComebackP99MS, 500)
	// Tenant a: 0, 400, 1200: earliest 0, 0, 1000: lateness 0, 400, 200.
	// Tenant b: 0, 10, 1000, 3000: earliest 0, 0, 1000, 1000: lateness 0, 10, 0, 2000.
	check("LatenessP50MS", r.LatenessP50MS, 10)
	check("LatenessMaxMS", r.LatenessMaxMS, 2000)
	// a busy [0, 1200]: 2 admissions in [0, 1200) over 2/s x 1.2s.
	check("a utilization", r.PerTenant[0].Utilization, 2/(2*1.2))
	// b's backlog ends with b/2's admission at 3000 (b/0's rerun is not a first
	// admission): 0, 10 and 1000 in [0, 3000) over 2/s x 3s.
	check("b utilization", r.PerTenant[1].Utilization, 3/(2*3.0))
	check("Utilization", r.Utilization, (2/(2*1.2)+3/(2*3.0))/2)
	// Both busy in [0, 1200): a has 2 admissions, b 3 (0, 10, 1000).
	check("FairnessMin", r.FairnessMin, 2/2.5)
	check("FairnessMax", r.FairnessMax, 3/2.5)
}
