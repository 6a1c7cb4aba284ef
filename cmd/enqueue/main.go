// Command enqueue enqueues asynq tasks for several tenants, interleaved (acme 1, globex 1,
// initech 1, acme 2, ...), each tagged with its tenant by package producer, to try the
// throttling worker (cmd/worker) against a burst of work, and, with ENQUEUE_QUOTA, an
// enqueue-side quota.
//
// Usage:
//
//	enqueue [-type api:call] [-tenants acme,globex,initech] [-n 20] [-queue default]
//	        [-payload TEXT] [-max-retry 25] [-retention 0]
//
// It reaches Redis through the same environment as the worker (package redisenv):
// REDIS_ADDR (default 127.0.0.1:6379; a comma-separated list means Redis Cluster nodes, or
// Sentinels with REDIS_MASTER_NAME), REDIS_MASTER_NAME, REDIS_PASSWORD, REDIS_DB. It also
// reads, as the worker does:
//
//	THROTTLE_TENANT_HEADER  the task header that names the tenant (default "tenant")
//	THROTTLE_PREFIX         the workers' key prefix (default "throttle"); enqueue quotas
//	                        live under "<prefix>:enqueue:", so its last ':'-separated
//	                        segment must not be "enqueue" (producer.CheckPrefix)
//	ENQUEUE_QUOTA           if set, enqueue quotas for -type, e.g. "tenant=10000/24h"
//	                        (producer.ParseQuotas): a task past them is refused, not
//	                        enqueued, and the run goes on with the next
//
// A progress bar runs on stderr; then a report on stdout says what was enqueued and what
// was refused, one line per tenant:
//
//	enqueued 50 of 60 tasks of type api:call to queue default; ENQUEUE_QUOTA "tenant=15/24h" refused 10, of 2 tenants
//	  "acme": 15 enqueued, 5 refused; the first, task 16, by tenant=15/24h: retry after 23h59m59.98s
//	  "globex": 15 enqueued, 5 refused; the first, task 16, by tenant=15/24h: retry after 23h59m59.98s
//	  "initech": 20 enqueued
//
// Tenants with refused tasks come first, then the others, each in -tenants order. Tenant
// strings are quoted (strconv.Quote) and cut to their first 64 bytes (quote.Quote;
// "...(N bytes)" follows a cut one), and a report shows at most maxTenantLines (20)
// tenants, then "... and N more tenants".
//
// Exit status: 0 when every task was enqueued; 1 when an enqueue failed (it stops at the
// first failure, prints it on stderr and the report on stdout); 2 for bad flags or
// environment (a REDIS_DB the Redis does not have and a REDIS_PASSWORD it refuses
// included); 3 when ENQUEUE_QUOTA refused some tasks and every other was enqueued.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"iter"
	"math"
	"os"
	"os/signal"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"
	"github.com/kelseyhightower/envconfig"
	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Exit statuses.
const (
	exitOK      = 0
	exitEnqueue = 1 // an enqueue failed
	exitUsage   = 2 // bad flags or environment
	exitRefused = 3 // ENQUEUE_QUOTA refused some tasks; every other was enqueued

	// maxTasks bounds -n times the tenants: a CLI to try the throttle with, where a typo
	// of a few digits would otherwise queue billions of tasks (or overflow the count).
	maxTasks = 10_000_000
)

func main() {
	// go-redis logs each failed dial on stderr; the command reports the failure itself.
	redisenv.QuietLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole command: it parses args, reads Redis settings from the environment,
// enqueues, reports on stdout and stderr, and returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runAt(ctx, args, stdout, stderr, nil)
}

// runAt is run with the enqueue quota's clock: now, or the local clock if nil.
func runAt(ctx context.Context, args []string, stdout, stderr io.Writer, now func() time.Time) int {
	cfg, err := parseFlags(args)
	if errors.Is(err, flag.ErrHelp) {
		printUsage(stdout)
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\nRun 'enqueue -h' for usage.\n", err)
		return exitUsage
	}
	env, err := loadEnv()
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		return exitUsage
	}
	renv, err := redisenv.Load()
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		return exitUsage
	}
	rdb := renv.NewClient()
	defer rdb.Close()
	// A REDIS_DB the server does not have fails every command: report it as the bad
	// variable it is. Any other failure (Redis down) would fail every enqueue too, and
	// through Sentinel with go-redis's "all sentinels specified in configuration are
	// unreachable", whatever is wrong: report it once, naming the variable, as cmd/worker
	// does at start.
	pingCtx, cancel := context.WithTimeout(ctx, redisPingTimeout)
	err = renv.Ping(pingCtx, rdb)
	cancel()
	if redisenv.IsBadValue(err) {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		return exitUsage
	}
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: Redis at REDIS_ADDR=%q does not answer: %v\n", renv.Addr, err)
		return exitEnqueue
	}
	ecfg := producer.EnqueuerConfig{TenantHeader: env.TenantHeader, Prefix: env.Prefix, Redis: rdb, NowFunc: now}
	if len(env.Quota) > 0 {
		ecfg.Quotas = map[string][]throttle.Quota{cfg.taskType: env.Quota}
	}
	// asynq's client shares rdb; closing rdb is ours.
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), ecfg)
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
		return exitUsage
	}

	// On a terminal the bar redraws every 65ms; into a pipe or a log file each redraw is
	// a line of carriage returns, so there it is drawn when it starts and when it ends.
	redraw := 65 * time.Millisecond
	if !isTerminal(stderr) {
		redraw = time.Duration(math.MaxInt64)
	}
	bar := progressbar.NewOptions(cfg.total(),
		progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription("enqueue"),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionShowIts(),
		progressbar.OptionSetItsString("tasks"),
		progressbar.OptionThrottle(redraw),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(stderr) }),
	)
	tallies, err := enqueueAll(ctx, enq, cfg, func() { _ = bar.Add(1) })
	if err != nil && bar.IsStarted() {
		_ = bar.Exit() // keeps the bar where it stopped; ends its line
	}
	if err != nil {
		fmt.Fprintf(stderr, "enqueue: %v\n", err)
	}
	for _, line := range report(cfg, env.Quota, tallies) {
		fmt.Fprintln(stdout, line)
	}
	switch {
	case err != nil:
		return exitEnqueue
	case refusedTotal(tallies) > 0:
		return exitRefused
	}
	return exitOK
}

// isTerminal reports whether w is a terminal (an *os.File on one).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// redisPingTimeout bounds the PING that checks REDIS_DB before the first enqueue.
const redisPingTimeout = 5 * time.Second

// env is what the command reads from the environment besides the REDIS_* variables,
// under the names cmd/worker reads them.
type env struct {
	TenantHeader string `envconfig:"THROTTLE_TENANT_HEADER" default:"tenant"`
	Prefix       string `envconfig:"THROTTLE_PREFIX" default:"throttle"`
	Quota        quotas `envconfig:"ENQUEUE_QUOTA"`
}

// loadEnv reads env. The error names the variable and quotes its text, as cmd/worker's.
func loadEnv() (env, error) {
	var e env
	if err := envconfig.Process("", &e); err != nil {
		return env{}, redisenv.EnvError(err)
	}
	switch {
	case e.TenantHeader == "":
		return env{}, errors.New(`THROTTLE_TENANT_HEADER="": must not be empty`)
	case !utf8.ValidString(e.TenantHeader): // asynq cannot encode it (producer.CheckTask)
		return env{}, fmt.Errorf("THROTTLE_TENANT_HEADER=%s: is not valid UTF-8, which asynq cannot encode", quote.Quote(e.TenantHeader))
	case e.Prefix == "":
		return env{}, errors.New(`THROTTLE_PREFIX="": must not be empty`)
	case strings.ContainsAny(e.Prefix, "{}"):
		return env{}, fmt.Errorf("THROTTLE_PREFIX=%q: must not contain '{' or '}': they would move the Redis Cluster hash tag", e.Prefix)
	}
	if err := producer.CheckPrefix(e.Prefix); err != nil { // it names the workers' prefix
		return env{}, fmt.Errorf("THROTTLE_PREFIX=%q: %w", e.Prefix, err)
	}
	return e, nil
}

// quotas are the enqueue quotas of ENQUEUE_QUOTA; empty means none.
type quotas []throttle.Quota

// Decode implements envconfig.Decoder with producer.ParseQuotas; blank text is no quota.
func (q *quotas) Decode(s string) error {
	if strings.TrimSpace(s) == "" {
		*q = nil
		return nil
	}
	qs, err := producer.ParseQuotas(s)
	if err != nil {
		// envconfig's error quotes s already.
		return errors.New(strings.TrimPrefix(err.Error(), fmt.Sprintf("producer: quotas %q: ", s)))
	}
	*q = qs
	return nil
}

// String formats q as ENQUEUE_QUOTA reads it: "tenant=100/1m tenant=10000/24h".
func (q quotas) String() string {
	parts := make([]string, len(q))
	for i, x := range q {
		parts[i] = x.String()
	}
	return strings.Join(parts, " ")
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
	if !utf8.ValidString(c.taskType) { // asynq cannot encode it (producer.CheckTask)
		return config{}, fmt.Errorf("-type %s: is not valid UTF-8, which asynq cannot encode", quote.Quote(c.taskType))
	}
	var err error
	if c.tenants, err = splitTenants(tenants); err != nil {
		return config{}, fmt.Errorf("-tenants %s: %w", quote.Quote(tenants), err)
	}
	if c.perTenant < 1 {
		return config{}, fmt.Errorf("-n %d: must be at least 1", c.perTenant)
	}
	if c.perTenant > maxTasks/len(c.tenants) { // a typo, and past it the total overflows
		return config{}, fmt.Errorf("-n %d: %d tenants x %d tasks is more than %d; enqueue from your own code (package producer) for more",
			c.perTenant, len(c.tenants), c.perTenant, maxTasks)
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
			return nil, fmt.Errorf("tenant %s is listed twice", quote.Quote(t))
		}
		// What producer.CheckTask would refuse for every task of the tenant.
		if !utf8.ValidString(t) {
			return nil, fmt.Errorf("tenant %d of %d, %s, is not valid UTF-8", i+1, len(tenants), quote.Quote(t))
		}
		if len(t) > throttle.MaxTenantBytes {
			return nil, fmt.Errorf("tenant %d of %d is %d bytes, more than throttle.MaxTenantBytes (%d)", i+1, len(tenants), len(t), throttle.MaxTenantBytes)
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
tenant in a task header, then reports per tenant what was enqueued and refused.

Environment:
  REDIS_ADDR, REDIS_MASTER_NAME, REDIS_PASSWORD, REDIS_DB
        the Redis, as for the worker (default 127.0.0.1:6379)
  THROTTLE_TENANT_HEADER
        the task header that names the tenant (default %q)
  THROTTLE_PREFIX
        the workers' key prefix (default %q); enqueue quotas live under <prefix>:enqueue:,
        so its last ':'-separated segment must not be "enqueue"
  ENQUEUE_QUOTA
        enqueue quotas for -type, e.g. "tenant=10000/24h" or "tenant=100/1m type=5000/1h":
        a task past them is refused and not enqueued (default: none)

Exit status: 0 all enqueued, 1 an enqueue failed, 2 bad flags or environment,
3 ENQUEUE_QUOTA refused some tasks and every other was enqueued.

Flags:
`, producer.TenantHeader, throttle.DefaultPrefix)
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

// tally is what happened to one tenant's tasks.
type tally struct {
	enqueued int
	refused  int
	first    *producer.QuotaError // the first refusal, nil if none
	firstSeq int                  // the seq of the task it refused
}

// enqueueAll enqueues cfg's tasks with enq in jobs order, calling onDone after each task
// enqueued or refused by an enqueue quota. A refused task is not enqueued, and the run
// goes on. It stops at the first other error (including ctx's) and returns it with what
// happened per tenant until then; every tenant of cfg has a tally.
func enqueueAll(ctx context.Context, enq *producer.Enqueuer, cfg config, onDone func()) (map[string]*tally, error) {
	tallies := make(map[string]*tally, len(cfg.tenants))
	for _, t := range cfg.tenants {
		tallies[t] = &tally{}
	}
	opts := cfg.options()
	done := 0
	for j := range jobs(cfg.tenants, cfg.perTenant) {
		if err := ctx.Err(); err != nil {
			return tallies, fmt.Errorf("stopped before task %d of %d: %w", done+1, cfg.total(), err)
		}
		payload := cfg.payload
		if payload == nil {
			payload = defaultPayload(j)
		}
		t := tallies[j.tenant]
		_, err := enq.Enqueue(ctx, cfg.taskType, payload, j.tenant, opts...)
		var qe *producer.QuotaError
		switch {
		case errors.As(err, &qe):
			if t.refused++; t.first == nil {
				t.first, t.firstSeq = qe, j.seq
			}
		case err != nil:
			return tallies, fmt.Errorf("task %d of %d: %w", done+1, cfg.total(), err)
		default:
			t.enqueued++
		}
		done++
		onDone()
	}
	return tallies, nil
}

// refusedTotal is the number of tasks refused, all tenants together.
func refusedTotal(tallies map[string]*tally) int {
	n := 0
	for _, t := range tallies {
		n += t.refused
	}
	return n
}

// maxTenantLines is the most tenant lines per report, then "... and N more tenants".
// Each tenant is shown by quote.Quote: quoted, cut to its first 64 bytes.
const maxTenantLines = 20

// report is what is printed on stdout: a line of totals, then one line per tenant, those
// with refused tasks first, each group in cfg.tenants order, at most maxTenantLines of
// them, then "... and N more tenants" if some are left out.
func report(cfg config, qs quotas, tallies map[string]*tally) []string {
	enqueued, refused, refusedTenants := 0, 0, 0
	for _, t := range tallies {
		enqueued += t.enqueued
		refused += t.refused
		if t.refused > 0 {
			refusedTenants++
		}
	}
	n := fmt.Sprint(enqueued)
	if enqueued != cfg.total() {
		n = fmt.Sprintf("%d of %d", enqueued, cfg.total())
	}
	totals := fmt.Sprintf("enqueued %s %s of type %s to queue %s", n, plural(cfg.total(), "task"), cfg.taskType, cfg.queue)
	if refused > 0 {
		totals += fmt.Sprintf("; ENQUEUE_QUOTA %q refused %d, of %d %s", qs.String(), refused, refusedTenants, plural(refusedTenants, "tenant"))
	}
	lines := []string{totals}
	var order []string
	for _, withRefusals := range []bool{true, false} {
		for _, tenant := range cfg.tenants {
			if (tallies[tenant].refused > 0) == withRefusals {
				order = append(order, tenant)
			}
		}
	}
	for i, tenant := range order {
		if i == maxTenantLines {
			more := len(order) - maxTenantLines
			lines = append(lines, fmt.Sprintf("  ... and %d more %s", more, plural(more, "tenant")))
			break
		}
		t := tallies[tenant]
		line := fmt.Sprintf("  %s: %d enqueued", quote.Quote(tenant), t.enqueued)
		if t.first != nil {
			line += fmt.Sprintf(", %d refused; the first, task %d, by %s: retry after %s", t.refused, t.firstSeq, t.first.Quota, t.first.RetryAfter)
		}
		lines = append(lines, line)
	}
	return lines
}

func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}
