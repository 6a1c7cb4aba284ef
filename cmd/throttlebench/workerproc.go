package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// workerFlag, as the first argument, makes the binary a worker process of the parent
// that started it (startWorkers): the hidden subcommand.
const workerFlag = "-worker"

// queue is the asynq queue of the benchmark's tasks.
const queue = "throttlebench"

// taskCheckInterval is the workers' asynq TaskCheckInterval: how often an idle processor
// looks for pending tasks (asynq: 1s).
const taskCheckInterval = 100 * time.Millisecond

// readyLine is what a worker writes on stdout once its asynq server runs; every later
// line is a record.
const readyLine = "ready"

// workerArgs returns the command line (after the binary) of worker process index for
// strategy: the hidden subcommand and the scenario it needs.
func workerArgs(sc scenario, strategy, redisAddr string, index int) []string {
	return []string{workerFlag,
		"-strategy", strategy,
		"-redis-addr", redisAddr,
		"-index", strconv.Itoa(index),
		"-limit", strconv.Itoa(sc.Limit.Events),
		"-window", sc.Limit.Window.String(),
		"-concurrency", strconv.Itoa(sc.Concurrency),
		"-work", sc.Work.String(),
		"-forwarder", sc.Forwarder.String(),
		"-retry-in", sc.RetryIn.String(),
	}
}

// workerMain is a worker process: an asynq server on the benchmark's queue whose
// handler chain is the recorder, the strategy's throttle, and the work. It writes
// readyLine, then one record per delivery, to stdout, and shuts down gracefully when
// stdin ends (the parent closed it, or died) or on SIGINT or SIGTERM. It returns the exit
// status.
func workerMain(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	var (
		strategy, addr string
		index          int
		sc             scenario
	)
	fs := flag.NewFlagSet("throttlebench -worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&strategy, "strategy", "", "strategy")
	fs.StringVar(&addr, "redis-addr", "", "Redis host:port")
	fs.IntVar(&index, "index", 0, "worker index")
	fs.IntVar(&sc.Limit.Events, "limit", 0, "events per window per tenant")
	fs.DurationVar(&sc.Limit.Window, "window", 0, "window")
	fs.IntVar(&sc.Concurrency, "concurrency", 1, "asynq Concurrency")
	fs.DurationVar(&sc.Work, "work", 0, "handler time")
	fs.DurationVar(&sc.Forwarder, "forwarder", 0, "asynq DelayedTaskCheckInterval")
	fs.DurationVar(&sc.RetryIn, "retry-in", time.Second, "x/time/rate RetryIn")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	prefix := fmt.Sprintf("throttlebench worker %d (%s): ", index, strategy)
	logger := log.New(stderr, prefix, log.Ltime|log.Lmicroseconds)

	// Two clients, to count the limiter's round trips apart from asynq's.
	var asynqCalls, throttleCalls callCounter
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	limRdb := redis.NewClient(&redis.Options{Addr: addr})
	defer limRdb.Close()
	for _, c := range []*redis.Client{rdb, limRdb} {
		if err := c.Ping(context.Background()).Err(); err != nil {
			logger.Printf("Redis at %s: %v", addr, err)
			return 1
		}
	}
	rdb.AddHook(&asynqCalls)
	limRdb.AddHook(&throttleCalls)
	out := &recordWriter{w: bufio.NewWriter(stdout), worker: index}
	h, cfg, err := workerHandler(sc, strategy, rdb, limRdb, out, stderr, prefix)
	if err != nil {
		logger.Print(err)
		return 2
	}
	cfg.Concurrency = sc.Concurrency
	cfg.Queues = map[string]int{queue: 1}
	cfg.TaskCheckInterval = taskCheckInterval
	cfg.DelayedTaskCheckInterval = sc.Forwarder
	cfg.LogLevel = asynq.WarnLevel
	cfg.Logger = asynqLogger{logger}
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(h); err != nil {
		logger.Printf("start asynq server: %v", err)
		return 1
	}
	out.line(readyLine)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		_, _ = io.Copy(io.Discard, stdin) // returns when the parent closes stdin or dies
		stop()
	}()
	<-ctx.Done()
	srv.Shutdown() // waits for running handlers (asynq's ShutdownTimeout, 8s)
	b, _ := json.Marshal(calls{Throttle: throttleCalls.roundTrips.Load(), Asynq: asynqCalls.roundTrips.Load()})
	out.line(callsPrefix + string(b))
	if err := out.flush(); err != nil {
		logger.Printf("write records: %v", err)
		return 1
	}
	return 0
}

// workerHandler returns the handler chain of strategy (recorder, throttle, work) and the
// asynq.Config fields the strategy needs. rdb is asynq's client, limRdb the limiter's.
func workerHandler(sc scenario, strategy string, rdb, limRdb redis.UniversalClient, out *recordWriter, stderr io.Writer, prefix string) (asynq.Handler, asynq.Config, error) {
	work := asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		rec := recordFrom(ctx)
		if d, ok := worker.DecisionFrom(ctx); ok {
			rec.AtMS, rec.ServerMS = d.At.UnixMilli(), d.ServerTime.UnixMilli()
		}
		if sc.Work > 0 {
			time.Sleep(sc.Work)
		}
		return nil
	})
	switch strategy {
	case stratReservations, stratNaive:
		rules, err := worker.ParseRules(sc.rule())
		if err != nil {
			return nil, asynq.Config{}, err
		}
		lim, err := throttle.New(limRdb, throttle.Config{})
		if err != nil {
			return nil, asynq.Config{}, err
		}
		wc := worker.Config{
			Rules:        rules,
			Redis:        rdb,
			Logger:       slog.New(slog.NewTextHandler(stderr, nil)).With("worker", prefix),
			DecisionFunc: observeDecision,
		}
		if strategy == stratNaive {
			wc.NoReservations = true
			wc.MaxWait = -1
		}
		mw, err := worker.New(lim, wc)
		if err != nil {
			return nil, asynq.Config{}, err
		}
		return out.middleware(mw(work)), worker.WrapConfig(asynq.Config{}), nil
	case stratRate:
		rl := newRateLimited(sc.Limit, sc.RetryIn)
		return out.middleware(rl.middleware(work)), asynq.Config{
			// If the error is due to the rate limit, don't count it as a failure.
			IsFailure:      func(err error) bool { return !isRateLimitError(err) },
			RetryDelayFunc: rateLimitRetryDelay,
		}, nil
	}
	return nil, asynq.Config{}, fmt.Errorf("unknown strategy %q", strategy)
}

// observeDecision is the worker.Config.DecisionFunc of both strategies of package
// worker: it notes every denial in the delivery's record.
func observeDecision(ctx context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
	if rec := recordFrom(ctx); rec != nil && !d.Allowed {
		rec.Denials = append(rec.Denials, denial{
			AtMS: d.At.UnixMilli(), ServerMS: d.ServerTime.UnixMilli(),
			RetryAfterMS: d.RetryAfter.Milliseconds(), Reserved: d.Reserved})
	}
}

// payload is the payload of a benchmark task. The tenant also travels in the task
// header (producer.TenantHeader), where the throttles read it.
type payload struct {
	Tenant string `json:"tenant"`
	Seq    int    `json:"seq"`
}

type recordKey struct{}

// recordFrom returns the record of the delivery whose handler chain got ctx, or nil.
// Only the goroutine of that delivery touches it.
func recordFrom(ctx context.Context) *record {
	r, _ := ctx.Value(recordKey{}).(*record)
	return r
}

// recordWriter writes a worker's records, one JSON line each, to the parent.
type recordWriter struct {
	mu     sync.Mutex
	w      *bufio.Writer
	worker int
	err    error // the first write error
}

// middleware is the outermost handler: it gives each delivery a record, lets the rest
// of the chain fill it, decides its outcome from the error returned, and writes it.
func (o *recordWriter) middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		rec := &record{Worker: o.worker, ID: id, StartMS: time.Now().UnixMilli()}
		var p payload
		if err := json.Unmarshal(task.Payload(), &p); err == nil {
			rec.Seq = p.Seq
		}
		rec.Tenant, _ = producer.Tenant(task)
		err := next.ProcessTask(context.WithValue(ctx, recordKey{}, rec), task)
		now := time.Now()
		rec.EndMS = now.UnixMilli()
		var denied *throttle.DeniedError
		var limited *RateLimitError
		switch {
		case err == nil:
			rec.Outcome = outcomeRan
			if rec.AtMS == 0 {
				rec.AtMS = rec.StartMS // an unthrottled task (none in this benchmark)
			}
		case errors.As(err, &denied):
			rec.Outcome = outcomeRequeued
			rec.WakeMS = denied.RetryAt.UnixMilli()
		case errors.As(err, &limited):
			rec.Outcome = outcomeRequeued
			rec.WakeMS = rec.Denials[len(rec.Denials)-1].AtMS + limited.RetryIn.Milliseconds()
		default:
			rec.Outcome = outcomeError
			rec.Err = err.Error()
		}
		o.write(rec)
		return err
	})
}

// write sends rec to the parent at once: the parent counts completions while the run
// goes on, to keep the backlogs topped up.
func (o *recordWriter) write(rec *record) {
	b, err := json.Marshal(rec)
	if err != nil {
		panic(err) // a record always marshals
	}
	o.line(string(b))
}

func (o *recordWriter) line(s string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err != nil {
		return
	}
	if _, err := o.w.WriteString(s + "\n"); err != nil {
		o.err = err
		return
	}
	o.err = o.w.Flush()
}

func (o *recordWriter) flush() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err != nil {
		return o.err
	}
	return o.w.Flush()
}

// asynqLogger is asynq's Logger, writing through a *log.Logger.
type asynqLogger struct{ l *log.Logger }

var _ asynq.Logger = asynqLogger{}

func (a asynqLogger) Debug(args ...any) { a.l.Print(append([]any{"asynq debug: "}, args...)...) }
func (a asynqLogger) Info(args ...any)  { a.l.Print(append([]any{"asynq info: "}, args...)...) }
func (a asynqLogger) Warn(args ...any)  { a.l.Print(append([]any{"asynq warning: "}, args...)...) }
func (a asynqLogger) Error(args ...any) { a.l.Print(append([]any{"asynq error: "}, args...)...) }
func (a asynqLogger) Fatal(args ...any) { a.l.Fatal(append([]any{"asynq fatal: "}, args...)...) }
