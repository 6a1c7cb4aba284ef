// Command demo is the one-command quickstart of asynq-throttle:
//
//	go run ./cmd/demo
//
// It starts a fake third-party API that answers 429 above its per-tenant limit, an asynq
// worker throttled per tenant to fit that limit, and enqueues tasks for a few tenants.
// When every task is done it prints, per tenant, how many completed, how often the
// limiter re-queued one, the rate achieved against the API's limit, the busiest windows,
// and the API's 429s. It exits 0 only if every task completed, none was archived or lost,
// no window held more than its limit, and the API answered no 429; 1 otherwise, with the
// reason on stderr; 2 for bad flags or a bad REDIS_* setting.
//
// Without REDIS_ADDR it runs on an embedded in-process Redis (miniredis); with it, on that
// Redis (REDIS_ADDR, REDIS_PASSWORD, REDIS_DB, REDIS_MASTER_NAME, read by internal/redisenv), in a
// queue of its own that it deletes at the end. Progress goes to stderr; -json prints the
// report as one JSON object on stdout.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/term"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
)

// options are the command line of the demo.
type options struct {
	Tenants     []string
	PerTenant   int
	APILimit    int
	APIWindow   time.Duration
	Margin      time.Duration
	Jitter      time.Duration
	Concurrency int
	Timeout     time.Duration
	JSON        bool
	Keep        bool
}

// maxTasks bounds -n times the tenants: the demo keeps every task's admission in
// memory, as the embedded Redis keeps the tasks.
const maxTasks = 1_000_000

func main() {
	// go-redis logs each failed dial on stderr; the demo reports the failure itself.
	redisenv.QuietLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := realMain(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// realMain runs the demo with the command-line args and the REDIS_* environment, and
// returns the exit status: 0 passed, 1 failed (reason on stderr), 2 bad usage (a bad flag,
// or a REDIS_* value that is malformed or that Redis's answer shows wrong: a database the
// server lacks, a cluster node given alone, a single Redis given as a cluster).
func realMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 2
	}
	be, err := openBackend()
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 2
	}
	defer be.close()

	logw := &syncWriter{w: stderr} // progress and asynq's goroutines write to it at once
	rep, err := run(ctx, opts, be, newProgress(stderr, logw), logw)
	if redisenv.IsBadValue(err) { // a REDIS_* value Redis's answer shows wrong: bad usage, as in cmd/worker
		fmt.Fprintln(stderr, "demo:", err)
		return 2
	}
	if err != nil {
		fmt.Fprintln(stderr, "demo:", err)
		return 1
	}
	if opts.JSON {
		err = writeJSON(stdout, rep)
	} else {
		err = writeTable(stdout, rep)
	}
	if err != nil {
		fmt.Fprintln(stderr, "demo: write report:", err)
		return 1
	}
	if !rep.OK {
		fmt.Fprintln(stderr, "demo: FAIL:", strings.Join(rep.Failures, "; "))
		return 1
	}
	return 0
}

// parseFlags reads args into options. An error names the flag; flag.ErrHelp means -h.
func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	var tenants string
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&tenants, "tenants", "acme,globex,initech", "comma-separated tenants to enqueue tasks for")
	fs.IntVar(&o.PerTenant, "n", 100, "tasks per tenant, enqueued interleaved (at most 1000000 in all)")
	fs.IntVar(&o.APILimit, "api-limit", 10, "requests the fake API accepts per tenant per -api-window")
	fs.DurationVar(&o.APIWindow, "api-window", time.Second, "the fake API's sliding window")
	fs.DurationVar(&o.Margin, "margin", 200*time.Millisecond, "widen the worker's window by this much over -api-window, for network jitter")
	fs.DurationVar(&o.Jitter, "jitter", 0, "simulated network latency: each call waits a random 0..jitter before reaching the API")
	fs.IntVar(&o.Concurrency, "concurrency", 60, "asynq worker concurrency: at least the admitted rate of all tenants times MaxWait, 2s (README, the concurrency rule)")
	fs.DurationVar(&o.Timeout, "timeout", 2*time.Minute, "give up if the tasks are not all completed by then")
	fs.BoolVar(&o.JSON, "json", false, "print the report as one JSON object on stdout")
	fs.BoolVar(&o.Keep, "keep", false, "keep the run's queue (and its completed tasks) in Redis instead of deleting it at the end")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: go run ./cmd/demo [flags]\n\n"+
			"Throttles asynq tasks per tenant to fit a fake API's rate limit and reports how it went.\n"+
			"Runs on an embedded Redis unless REDIS_ADDR is set.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	if fs.NArg() > 0 {
		return options{}, fmt.Errorf("unexpected argument %q; all settings are flags, see -h", fs.Arg(0))
	}
	seen := map[string]bool{}
	for _, t := range strings.Split(tenants, ",") {
		t = strings.TrimSpace(t)
		switch {
		case t == "":
			return options{}, fmt.Errorf("-tenants %q: empty tenant name; want e.g. acme,globex", tenants)
		case seen[t]:
			return options{}, fmt.Errorf("-tenants %q: tenant %q given twice", tenants, t)
		}
		seen[t] = true
		o.Tenants = append(o.Tenants, t)
	}
	switch {
	case o.PerTenant < 1:
		return options{}, fmt.Errorf("-n %d: want at least 1 task per tenant", o.PerTenant)
	case o.PerTenant > maxTasks/len(o.Tenants): // a typo of a few digits: hours of enqueueing, and the embedded Redis's memory
		return options{}, fmt.Errorf("-n %d: %d tenants x %d tasks is more than the demo's %d tasks in all", o.PerTenant, len(o.Tenants), o.PerTenant, maxTasks)
	case o.APILimit < 1:
		return options{}, fmt.Errorf("-api-limit %d: want at least 1 request per window", o.APILimit)
	case o.APIWindow < time.Millisecond || o.APIWindow%time.Millisecond != 0:
		return options{}, fmt.Errorf("-api-window %s: want a whole number of milliseconds, at least 1ms", o.APIWindow)
	case o.Margin < 0 || o.Margin%time.Millisecond != 0:
		return options{}, fmt.Errorf("-margin %s: want a whole number of milliseconds, at least 0", o.Margin)
	case o.Jitter < 0:
		return options{}, fmt.Errorf("-jitter %s: must not be negative", o.Jitter)
	case o.Concurrency < 1:
		return options{}, fmt.Errorf("-concurrency %d: want at least 1", o.Concurrency)
	case o.Timeout <= 0:
		return options{}, fmt.Errorf("-timeout %s: must be positive", o.Timeout)
	}
	return o, nil
}

// progress shows how the run goes on stderr: a progress bar on a terminal, else one
// status line per second.
type progress interface {
	update(done, total, throttled, rejected int, elapsed time.Duration)
	finish()
}

// newProgress returns a bar if stderr is a terminal, else lines; either writes to w, which
// is stderr shared with other writers.
func newProgress(stderr, w io.Writer) progress {
	if f, ok := stderr.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return newBar(w)
	}
	return &lines{w: w}
}

// syncWriter serializes writes to w.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
