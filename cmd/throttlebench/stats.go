package main

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// runData is what one strategy's run observed: the input of summarize.
type runData struct {
	Limit    throttle.Limit
	Tenants  []string
	Enqueued map[string][]time.Time // per tenant, the instant each task was enqueued, by seq
	Records  []record               // every delivery of every task, from every worker
}

// result is one strategy's column of the report. Counts are tasks unless named
// otherwise; a task is a (tenant, seq) pair, whatever asynq IDs it had.
type result struct {
	// Utilization is the mean over tenants of the admitted rate over the tenant's busy
	// period, divided by limit/window (see utilization).
	Utilization    float64 `json:"utilization"`
	UtilizationMin float64 `json:"utilization_min"`
	// MaxInWindow is the most admissions of one tenant in any window (t-window, t];
	// MaxWindowRatio is that over the limit.
	MaxInWindow    int     `json:"max_in_window"`
	MaxWindowRatio float64 `json:"max_window_over_limit"`

	// Denials are deliveries that returned the task to asynq to come back later.
	DenialsMean float64 `json:"denials_per_task_mean"`
	DenialsMax  int     `json:"denials_per_task_max"`
	// Repeat denials are a task's denials after its first.
	RepeatDenialsMean   float64 `json:"repeat_denials_per_task_mean"`
	DeniedMoreThanTwice int     `json:"tasks_denied_more_than_twice"`
	// Waits are denials waited out inside the handler, then decided again.
	WaitsMean float64 `json:"waits_per_task_mean"`
	Denials   int     `json:"denials"`
	Waits     int     `json:"waits"`

	// Lateness is how long after its earliest possible instant each admission came (see
	// lateness), in ms.
	LatenessP50MS float64 `json:"lateness_p50_ms"`
	LatenessP99MS float64 `json:"lateness_p99_ms"`
	LatenessMaxMS float64 `json:"lateness_max_ms"`
	// Comeback is, for a re-queued delivery followed by another, the next delivery's start
	// minus the instant the task asked to come back, in ms (negative: early).
	ComebackP50MS float64 `json:"comeback_p50_ms"`
	ComebackP99MS float64 `json:"comeback_p99_ms"`

	// Fairness is each tenant's share of the admissions while every tenant was busy,
	// divided by 1/tenants: the smallest and the largest.
	FairnessMin float64 `json:"fairness_min"`
	FairnessMax float64 `json:"fairness_max"`

	Admissions     int    `json:"admissions"` // handler runs
	Enqueued       int    `json:"enqueued"`
	Completed      int    `json:"completed"`           // tasks that ran at least once
	CompletedTwice int    `json:"completed_twice"`     // tasks that ran more than once
	Archived       int    `json:"archived"`            // from asynq's Inspector
	Lost           int    `json:"lost"`                // enqueued - completed - archived
	Errors         int    `json:"errors,omitempty"`    // deliveries that failed otherwise
	Undrained      int    `json:"undrained,omitempty"` // tasks still queued at the drain timeout
	DrainNote      string `json:"drain_note,omitempty"`

	// RedisCommands is INFO total_commands_processed over the run: asynq's own commands
	// (enqueue, dequeue, retry, forwarder, heartbeats, polling), the throttle's and the
	// harness's few.
	RedisCommands        int64   `json:"redis_commands"`
	RedisCommandsPerTask float64 `json:"redis_commands_per_task"`
	// RedisCPUPerTaskUS is Redis's user+sys CPU over the run per completed task, in µs.
	RedisCPUPerTaskUS float64 `json:"redis_cpu_per_task_us"`
	// RoundTrips are the requests clients sent to Redis (a pipeline is one), counted by
	// go-redis hooks; per completed task for the limiter, and for asynq and the harness.
	RoundTrips                calls   `json:"round_trips"`
	ThrottleRoundTripsPerTask float64 `json:"throttle_round_trips_per_task"`
	AsynqRoundTripsPerTask    float64 `json:"asynq_round_trips_per_task"`

	WallSeconds float64        `json:"wall_seconds"` // from the first enqueue to the workers' exit
	PerTenant   []tenantResult `json:"tenants"`
}

// tenantResult is one tenant's part of a result.
type tenantResult struct {
	Tenant      string  `json:"tenant"`
	Enqueued    int     `json:"enqueued"`
	Completed   int     `json:"completed"`
	Admissions  int     `json:"admissions"`
	Utilization float64 `json:"utilization"`
	BusySeconds float64 `json:"busy_seconds"`
	MaxInWindow int     `json:"max_in_window"`
}

// span is the interval [From, To].
type span struct{ From, To time.Time }

// taskID names a task across its deliveries and copies.
type taskID struct {
	Tenant string
	Seq    int
}

// summarize computes a result from a run's records. Archived, Lost, Redis and wall
// figures are left for the caller, who has them from elsewhere.
func summarize(d runData) result {
	var r result
	admissions := map[string][]time.Time{} // per tenant, every handler run
	first := map[taskID]time.Time{}        // each task's first admission
	runs := map[taskID]int{}
	denials := map[taskID]int{}
	waits := map[taskID]int{}
	deliveries := map[taskID][]record{}
	for _, rec := range d.Records {
		id := taskID{rec.Tenant, rec.Seq}
		deliveries[id] = append(deliveries[id], rec)
		waits[id] += rec.waits()
		switch rec.Outcome {
		case outcomeRan:
			at := msTime(rec.AtMS)
			admissions[rec.Tenant] = append(admissions[rec.Tenant], at)
			if f, ok := first[id]; !ok || at.Before(f) {
				first[id] = at
			}
			runs[id]++
		case outcomeRequeued:
			denials[id]++
		default:
			r.Errors++
		}
	}

	// Denials and waits of completed tasks.
	var perTask []int
	for id, n := range runs {
		r.Completed++
		if n > 1 {
			r.CompletedTwice++
		}
		r.Admissions += n
		perTask = append(perTask, denials[id])
		r.Waits += waits[id]
	}
	r.DenialsMean, r.DenialsMax, r.RepeatDenialsMean, r.DeniedMoreThanTwice = denialStats(perTask)
	for _, n := range perTask {
		r.Denials += n
	}
	if r.Completed > 0 {
		r.WaitsMean = float64(r.Waits) / float64(r.Completed)
	}

	// Per tenant: busy spans, utilization, busiest window, lateness.
	var late []time.Duration
	var busy []span // per tenant, from its first busy admission to its last
	var utils []float64
	for _, t := range d.Tenants {
		adm := admissions[t]
		slices.SortFunc(adm, time.Time.Compare)
		var firsts []time.Time
		for id, at := range first {
			if id.Tenant == t {
				firsts = append(firsts, at)
			}
		}
		slices.SortFunc(firsts, time.Time.Compare)
		tr := tenantResult{Tenant: t, Enqueued: len(d.Enqueued[t]), Completed: len(firsts), Admissions: len(adm)}
		r.Enqueued += tr.Enqueued
		tr.MaxInWindow = throttle.MaxInWindow(adm, d.Limit.Window)
		r.MaxInWindow = max(r.MaxInWindow, tr.MaxInWindow)
		spans := busySpans(d.Enqueued[t], firsts)
		if u, secs, ok := utilization(adm, spans, d.Limit); ok {
			tr.Utilization, tr.BusySeconds = u, secs
			utils = append(utils, u)
		}
		if clipped := clip(spans, adm); len(clipped) > 0 {
			busy = append(busy, span{clipped[0].From, clipped[len(clipped)-1].To})
		}
		late = append(late, lateness(adm, d.Limit)...)
		r.PerTenant = append(r.PerTenant, tr)
	}
	r.MaxWindowRatio = float64(r.MaxInWindow) / float64(d.Limit.Events)
	if len(utils) > 0 {
		r.UtilizationMin = slices.Min(utils)
		for _, u := range utils {
			r.Utilization += u / float64(len(utils))
		}
	}
	r.LatenessP50MS = ms(percentile(late, 0.50))
	r.LatenessP99MS = ms(percentile(late, 0.99))
	r.LatenessMaxMS = ms(percentile(late, 1))
	if len(busy) == len(d.Tenants) {
		var per [][]time.Time
		for _, t := range d.Tenants {
			per = append(per, admissions[t])
		}
		r.FairnessMin, r.FairnessMax = fairness(per, busy)
	}

	// Comebacks: each re-queued delivery against the next delivery of the same task.
	var comebacks []time.Duration
	for _, recs := range deliveries {
		slices.SortFunc(recs, func(a, b record) int { return cmp.Compare(a.StartMS, b.StartMS) })
		for i, rec := range recs[:len(recs)-1] {
			if rec.requeued() {
				comebacks = append(comebacks, time.Duration(recs[i+1].StartMS-rec.WakeMS)*time.Millisecond)
			}
		}
	}
	r.ComebackP50MS = ms(percentile(comebacks, 0.50))
	r.ComebackP99MS = ms(percentile(comebacks, 0.99))
	return r
}

// busySpans returns the spans during which a tenant had a backlog: more tasks enqueued
// than admitted. enqueued holds the enqueue instants (taken before each enqueue call, so
// never after the task's admission) and admitted each task's first admission, both
// sorted. At equal instants enqueues count first. A span still open after the last
// event ends at the last event.
func busySpans(enqueued, admitted []time.Time) []span {
	var spans []span
	waiting, i, j := 0, 0, 0
	var from time.Time
	for i < len(enqueued) || j < len(admitted) {
		var at time.Time
		if j == len(admitted) || (i < len(enqueued) && !enqueued[i].After(admitted[j])) {
			at = enqueued[i]
			i++
			if waiting == 0 {
				from = at
			}
			waiting++
			continue
		}
		at = admitted[j]
		j++
		if waiting == 0 {
			continue // an admission without a recorded enqueue: no backlog to end
		}
		waiting--
		if waiting == 0 {
			spans = append(spans, span{from, at})
		}
	}
	if waiting > 0 {
		last := enqueued[len(enqueued)-1]
		if len(admitted) > 0 && admitted[len(admitted)-1].After(last) {
			last = admitted[len(admitted)-1]
		}
		spans = append(spans, span{from, last})
	}
	return spans
}

// clip returns spans cut to [first, last] of the sorted admissions, dropping empty ones:
// a backlog counts from the first admission (before it nothing had started) to the last.
func clip(spans []span, admissions []time.Time) []span {
	if len(admissions) == 0 {
		return nil
	}
	first, last := admissions[0], admissions[len(admissions)-1]
	var out []span
	for _, s := range spans {
		if s.From.Before(first) {
			s.From = first
		}
		if s.To.After(last) {
			s.To = last
		}
		if s.To.After(s.From) {
			out = append(out, s)
		}
	}
	return out
}

// utilization returns the admitted rate during the busy spans (clipped to the first and
// last admission) over the limit's rate, and the busy time in seconds: admissions in
// [From, To) of each span, divided by limit.Events/limit.Window times the spans' total
// length. The half-open span counts a steady rate exactly, whether admissions come
// evenly or in bursts of limit.Events per window. ok is false without busy time.
// admissions must be sorted.
func utilization(admissions []time.Time, spans []span, limit throttle.Limit) (u, busySeconds float64, ok bool) {
	var busy time.Duration
	n := 0
	for _, s := range clip(spans, admissions) {
		busy += s.To.Sub(s.From)
		lo, _ := slices.BinarySearchFunc(admissions, s.From, time.Time.Compare)
		hi, _ := slices.BinarySearchFunc(admissions, s.To, time.Time.Compare)
		n += hi - lo
	}
	if busy <= 0 {
		return 0, 0, false
	}
	rate := float64(limit.Events) / limit.Window.Seconds()
	return float64(n) / (rate * busy.Seconds()), busy.Seconds(), true
}

// lateness returns, for each of the sorted admissions, how long after its earliest
// possible instant it came: the k-th (from 0) could come no earlier than
// first + floor(k/limit.Events)*limit.Window. Earlier counts as 0.
func lateness(admissions []time.Time, limit throttle.Limit) []time.Duration {
	out := make([]time.Duration, len(admissions))
	for k, at := range admissions {
		earliest := admissions[0].Add(time.Duration(k/limit.Events) * limit.Window)
		out[k] = max(at.Sub(earliest), 0)
	}
	return out
}

// percentile returns the p-quantile (0 < p <= 1) of ds by nearest rank, 0 for none.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(p*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// fairness returns the smallest and largest share of admissions of one tenant, as a
// multiple of the fair share 1/len(admissions), counted in [From, To) of the period
// every tenant was busy: from the latest start of busy[i] to the earliest end. It
// returns 0, 0 if that period is empty or holds no admission. admissions[i] must be
// sorted.
func fairness(admissions [][]time.Time, busy []span) (lo, hi float64) {
	from, to := busy[0].From, busy[0].To
	for _, b := range busy[1:] {
		if b.From.After(from) {
			from = b.From
		}
		if b.To.Before(to) {
			to = b.To
		}
	}
	if !to.After(from) {
		return 0, 0
	}
	counts := make([]int, len(admissions))
	total := 0
	for i, adm := range admissions {
		a, _ := slices.BinarySearchFunc(adm, from, time.Time.Compare)
		b, _ := slices.BinarySearchFunc(adm, to, time.Time.Compare)
		counts[i] = b - a
		total += counts[i]
	}
	if total == 0 {
		return 0, 0
	}
	fair := float64(total) / float64(len(admissions))
	return float64(slices.Min(counts)) / fair, float64(slices.Max(counts)) / fair
}

// denialStats returns, over tasks with the given denial counts: the mean and the largest
// count, the mean of the repeat denials (those after a task's first), and how many tasks
// were denied more than twice.
func denialStats(perTask []int) (mean float64, most int, repeatMean float64, overTwo int) {
	if len(perTask) == 0 {
		return 0, 0, 0, 0
	}
	var sum, repeats int
	for _, n := range perTask {
		sum += n
		repeats += max(n-1, 0)
		most = max(most, n)
		if n > 2 {
			overTwo++
		}
	}
	return float64(sum) / float64(len(perTask)), most, float64(repeats) / float64(len(perTask)), overTwo
}

// ms returns d in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
