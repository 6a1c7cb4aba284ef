// Command worker is an asynq worker whose tasks are throttled per tenant and per task type
// by THROTTLE_RULES. Every task, of any type, goes to one demo handler that POSTs it to
// DEMO_API_URL or, if that is unset, sleeps WORKER_WORK_TIME. Every WORKER_LOG_INTERVAL it
// logs, for each task type and tenant with activity (the WORKER_LOG_MAX_LINES busiest, and
// one line for the rest), how many tasks started (ran: a task admitted for a slot a
// little ahead counts when it starts, after its wait) and how many denials there were:
//
//	2026/11/30 05:01:02 api:call tenant="acme" ran=5 throttled=12
//	2026/11/30 05:01:02 ... and 4980 more (task type, tenant) pairs: ran=4980 throttled=9960
//
// With METRICS_ADDR set it serves Prometheus metrics (package worker's, see
// worker.NewMetricsWithConfig, and Go's runtime and process metrics) at /metrics.
//
// THROTTLE_RULES are the defaults: the tiers and overrides that `throttle limits` (cmd/throttle)
// stores in <THROTTLE_PREFIX>:overrides refine them while it runs, checked every second.
//
// It is configured by environment variables only; `worker -h` lists them with their
// defaults and meaning. On SIGINT or SIGTERM it stops taking tasks and gives the running
// ones up to WORKER_SHUTDOWN_TIMEOUT (30s) to finish; asynq then cancels the context of
// each one still running and puts it back in its queue, to run again from the start (on
// this worker's next start, or on another worker). Exit status: 0 after a shutdown by
// SIGINT or SIGTERM (a second one kills it at once); 1 if Redis does not answer within 5s
// at start, or asynq cannot start; 2 for a malformed variable (reported on stderr, naming
// it), a REDIS_DB the Redis does not have, a REDIS_ADDR list of a Redis that is not a
// cluster, a REDIS_PASSWORD the Redis refuses, an argument, or a METRICS_ADDR it cannot
// listen on.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/kelseyhightower/envconfig"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

func main() {
	// go-redis logs each failed dial on stderr, dozens a second while Redis is down; the
	// worker reports an unreachable Redis at start itself, and asynq's errors on stderr
	// say when it goes away later. go-redis's other lines (a Sentinel failover) stay.
	redisenv.QuietDialLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		stop() // a second signal kills the process at once
	}()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// Exit statuses of run.
const (
	exitOK     = 0
	exitError  = 1 // Redis unreachable, asynq would not start
	exitConfig = 2 // bad arguments or environment
)

// redisPingTimeout bounds the startup check that Redis answers.
const redisPingTimeout = 5 * time.Second

// run is the worker: it reads the environment, starts an asynq server on the Redis of
// REDIS_*, logs activity to stdout and asynq's warnings and errors to stderr, and shuts
// down when ctx ends. It returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { usage(stderr) }
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitConfig
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "worker: unexpected argument %q: the worker is configured by environment variables (worker -h lists them)\n", fs.Arg(0))
		return exitConfig
	}
	cfg, err := loadConfig()
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitConfig
	}

	logger := log.New(stdout, "", log.LstdFlags)
	rdb := cfg.Redis.NewClient() // one client for the limiter, the middleware and asynq
	defer rdb.Close()
	pingCtx, cancel := context.WithTimeout(ctx, redisPingTimeout)
	err = cfg.Redis.Ping(pingCtx, rdb) // for Sentinel it says what is wrong: the addresses, the name, the master
	cancel()
	if redisenv.IsBadValue(err) { // REDIS_DB=99, a bad REDIS_ADDR or REDIS_PASSWORD: a bad value, not an outage
		fmt.Fprintln(stderr, err)
		return exitConfig
	}
	if err != nil {
		fmt.Fprintf(stderr, "worker: Redis at REDIS_ADDR=%q does not answer: %v\n", cfg.Redis.Addr, err)
		return exitError
	}
	clock := throttle.ClockLocal
	if cfg.Clock == "redis" {
		clock = throttle.ClockRedis
	}
	lim, err := throttle.New(rdb, throttle.Config{Prefix: cfg.Prefix, Clock: clock, MaxSkew: cfg.MaxSkew,
		MinReplicas: cfg.MinReplicas, ReplicaTimeout: cfg.ReplicaTimeout})
	if err != nil {
		fmt.Fprintf(stderr, "THROTTLE_PREFIX=%q: %v\n", cfg.Prefix, err)
		return exitConfig
	}
	act := newActivity()
	var metrics *worker.Metrics
	if cfg.MetricsAddr != "" {
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		mcfg := worker.MetricsConfig{TenantLabel: cfg.MetricsTenantLabel, MaxTenants: cfg.MetricsMaxTenants}
		if metrics, err = worker.NewMetricsWithConfig(reg, mcfg); err != nil {
			fmt.Fprintf(stderr, "worker: %v\n", err)
			return exitError
		}
		ln, err := net.Listen("tcp", cfg.MetricsAddr)
		if err != nil {
			fmt.Fprintf(stderr, "METRICS_ADDR=%q: %v\n", cfg.MetricsAddr, err)
			return exitConfig
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		metricsSrv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = metricsSrv.Serve(ln) }()
		defer metricsSrv.Close()
		logger.Printf("metrics at http://%s/metrics", ln.Addr())
	}
	overrides, err := worker.NewOverrideStore(rdb, cfg.Prefix) // tiers and overrides: cmd/throttle limits
	if err != nil {
		fmt.Fprintf(stderr, "THROTTLE_PREFIX=%q: %v\n", cfg.Prefix, err)
		return exitConfig
	}
	mw, err := worker.New(lim, worker.Config{
		Overrides:          overrides,
		OverrideReloadFunc: countReloads(metrics),
		Rules:              cfg.Rules,
		TenantHeader:       cfg.TenantHeader,
		Redis:              rdb,
		Concurrency:        cfg.Concurrency, // at most WORKER_CONCURRENCY - 1 handlers wait for a slot ahead
		FailOpen:           cfg.FailOpen,
		QueuePriority:      worker.QueuePriorities(cfg.Queues), // a higher weight takes a lower one's reserved slot
		Logger:             slog.New(slog.NewTextHandler(stderr, nil)),
		Metrics:            metrics,
		DecisionFunc:       act.decided,
	})
	if err != nil {
		fmt.Fprintf(stderr, "THROTTLE_RULES=%q: %v\n", os.Getenv("THROTTLE_RULES"), err)
		return exitConfig
	}
	srv := asynq.NewServerFromRedisClient(rdb, asynqConfig(cfg, stderr))

	for _, r := range cfg.Rules {
		logger.Printf("rule %s", r)
	}
	for _, w := range concurrencyAdvice(cfg.Rules, cfg.Concurrency, worker.DefaultMaxWait) {
		logger.Print(w)
	}
	logger.Printf("redis %s", cfg.Redis)
	logger.Printf("queues %s concurrency %d forwarder interval %s shutdown timeout %s tenant header %q key prefix %q",
		cfg.Queues, cfg.Concurrency, cfg.ForwarderInterval, cfg.ShutdownTimeout, cfg.TenantHeader, cfg.Prefix)
	logger.Printf("clock %s (max skew %s), fail open %t", cfg.Clock, cfg.MaxSkew, cfg.FailOpen)
	if cfg.MinReplicas > 0 {
		logger.Printf("durable: an admission runs its task once %d replica(s) acknowledged it within %s", cfg.MinReplicas, cfg.ReplicaTimeout)
		if n, ok := connectedReplicas(ctx, rdb); ok && n < cfg.MinReplicas {
			logger.Printf("warning: durable: the Redis master has %d replica(s) connected, fewer than THROTTLE_MIN_REPLICAS=%d: "+
				"no admission is acknowledged, so no throttled task runs, until enough replicas connect", n, cfg.MinReplicas)
		}
	}
	logger.Printf("tiers and overrides from %s (cmd/throttle limits), checked every %s", overrides.Key(), worker.DefaultOverrideInterval)
	h := demoHandler{url: cfg.DemoAPIURL, work: cfg.WorkTime, tenantHeader: cfg.TenantHeader,
		client: &http.Client{Timeout: 30 * time.Second}}
	if h.url != "" {
		logger.Printf("handler POSTs each task to DEMO_API_URL=%s", h.url)
	} else {
		logger.Printf("handler sleeps WORKER_WORK_TIME=%s per task (DEMO_API_URL unset)", h.work)
	}

	// srv.Run would wait for SIGINT/SIGTERM itself; main turns those into ctx instead, so
	// that tests can stop the worker too.
	if err := srv.Start(act.outer(cfg.TenantHeader, mw(act.handler(cfg.TenantHeader, h)))); err != nil {
		fmt.Fprintf(stderr, "worker: start asynq server: %v\n", err)
		return exitError
	}
	tick := time.NewTicker(cfg.LogInterval)
	defer tick.Stop()
	for done := false; !done; {
		select {
		case <-tick.C:
		case <-ctx.Done():
			logger.Printf("shutting down: running tasks have up to WORKER_SHUTDOWN_TIMEOUT=%s to finish", cfg.ShutdownTimeout)
			act.stop()
			srv.Shutdown()          // waits up to cfg.ShutdownTimeout, then requeues the tasks still running
			act.settle(time.Second) // their handlers return after it: count them in the last lines
			done = true
		}
		for _, line := range act.take(cfg.LogMaxLines) {
			logger.Print(line)
		}
	}
	logger.Printf("stopped")
	return exitOK
}

// countReloads is the worker.Config.OverrideReloadFunc that counts each reload of the
// overrides in asynq_throttle_override_reloads_total: result="ok" for a set put in force
// (the one read at start too), result="error" for a check, read or parse that failed.
// Without metrics it is nil: nothing to count.
func countReloads(metrics *worker.Metrics) func(version int64, err error) {
	if metrics == nil {
		return nil
	}
	return func(_ int64, err error) {
		result := worker.ReloadOK
		if err != nil {
			result = worker.ReloadError
		}
		metrics.OverrideReloads.WithLabelValues(result).Inc()
	}
}

// asynqConfig is the asynq server's configuration for cfg, asynq's warnings and errors
// going to stderr, wrapped by worker.WrapConfig.
func asynqConfig(cfg Config, stderr io.Writer) asynq.Config {
	return worker.WrapConfig(asynq.Config{
		Concurrency:              cfg.Concurrency,
		Queues:                   cfg.Queues,
		DelayedTaskCheckInterval: cfg.ForwarderInterval,
		ShutdownTimeout:          cfg.ShutdownTimeout,
		Logger:                   newAsynqLogger(stderr),
		// Warnings and errors only: at Info asynq logs its lifecycle chatter. The one
		// warning that floods, "revoke task id=...", once per throttled task that had no
		// retry left, is dropped by asynqLogger; other warnings (a task archived after its
		// last retry, Redis trouble, "Quitting worker" for a task still running at the
		// shutdown timeout) still show.
		LogLevel: asynq.WarnLevel,
	})
}

// usage prints how to run the worker and its environment variables with their defaults.
func usage(w io.Writer) {
	fmt.Fprintf(w, "Usage: worker\n\nAn asynq worker throttled by THROTTLE_RULES, configured by these environment variables:\n\n")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VARIABLE\tDEFAULT\tMEANING")
	_ = envconfig.Usagef("", &Config{}, tw, usageFormat)
	_ = envconfig.Usagef("", &redisUsage{}, tw, usageFormat)
	_ = tw.Flush()
	fmt.Fprintf(w, "\nDurations are Go durations (500ms, 2s, 1h). Example:\n"+
		"  THROTTLE_RULES='api:call tenant=5/2s type=20/1s; email:send tenant=100/1h' METRICS_ADDR=:9090 worker\n"+
		"\nOn SIGINT or SIGTERM the worker takes no new task and gives the running ones WORKER_SHUTDOWN_TIMEOUT to finish;\n"+
		"then asynq cancels the context of each one still running and puts it back in its queue (pending, no retry\n"+
		"spent), to run again from the start. A second signal kills the worker at once.\n"+
		"\nExit status: 0 after a shutdown by SIGINT or SIGTERM; 1 if Redis does not answer within %s at start\n"+
		"or asynq cannot start; 2 for a malformed variable, a REDIS_DB the Redis does not have, a REDIS_ADDR\n"+
		"list of a Redis that is not a cluster, a REDIS_PASSWORD the Redis refuses, an argument, or a METRICS_ADDR\n"+
		"it cannot listen on.\n", redisPingTimeout)
}

const usageFormat = "{{range .}}{{usage_key .}}\t{{usage_default .}}\t{{usage_description .}}\n{{end}}"

// asynqLogger is asynq's Logger, writing to stderr with an "asynq: " prefix. It drops
// the warning "revoke task id=..." that asynq logs for every task the throttle
// middleware deferred (a throttled task with no retry left): one per throttled task,
// already counted in the worker's own lines.
type asynqLogger struct{ l *log.Logger }

var _ asynq.Logger = asynqLogger{}

func newAsynqLogger(w io.Writer) asynqLogger {
	return asynqLogger{log.New(w, "asynq: ", log.LstdFlags)}
}

func (a asynqLogger) Debug(args ...any) { a.print("DEBUG: ", args) }
func (a asynqLogger) Info(args ...any)  { a.print("INFO: ", args) }
func (a asynqLogger) Warn(args ...any) {
	if !strings.HasPrefix(fmt.Sprint(args...), "revoke task id=") {
		a.print("WARN: ", args)
	}
}
func (a asynqLogger) Error(args ...any) { a.print("ERROR: ", args) }
func (a asynqLogger) Fatal(args ...any) {
	a.print("FATAL: ", args)
	os.Exit(1)
}

func (a asynqLogger) print(level string, args []any) { a.l.Print(level + fmt.Sprint(args...)) }
