package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// scenarioJSON is the scenario in the JSON report. Durations are in the unit their name
// says.
type scenarioJSON struct {
	Rule                string   `json:"rule"`
	Limit               int      `json:"limit"`
	WindowMS            int64    `json:"window_ms"`
	Tenants             int      `json:"tenants"`
	Workers             int      `json:"workers"`
	Concurrency         int      `json:"concurrency"`
	Backlog             int      `json:"backlog_windows"`
	WaitingPerTenant    int      `json:"waiting_per_tenant"`
	DurationSeconds     float64  `json:"duration_seconds"`
	DrainTimeoutSeconds float64  `json:"drain_timeout_seconds"`
	WorkMS              float64  `json:"work_ms"`
	ForwarderMS         float64  `json:"forwarder_ms"`
	TaskCheckIntervalMS float64  `json:"task_check_interval_ms"`
	RetryInMS           float64  `json:"retry_in_ms"`
	Strategies          []string `json:"strategies"`
	Redis               string   `json:"redis"`
}

func (s scenario) json() scenarioJSON {
	redis := "own redis-server on loopback"
	if s.RedisAddr != "" {
		redis = s.RedisAddr
	}
	return scenarioJSON{
		Rule:                s.rule(),
		Limit:               s.Limit.Events,
		WindowMS:            s.Limit.Window.Milliseconds(),
		Tenants:             s.Tenants,
		Workers:             s.Workers,
		Concurrency:         s.Concurrency,
		Backlog:             s.Backlog,
		WaitingPerTenant:    s.waiting(),
		DurationSeconds:     s.Duration.Seconds(),
		DrainTimeoutSeconds: s.DrainTimeout.Seconds(),
		WorkMS:              ms(s.Work),
		ForwarderMS:         ms(s.Forwarder),
		TaskCheckIntervalMS: ms(taskCheckInterval),
		RetryInMS:           ms(s.RetryIn),
		Strategies:          s.Strategies,
		Redis:               redis,
	}
}

// writeJSON prints rep as one JSON object: {"scenario": {...}, "results": {strategy: {...}}}.
func writeJSON(w io.Writer, rep report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		Scenario scenarioJSON      `json:"scenario"`
		Results  map[string]result `json:"results"`
	}{rep.Scenario.json(), rep.Results})
}

// describe is the scenario in one paragraph, the head of the table.
func (s scenario) describe() string {
	return fmt.Sprintf("scenario: rule %q, %d tenants, %d worker processes x concurrency %d,\n"+
		"  %d tasks waiting per tenant (%d windows) kept topped up for %s, then drained (cap %s);\n"+
		"  handler %s, asynq forwarder (DelayedTaskCheckInterval) %s, TaskCheckInterval %s, x/time/rate RetryIn %s",
		s.rule(), s.Tenants, s.Workers, s.Concurrency, s.waiting(), s.Backlog, s.Duration, s.DrainTimeout,
		s.Work, s.Forwarder, taskCheckInterval, s.RetryIn)
}

// writeTable prints the scenario, one column per strategy, and a legend.
func writeTable(w io.Writer, rep report) error {
	sc := rep.Scenario
	var b strings.Builder
	b.WriteString(sc.describe() + "\n\n")
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(r result) string) {
		fmt.Fprintf(tw, "%s\t", name)
		for _, s := range sc.Strategies {
			fmt.Fprintf(tw, "%s\t", cell(rep.Results[s]))
		}
		fmt.Fprintln(tw)
	}
	f2 := func(v float64) string { return fmt.Sprintf("%.2f", v) }
	msCell := func(v float64) string {
		return (time.Duration(v * float64(time.Millisecond))).Round(time.Millisecond).String()
	}

	fmt.Fprintf(tw, "\t")
	for _, s := range sc.Strategies {
		fmt.Fprintf(tw, "%s\t", s)
	}
	fmt.Fprintln(tw)
	row("utilization (mean over tenants)", func(r result) string { return f2(r.Utilization) })
	row("  lowest tenant", func(r result) string { return f2(r.UtilizationMin) })
	row("max window / limit", func(r result) string {
		return fmt.Sprintf("%s (%d)", f2(r.MaxWindowRatio), r.MaxInWindow)
	})
	row("denials per completed task: mean", func(r result) string { return f2(r.DenialsMean) })
	row("  max", func(r result) string { return fmt.Sprint(r.DenialsMax) })
	row("repeat denials per completed task: mean", func(r result) string { return f2(r.RepeatDenialsMean) })
	row("  tasks denied more than twice", func(r result) string { return fmt.Sprint(r.DeniedMoreThanTwice) })
	row("in-handler waits per completed task", func(r result) string { return f2(r.WaitsMean) })
	row("Redis commands per completed task", func(r result) string { return fmt.Sprintf("%.1f", r.RedisCommandsPerTask) })
	row("  round trips by the throttle", func(r result) string { return fmt.Sprintf("%.1f", r.ThrottleRoundTripsPerTask) })
	row("  round trips by asynq and the harness", func(r result) string { return fmt.Sprintf("%.1f", r.AsynqRoundTripsPerTask) })
	row("Redis CPU per completed task", func(r result) string { return fmt.Sprintf("%.0fµs", r.RedisCPUPerTaskUS) })
	row("lateness p50", func(r result) string { return msCell(r.LatenessP50MS) })
	row("lateness p99", func(r result) string { return msCell(r.LatenessP99MS) })
	row("  max", func(r result) string { return msCell(r.LatenessMaxMS) })
	row("comeback after re-queue p50", func(r result) string { return msCell(r.ComebackP50MS) })
	row("  p99", func(r result) string { return msCell(r.ComebackP99MS) })
	row("fairness: min share / fair share", func(r result) string { return f2(r.FairnessMin) })
	row("  max share / fair share", func(r result) string { return f2(r.FairnessMax) })
	row("tasks enqueued", func(r result) string { return fmt.Sprint(r.Enqueued) })
	row("  completed", func(r result) string { return fmt.Sprint(r.Completed) })
	row("  completed more than once", func(r result) string { return fmt.Sprint(r.CompletedTwice) })
	row("  archived", func(r result) string { return fmt.Sprint(r.Archived) })
	row("  lost", func(r result) string { return fmt.Sprint(r.Lost) })
	row("wall time (top-up + drain)", func(r result) string {
		return (time.Duration(r.WallSeconds * float64(time.Second))).Round(100 * time.Millisecond).String()
	})
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, s := range sc.Strategies {
		if n := rep.Results[s].DrainNote; n != "" {
			fmt.Fprintf(&b, "%s: %s\n", s, n)
		}
		if n := rep.Results[s].Errors; n > 0 {
			fmt.Fprintf(&b, "%s: %d deliveries failed with an error other than a denial (see stderr)\n", s, n)
		}
	}
	b.WriteString(legend(sc))
	_, err := io.WriteString(w, b.String())
	return err
}

// legend explains the rows.
func legend(sc scenario) string {
	return fmt.Sprintf(`
Legend (a task is one (tenant, seq); every figure comes from the handlers' logs unless said):
  utilization        per tenant: admissions in [first, last) of the time the tenant had a
                     backlog (enqueued > admitted), divided by %d/%s x that time; ours
                     should be >= 0.95. Exact for a steady rate, even or bursty; the ends
                     of the span can move it by up to about window/duration (%.1f%% here).
  max window/limit   the most admissions of one tenant in any window (t-%s, t], over %d
                     (the count in brackets); <= 1.00 means the limit held everywhere.
                     x/time/rate limits each of the %d processes separately: its rate
                     times %d, and each process's burst (= limit) on top: up to %dx.
  denials            deliveries that returned the task to asynq to come back later;
                     repeat denials are a task's denials after its first.
  in-handler waits   denials sat out inside the handler, then decided again (package
                     worker's MaxWait); these hold a worker slot, not a queue round trip.
  Redis commands     INFO total_commands_processed over the strategy's run per completed
                     task: includes asynq's own commands (enqueue, dequeue, done, retry,
                     forwarder, heartbeats, idle polling) besides the throttle's, and every
                     command a Lua script runs inside Redis. Round trips are the requests
                     the clients sent (go-redis hooks): the limiter's client in the
                     workers; asynq's clients in the workers plus the harness's producer.
  Redis CPU          INFO used_cpu_user + used_cpu_sys over the strategy's run per
                     completed task: asynq's work included, as for Redis commands.
  lateness           per tenant, the k-th admission (from 0) could come no earlier than
                     first + floor(k/%d) x %s; lateness is how much later it came. A
                     sliding-window log repeats the shape of its first window: a gap there
                     (a slow start) stays as lateness for the whole run, at full rate.
  comeback           a re-queued task's next delivery minus the instant it asked to come
                     back (asynq stores whole seconds and forwards every %s); negative:
                     early. Rounding up to the second depends on the run's phase.
  fairness           each tenant's share of admissions while all tenants were busy,
                     over the fair share 1/%d.
  tasks              enqueued by the producer; completed (by the handlers' logs), more
                     than once (a task run twice: should be 0), archived (Inspector);
                     lost = enqueued - completed - archived.
  wall time          from the start of the top-up to the end of the drain.
`, sc.Limit.Events, sc.Limit.Window, 100*sc.Limit.Window.Seconds()/sc.Duration.Seconds(),
		sc.Limit.Window, sc.Limit.Events, sc.Workers, sc.Workers, 2*sc.Workers,
		sc.Limit.Events, sc.Limit.Window, sc.Forwarder, sc.Tenants)
}
