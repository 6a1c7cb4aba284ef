// Command enqueue enqueues asynq tasks for several tenants, interleaved (acme 1, globex 1,
// initech 1, acme 2, ...), each tagged with its tenant by package producer, to try the
// throttling worker (cmd/worker) against a burst of work.
//
// Usage:
//
//	enqueue [-type api:call] [-tenants acme,globex,initech] [-n 20] [-queue default]
//	        [-payload TEXT] [-max-retry 25] [-retention 0]
//
// It reaches Redis through the same environment as the worker (package redisenv):
// REDIS_ADDR (default 127.0.0.1:6379; a comma-separated list means Redis Cluster nodes, or
// Sentinels with REDIS_MASTER_NAME), REDIS_MASTER_NAME, REDIS_PASSWORD, REDIS_DB.
//
// A progress bar runs on stderr; then one line on stdout says what was enqueued:
//
//	enqueued 60 tasks of type api:call to queue default: acme=20 globex=20 initech=20
//
// Exit status: 0 when every task was enqueued; 1 when an enqueue failed (it stops at the
// first failure, prints it on stderr and "enqueued K of N ..." on stdout); 2 for bad flags
// or environment.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"iter"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/schollz/progressbar/v3"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/producer"
)

// Exit statuses.
const (
	exitOK      = 0
	exitEnqueue = 1 // an enqueue failed
	exitUsage   = 2 // bad flags or environment
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command: it parses args, reads Redis settings from the environment,
// enqueues, reports on stdout and stderr, and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args)
	if errors.Is(err, flag.ErrHelp) {
		printUsage(stdout)
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\nRun 'enqueue -h' for usage.\n", err)
		return exitUsage
	}
	renv, err := redisenv.Load()
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		return exitUsage
	}
	rdb := renv.NewClient()
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb) // shares rdb; closing rdb is ours

	bar := progressbar.NewOptions(cfg.total(),
		progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription("enqueue"),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionShowIts(),
		progressbar.OptionSetItsString("tasks"),
		progressbar.OptionThrottle(65*time.Millisecond),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(stderr) }),
	)
	counts, err := enqueueAll(ctx, client, cfg, func() { _ = bar.Add(1) })
	if err != nil {
		if bar.IsStarted() {
			_ = bar.Exit() // keeps the bar where it stopped; ends its line
		}
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		fmt.Fprintln(stdout, summary(cfg, counts))
		return exitEnqueue
	}
	fmt.Fprintln(stdout, summary(cfg, counts))
	return exitOK
}

// config is what the flags ask for.
type config struct {
	taskType  string
	tenants   []string // in flag order, none empty, no duplicates
	perTenant int      // tasks per tenant, >= 1
	queue     string
	payload   []byte        // the same for every task; nil means defaultPayload per task
	maxRetry  int           // -1 means asynq's default (25)
	retention time.Duration // 0 or whole seconds >= 1s
}

// total is the number of tasks c asks for.
func (c config) total() int { return len(c.tenants) * c.perTenant }

// options returns the asynq enqueue options c asks for.
func (c config) options() []asynq.Option {
	opts := []asynq.Option{asynq.Queue(c.queue)}
	if c.maxRetry >= 0 {
		opts = append(opts, asynq.MaxRetry(c.maxRetry))
	}
	if c.retention > 0 {
		opts = append(opts, asynq.Retention(c.retention))
	}
	return opts
}

// flagSet defines the command's flags into c and the raw texts that parseFlags checks.
func flagSet(c *config, tenants, payload *string) *flag.FlagSet {
	fs := flag.NewFlagSet("enqueue", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // run prints errors and usage itself
	fs.StringVar(&c.taskType, "type", "api:call", "asynq task `type`")
	fs.StringVar(tenants, "tenants", "acme,globex,initech", "comma-separated `list` of tenants; tasks are interleaved across them")
	fs.IntVar(&c.perTenant, "n", 20, "tasks per tenant, at least 1")
	fs.StringVar(&c.queue, "queue", "default", "asynq `queue`")
	fs.StringVar(payload, "payload", "", "task payload, the same `text` for every task (default {\"tenant\":\"<tenant>\",\"seq\":<1..n>})")
	fs.IntVar(&c.maxRetry, "max-retry", 25, "asynq MaxRetry of each task; -1 leaves asynq's default")
	fs.DurationVar(&c.retention, "retention", 0, "how long asynq keeps a completed task, as a Go `duration` in whole seconds (0 keeps none)")
	return fs
}

// parseFlags parses args into a config. It returns flag.ErrHelp for -h, and otherwise an
// error that names the flag and quotes its offending text.
func parseFlags(args []string) (config, error) {
	var c config
	var tenants, payload string
	fs := flagSet(&c, &tenants, &payload)
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected argument %q: enqueue takes flags only", fs.Arg(0))
	}
	if strings.TrimSpace(c.taskType) == "" {
		return config{}, fmt.Errorf("-type %q: must not be empty", c.taskType)
	}
	var err error
	if c.tenants, err = splitTenants(tenants); err != nil {
		return config{}, fmt.Errorf("-tenants %q: %w", tenants, err)
	}
	if c.perTenant < 1 {
		return config{}, fmt.Errorf("-n %d: must be at least 1", c.perTenant)
	}
	if strings.TrimSpace(c.queue) == "" {
		return config{}, fmt.Errorf("-queue %q: must not be empty", c.queue)
	}
	if c.maxRetry < -1 {
		return config{}, fmt.Errorf("-max-retry %d: must be -1 (asynq's default) or at least 0", c.maxRetry)
	}
	switch {
	case c.retention < 0:
		return config{}, fmt.Errorf("-retention %s: must not be negative", c.retention)
	case c.retention%time.Second != 0:
		// asynq stores retention as whole seconds, truncated: 1.5s would silently be 1s.
		return config{}, fmt.Errorf("-retention %s: asynq keeps tasks for whole seconds; use 0 or a multiple of 1s", c.retention)
	}
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "payload" {
			c.payload = []byte(payload) // set, even to "": the same payload for all
		}
	})
	return c, nil
}

// splitTenants splits a comma-separated list of tenants, trimming spaces. Every tenant
// must be non-empty and listed once.
func splitTenants(list string) ([]string, error) {
	tenants := strings.Split(list, ",")
	seen := make(map[string]bool, len(tenants))
	for i, t := range tenants {
		t = strings.TrimSpace(t)
		if t == "" {
			return nil, fmt.Errorf("tenant %d of %d is empty", i+1, len(tenants))
		}
		if seen[t] {
			return nil, fmt.Errorf("tenant %q is listed twice", t)
		}
		seen[t] = true
		tenants[i] = t
	}
	return tenants, nil
}

// printUsage writes the command's usage and flags to w.
func printUsage(w io.Writer) {
	var c config
	var tenants, payload string
	fs := flagSet(&c, &tenants, &payload)
	fs.SetOutput(w)
	fmt.Fprintf(w, `Usage: enqueue [flags]

Enqueues -n tasks for each tenant, interleaved across tenants, each tagged with its
tenant in the %q header. Redis comes from REDIS_ADDR (default 127.0.0.1:6379),
REDIS_MASTER_NAME, REDIS_PASSWORD and REDIS_DB, as for the worker.

Flags:
`, producer.TenantHeader)
	fs.PrintDefaults()
}

// job is one task to enqueue: the seq-th (from 1) of tenant.
type job struct {
	tenant string
	seq    int
}

// jobs yields perTenant jobs for each tenant, interleaved: seq 1 of every tenant in
// order, then seq 2, and so on.
func jobs(tenants []string, perTenant int) iter.Seq[job] {
	return func(yield func(job) bool) {
		for seq := 1; seq <= perTenant; seq++ {
			for _, t := range tenants {
				if !yield(job{tenant: t, seq: seq}) {
					return
				}
			}
		}
	}
}

// defaultPayload is the payload of a task when -payload is not set:
// {"tenant":"acme","seq":7}.
func defaultPayload(j job) []byte {
	b, err := json.Marshal(struct {
		Tenant string `json:"tenant"`
		Seq    int    `json:"seq"`
	}{j.tenant, j.seq})
	if err != nil {
		panic(err) // a string and an int always marshal
	}
	return b
}

// enqueueAll enqueues cfg's tasks with c in jobs order, calling onEnqueued after each
// success. It stops at the first error (including ctx's) and returns it with the number
// of tasks enqueued per tenant until then.
func enqueueAll(ctx context.Context, c *asynq.Client, cfg config, onEnqueued func()) (map[string]int, error) {
	counts := make(map[string]int, len(cfg.tenants))
	opts := cfg.options()
	done := 0
	for j := range jobs(cfg.tenants, cfg.perTenant) {
		if err := ctx.Err(); err != nil {
			return counts, fmt.Errorf("stopped before task %d of %d: %w", done+1, cfg.total(), err)
		}
		payload := cfg.payload
		if payload == nil {
			payload = defaultPayload(j)
		}
		if _, err := producer.Enqueue(ctx, c, cfg.taskType, payload, j.tenant, opts...); err != nil {
			return counts, fmt.Errorf("task %d of %d: %w", done+1, cfg.total(), err)
		}
		counts[j.tenant]++
		done++
		onEnqueued()
	}
	return counts, nil
}

// summary is the line printed on stdout: "enqueued N tasks of type T to queue Q:
// acme=20 ...", or "enqueued K of N tasks ..." when fewer than all were enqueued.
func summary(cfg config, counts map[string]int) string {
	done := 0
	per := make([]string, len(cfg.tenants))
	for i, t := range cfg.tenants {
		done += counts[t]
		per[i] = fmt.Sprintf("%s=%d", t, counts[t])
	}
	n := fmt.Sprint(done)
	if done != cfg.total() {
		n = fmt.Sprintf("%d of %d", done, cfg.total())
	}
	return fmt.Sprintf("enqueued %s tasks of type %s to queue %s: %s", n, cfg.taskType, cfg.queue, strings.Join(per, " "))
}
