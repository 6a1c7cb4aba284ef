package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestMain lets the test binary be a worker process too: run re-executes
// os.Executable(), which under go test is this binary, with the hidden subcommand.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == workerFlag {
		os.Exit(workerMain(os.Args[2:], os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// TestRealMain_small runs the whole harness, its own redis-server and worker processes
// included, on a small scenario with both strategies of package worker, and checks the
// JSON report: nothing lost or archived, and no window over the limit. It needs
// redis-server on PATH and fails, saying how to install it, without.
func TestRealMain_small(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	start := time.Now()
	code := realMain(ctx, []string{"-limit", "5", "-tenants", "2", "-workers", "2", "-duration", "3s",
		"-backlog", "2", "-drain-timeout", "20s", "-strategies", "reservations,naive", "-json"}, &stdout, &stderr)
	t.Logf("ran in %s", time.Since(start).Round(time.Millisecond))
	if code != 0 {
		t.Fatalf("exit status %d, stderr:\n%s", code, stderr.String())
	}
	var rep struct {
		Scenario scenarioJSON      `json:"scenario"`
		Results  map[string]result `json:"results"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("stdout is not the JSON report: %v\n%s", err, stdout.String())
	}
	if rep.Scenario.Rule != "bench:call tenant=5/1s" || rep.Scenario.WaitingPerTenant != 10 {
		t.Errorf("scenario = %+v, want rule bench:call tenant=5/1s and 10 waiting per tenant", rep.Scenario)
	}
	for _, s := range []string{stratReservations, stratNaive} {
		r, ok := rep.Results[s]
		if !ok {
			t.Errorf("no result for %s in %s", s, stdout.String())
			continue
		}
		if r.Enqueued < 20 || r.Completed != r.Enqueued || r.Lost != 0 || r.Archived != 0 {
			t.Errorf("%s: enqueued %d, completed %d, lost %d, archived %d; want >= 20 enqueued, all completed",
				s, r.Enqueued, r.Completed, r.Lost, r.Archived)
		}
		if r.MaxWindowRatio > 1 || r.MaxInWindow < 1 {
			t.Errorf("%s: max window / limit = %v (%d in one window), want in (0, 1]", s, r.MaxWindowRatio, r.MaxInWindow)
		}
		if r.RedisCommands <= 0 || len(r.PerTenant) != 2 {
			t.Errorf("%s: %d Redis commands, %d tenants; want some and 2", s, r.RedisCommands, len(r.PerTenant))
		}
	}
	if t.Failed() {
		t.Logf("stderr:\n%s", stderr.String())
	}
}

func TestParseFlags(t *testing.T) {
	t.Parallel()
	s, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if s.rule() != "bench:call tenant=20/1s" || s.Tenants != 3 || s.Workers != 4 || s.Concurrency != 40 ||
		s.waiting() != 200 || s.Duration != time.Minute || s.Forwarder != 500*time.Millisecond ||
		s.RetryIn != time.Second || s.Work != 5*time.Millisecond ||
		strings.Join(s.Strategies, ",") != "reservations,naive,x/time/rate" {
		t.Errorf("defaults = %+v", s)
	}
	bad := []struct {
		args []string
		want string
	}{
		{[]string{"-strategies", "reservations,fast"}, `unknown strategy "fast"`},
		{[]string{"-strategies", "naive,naive"}, `"naive" given twice`},
		{[]string{"-limit", "0"}, "-limit 0"},
		{[]string{"-window", "1500us"}, "whole number of milliseconds"},
		{[]string{"-workers", "0"}, "-workers 0"},
		{[]string{"-duration", "0s"}, "-duration 0s"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	}
	for _, tc := range bad {
		_, err := parseFlags(tc.args, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseFlags(%q) = %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

func TestWriteTable(t *testing.T) {
	t.Parallel()
	sc, err := parseFlags([]string{"-strategies", "reservations,x/time/rate"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	rep := report{Scenario: sc, Results: map[string]result{
		stratReservations: {Utilization: 0.99, MaxInWindow: 20, MaxWindowRatio: 1, Enqueued: 10, Completed: 10},
		stratRate:         {Utilization: 3.9, MaxInWindow: 80, MaxWindowRatio: 4, Enqueued: 10, Completed: 9, Lost: 1, DrainNote: "1 tasks still queued"},
	}}
	var b bytes.Buffer
	if err := writeTable(&b, rep); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{`rule "bench:call tenant=20/1s"`, "reservations", "x/time/rate",
		"1.00 (20)", "4.00 (80)", "3.90", "x/time/rate: 1 tasks still queued", "Legend"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

// TestParseFlags_help: -h lists the flags and then explains the rows of the table, with
// the legend the table ends with (for the default scenario).
func TestParseFlags_help(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	if _, err := parseFlags([]string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("parseFlags(-h) = %v, want flag.ErrHelp", err)
	}
	defaults, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	head := "Usage: go run ./cmd/throttlebench [flags]\n\nCompares how denied asynq tasks come back under reservations, naive, x/time/rate,\n" +
		"on one scenario, each strategy with its own worker processes on a flushed Redis,\n" +
		"and prints a table: one column per strategy, one row per figure below.\n\nFlags:\n"
	if got := out.String(); !strings.HasPrefix(got, head) || !strings.HasSuffix(got, legend(defaults)) ||
		!strings.Contains(got, "\n  -limit int\n    \ttasks admitted per tenant per -window (default 20)\n") {
		t.Errorf("-h printed:\n%s\nwant %q, the flags, then the legend", got, head)
	}
}

// TestLegend_explainsEveryRow: every row of the table has its term at the start of a
// line of the legend; a sub-row (max, p99, lost, ...) is explained with its row. A row
// added without either fails here.
func TestLegend_explainsEveryRow(t *testing.T) {
	t.Parallel()
	sc, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	term := map[string]string{
		"utilization (mean over tenants)":         "utilization",
		"max window / limit":                      "max window/limit",
		"denials per completed task: mean":        "denials",
		"repeat denials per completed task: mean": "denials",
		"in-handler waits per completed task":     "in-handler waits",
		"Redis commands per completed task":       "Redis commands",
		"Redis CPU per completed task":            "Redis CPU",
		"lateness p50":                            "lateness",
		"lateness p99":                            "lateness",
		"comeback after re-queue p50":             "comeback",
		"fairness: min share / fair share":        "fairness",
		"tasks enqueued":                          "tasks",
		"wall time (top-up + drain)":              "wall time",
	}
	subRows := map[string]bool{"lowest tenant": true, "max": true, "tasks denied more than twice": true,
		"round trips by the throttle": true, "round trips by asynq and the harness": true, "p99": true,
		"max share / fair share": true, "completed": true, "completed more than once": true, "archived": true, "lost": true}
	var b bytes.Buffer
	if err := writeTable(&b, report{Scenario: sc, Results: map[string]result{}}); err != nil {
		t.Fatal(err)
	}
	table, _, _ := strings.Cut(b.String(), "\nLegend")
	_, table, _ = strings.Cut(table, "x/time/rate\n") // after the scenario and the strategies' header
	leg := legend(sc)
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(table), "\n") {
		name := regexp.MustCompile(`\s{2,}`).Split(strings.TrimSpace(line), -1)[0]
		switch {
		case term[name] != "":
			seen[name] = true
			if !strings.Contains(leg, "\n  "+term[name]+"  ") {
				t.Errorf("row %q: the legend has no line for %q:\n%s", name, term[name], leg)
			}
		case !subRows[name]:
			t.Errorf("row %q is neither explained by the legend nor a known sub-row", name)
		}
	}
	if len(seen) != len(term) {
		t.Errorf("found %d of the %d rows in the table:\n%s", len(seen), len(term), table)
	}
}
