// Command throttlebench measures how denied asynq tasks come back, for three ways of
// throttling them per tenant, on one scenario, side by side:
//
//	go run ./cmd/throttlebench          # the default scenario (a few minutes); a table on stdout
//	go run ./cmd/throttlebench -json    # the same, as one JSON object
//
// The strategies:
//
//	reservations  package worker with its defaults: a denied task holds a reservation for
//	              the slot it will get, is re-queued to come back WakeLead before it, and
//	              waits out the rest in its handler.
//	naive         package worker with NoReservations and MaxWait -1: every denied task is
//	              re-queued to the instant the oldest admission leaves the window, rounded up
//	              to a whole second, the instant every task denied meanwhile is given too.
//	x/time/rate   asynq's documented rate-limiting pattern (hibiken/asynq wiki, "Rate
//	              Limiting"): a golang.org/x/time/rate.Limiter per tenant in each worker
//	              process, and a RateLimitError with a fixed RetryIn that IsFailure ignores and
//	              RetryDelayFunc returns. Its limit is per process, not global.
//
// Each strategy runs in turn on a flushed Redis with its own -workers worker processes
// (this binary, re-executed with a hidden -worker subcommand), each a real asynq server
// whose handler logs every task it runs with its admission instant, then sleeps -work.
// A producer keeps -backlog windows' worth of tasks waiting per tenant for -duration,
// then stops and waits (at most -drain-timeout) for the tasks to drain. The report is
// computed from the merged handler logs: utilization, the busiest window, denials per
// task, lateness against the ideal schedule, fairness between tenants, Redis commands per
// task, and whether any task was lost, archived or run twice.
//
// It starts its own redis-server on a free loopback port (persistence off, killed at
// exit and on SIGINT) unless -redis-addr is given; that Redis's database 0 is then
// FLUSHed before each strategy, and other clients' commands count in its statistics.
// Progress goes to stderr. The exit status is 0 when the run completed, 1 when it could
// not run, 2 for bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// Strategy names, as -strategies takes them and the report prints them.
const (
	stratReservations = "reservations"
	stratNaive        = "naive"
	stratRate         = "x/time/rate"
)

// allStrategies is every strategy, in the order -strategies defaults to.
var allStrategies = []string{stratReservations, stratNaive, stratRate}

// scenario is one benchmark setting, the same for every strategy.
type scenario struct {
	Limit        throttle.Limit // per tenant: rule "bench:call tenant=<Limit>"
	Tenants      int            // tenants, each with its own backlog
	Workers      int            // worker OS processes
	Concurrency  int            // asynq Concurrency of each worker process
	Backlog      int            // windows' worth of tasks kept waiting per tenant
	Duration     time.Duration  // how long the producer keeps the backlogs topped up
	DrainTimeout time.Duration  // how long to wait for the backlog to drain afterwards
	Work         time.Duration  // handler time per task
	Forwarder    time.Duration  // asynq DelayedTaskCheckInterval
	RetryIn      time.Duration  // x/time/rate: the fixed RateLimitError.RetryIn
	Strategies   []string
	RedisAddr    string // "" starts a redis-server
	JSON         bool
	Records      string // file for every handler record, JSON lines; "" for none
}

// taskType is the type of every benchmark task.
const taskType = "bench:call"

// rule is the THROTTLE_RULES text of the scenario's per-tenant limit.
func (s scenario) rule() string { return taskType + " tenant=" + s.Limit.String() }

// waiting is how many tasks the producer keeps waiting per tenant.
func (s scenario) waiting() int { return s.Backlog * s.Limit.Events }

// tenantNames returns the scenario's tenants: t0, t1, ...
func (s scenario) tenantNames() []string {
	names := make([]string, s.Tenants)
	for i := range names {
		names[i] = fmt.Sprintf("t%d", i)
	}
	return names
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == workerFlag {
		os.Exit(workerMain(os.Args[2:], os.Stdin, os.Stdout, os.Stderr))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := realMain(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// realMain runs the benchmark with the command-line args and returns the exit status:
// 0 done, 1 the run failed (reason on stderr), 2 bad usage.
func realMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sc, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "throttlebench:", err)
		return 2
	}
	start := time.Now()
	rep, err := run(ctx, sc, stderr)
	if err != nil && ctx.Err() != nil {
		fmt.Fprintln(stderr, "throttlebench: interrupted; its worker processes and redis-server are stopped")
		return 1
	}
	if err != nil {
		fmt.Fprintln(stderr, "throttlebench:", err)
		return 1
	}
	if sc.JSON {
		err = writeJSON(stdout, rep)
	} else {
		err = writeTable(stdout, rep)
	}
	if err != nil {
		fmt.Fprintln(stderr, "throttlebench: write report:", err)
		return 1
	}
	fmt.Fprintf(stderr, "throttlebench: done in %s\n", time.Since(start).Round(time.Second))
	return 0
}

// parseFlags reads args into a scenario. An error names the flag; flag.ErrHelp means -h.
func parseFlags(args []string, stderr io.Writer) (scenario, error) {
	s := scenario{}
	var strategies string
	fs := flag.NewFlagSet("throttlebench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&s.Limit.Events, "limit", 20, "tasks admitted per tenant per -window")
	fs.DurationVar(&s.Limit.Window, "window", time.Second, "the sliding window of -limit")
	fs.IntVar(&s.Tenants, "tenants", 3, "tenants, each with its own limit and backlog")
	fs.IntVar(&s.Workers, "workers", 4, "worker OS processes per strategy")
	fs.IntVar(&s.Concurrency, "concurrency", 40, "asynq Concurrency of each worker process")
	fs.IntVar(&s.Backlog, "backlog", 10, "windows' worth of tasks kept waiting per tenant (backlog*limit tasks)")
	fs.DurationVar(&s.Duration, "duration", 60*time.Second, "how long the producer keeps every backlog topped up")
	fs.DurationVar(&s.DrainTimeout, "drain-timeout", 2*time.Minute, "how long to wait for the backlog to drain after -duration; tasks left then are lost")
	fs.DurationVar(&s.Work, "work", 5*time.Millisecond, "handler time per task")
	fs.DurationVar(&s.Forwarder, "forwarder", worker.DefaultDelayedTaskCheckInterval, "asynq DelayedTaskCheckInterval of the workers")
	fs.DurationVar(&s.RetryIn, "retry-in", time.Second, "x/time/rate: the fixed RetryIn of a rate-limited task")
	fs.StringVar(&strategies, "strategies", strings.Join(allStrategies, ","), "comma-separated strategies to run, in order")
	fs.StringVar(&s.RedisAddr, "redis-addr", "", "host:port of a Redis to use (its database 0 is FLUSHed); default: start a redis-server")
	fs.BoolVar(&s.JSON, "json", false, "print one JSON object {scenario, results} instead of the table")
	fs.StringVar(&s.Records, "records", "", "write every handler record (one line per delivery of a task) to this file, JSON lines")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: go run ./cmd/throttlebench [flags]\n\n"+
			"Compares how denied asynq tasks come back under %s,\n"+
			"on one scenario, each strategy with its own worker processes on a flushed Redis,\n"+
			"and prints a table: one column per strategy, one row per figure below.\n\nFlags:\n",
			strings.Join(allStrategies, ", "))
		fs.PrintDefaults()
		// The rows, for the flags given so far (the defaults for a lone -h), as the
		// table's own legend explains them.
		_, _ = io.WriteString(fs.Output(), legend(s))
	}
	if err := fs.Parse(args); err != nil {
		return scenario{}, err
	}
	if fs.NArg() > 0 {
		return scenario{}, fmt.Errorf("unexpected argument %q; all settings are flags, see -h", fs.Arg(0))
	}
	for _, name := range strings.Split(strategies, ",") {
		name = strings.TrimSpace(name)
		switch {
		case !slices.Contains(allStrategies, name):
			return scenario{}, fmt.Errorf("-strategies %q: unknown strategy %q; want some of %s", strategies, name, strings.Join(allStrategies, ","))
		case slices.Contains(s.Strategies, name):
			return scenario{}, fmt.Errorf("-strategies %q: %q given twice", strategies, name)
		}
		s.Strategies = append(s.Strategies, name)
	}
	if err := s.Limit.Validate(); err != nil {
		return scenario{}, fmt.Errorf("-limit %d -window %s: %w", s.Limit.Events, s.Limit.Window, err)
	}
	switch {
	case s.Tenants < 1:
		return scenario{}, fmt.Errorf("-tenants %d: want at least 1", s.Tenants)
	case s.Workers < 1:
		return scenario{}, fmt.Errorf("-workers %d: want at least 1", s.Workers)
	case s.Concurrency < 1:
		return scenario{}, fmt.Errorf("-concurrency %d: want at least 1", s.Concurrency)
	case s.Backlog < 1:
		return scenario{}, fmt.Errorf("-backlog %d: want at least 1", s.Backlog)
	case s.Duration <= 0:
		return scenario{}, fmt.Errorf("-duration %s: must be positive", s.Duration)
	case s.DrainTimeout <= 0:
		return scenario{}, fmt.Errorf("-drain-timeout %s: must be positive", s.DrainTimeout)
	case s.Work < 0:
		return scenario{}, fmt.Errorf("-work %s: must not be negative", s.Work)
	case s.Forwarder <= 0:
		return scenario{}, fmt.Errorf("-forwarder %s: must be positive", s.Forwarder)
	case s.RetryIn <= 0:
		return scenario{}, fmt.Errorf("-retry-in %s: must be positive", s.RetryIn)
	}
	return s, nil
}
