package worker_test

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestRedisOutage stops the one Redis that asynq and the limiter share while 2 tenants x
// 20 tasks run under "tenant=5/1s", restarts it 2s later (AOF, fsync always: nothing
// acknowledged is lost), and checks that no task is lost or archived, that the decisions
// asked for during the outage were made once Redis was back (by the one task that probed
// it meanwhile, or after the others' re-queue), and that
// every admission the limiter recorded belongs to a handler run, and every run to an
// admission.
//
// The rule carries a second quota, tenant=1000/1h, that never binds: quotas at one scope
// share one window log, trimmed by the longest window, so the tenant's log keeps every
// admission of the run for the audit instead of the last second only.
//
// The outage is staged so that asynq itself writes nothing during it. asynq v0.26.0
// cannot re-sync a write that failed: processor.go's markAsComplete, markAsDone, retry
// and archive hand the syncer a closure over a context they cancel on return (defer
// cancel()), so every re-sync fails and the task stays active until the recoverer, which
// runs every minute, finds its lease expired for 30s: about 1-2 minutes after the outage,
// and then it runs again as a failure (Retried+1, archived if it had no retry left). So
// every task that has been through the throttle waits (gate) to return to asynq until
// Redis is back, and the tasks dequeued after the first 10 wait to enter the throttle
// until Redis is down: they ask the limiter during the outage.
func TestRedisOutage(t *testing.T) {
	t.Parallel()
	args := []string{"--appendonly", "yes", "--appendfsync", "always"}
	redisSrv := redistest.StartServer(t, args...)
	rdb := redisSrv.Client()
	lim := newLimiter(t, rdb)
	const (
		taskType    = "o:call"
		perTenant   = 20
		concurrency = 20
		firstWave   = 10 // tasks that enter the throttle before the outage
	)
	tenants := []string{"acme", "globex"}

	type run struct {
		id       string
		tenant   string
		at       time.Time // Decision.At of the admission
		replay   bool      // the admission was found again after a lost reply
		admitted bool      // the handler got an admitting Decision
	}
	var mu sync.Mutex
	var runs []run
	allowed := map[string]int{}             // tenant -> admitting decisions (replays included)
	replays := map[string]int{}             // tenant -> admitting decisions that were replays
	firstDecision := map[string]time.Time{} // task id -> instant of its first decision
	metrics, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	throttleMW, err := worker.New(lim, worker.Config{
		Rules:   mustRules(t, taskType+" tenant=5/1s tenant=1000/1h"),
		Redis:   rdb,
		Metrics: metrics,
		DecisionFunc: func(_ context.Context, task *asynq.Task, key throttle.Key, d throttle.Decision) {
			mu.Lock()
			defer mu.Unlock()
			if _, ok := firstDecision[string(task.Payload())]; !ok {
				firstDecision[string(task.Payload())] = time.Now()
			}
			if !d.Allowed {
				return
			}
			allowed[key.Tenant]++
			if d.Replay {
				replays[key.Tenant]++
			}
		},
		Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	var entered, paused, held atomic.Int32
	var inOutage sync.Map // task id -> true: entered the throttle while Redis was down
	stopped, restarted := make(chan struct{}), make(chan struct{})
	stage := func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			if entered.Add(1) > firstWave {
				paused.Add(1)
				<-stopped
				paused.Add(-1)
				inOutage.Store(string(task.Payload()), true)
			}
			err := next.ProcessTask(ctx, task)
			held.Add(1)
			<-restarted
			held.Add(-1)
			return err
		})
	}
	runAsynq(t, rdb, func(h asynq.Handler) asynq.Handler { return stage(throttleMW(h)) }, func(ctx context.Context, task *asynq.Task) error {
		d, ok := worker.DecisionFrom(ctx)
		tenant, _ := producer.Tenant(task)
		mu.Lock()
		runs = append(runs, run{id: string(task.Payload()), tenant: tenant, at: d.At, replay: d.Replay, admitted: ok && d.Allowed})
		mu.Unlock()
		time.Sleep(50 * time.Millisecond)
		return nil
	}, func(cfg *asynq.Config) { cfg.Concurrency = concurrency })

	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	var ids []string
	for i := 1; i <= perTenant; i++ {
		for _, tenant := range tenants {
			id := fmt.Sprintf("%s-%02d", tenant, i)
			ids = append(ids, id)
			if _, err := producer.Enqueue(context.Background(), client, taskType, []byte(id), tenant,
				asynq.TaskID(id), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
	}
	nRuns := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(runs)
	}
	// Every worker slot is taken (by a task held after the throttle or one waiting to
	// enter it): nothing is dequeued or written any more.
	waitUntil(t, 20*time.Second, "every worker slot holds a staged task", func() bool {
		return held.Load()+paused.Load() == concurrency
	})
	ranBefore, pausedAtStop := nRuns(), paused.Load()
	redisSrv.Stop()
	close(stopped) // the paused tasks now ask the limiter, which cannot answer
	time.Sleep(2 * time.Second)
	// Redis can answer no call before its process starts again: the instant the outage
	// ends for the checks below. Not when Restart returns: its own client's PING may see
	// Redis later than the shared client does (go-redis backs off its dials after
	// failures), and a probe decided in between is right (seen once in CI: 2.2s later).
	restartedAt := time.Now()
	redisSrv.Restart(args...)
	// go-redis, after failing to dial PoolSize times, answers with its last dial error
	// without dialing until a background dial succeeds (up to ~1s after Redis is back);
	// a write asynq made then would be lost as above. Let the shared pool see Redis first.
	waitUntil(t, 10*time.Second, "the shared client reaches Redis again", func() bool {
		return rdb.Ping(context.Background()).Err() == nil
	})
	// The one task probing the limiter (the others were re-queued at once) is decided once
	// its next attempt reaches Redis, within its backoff (<= 1s); until then the limiter
	// is down for the middleware, and the tasks asynq would dequeue next would be
	// re-queued too. Let it see Redis first, so that the count below is exact.
	waitUntil(t, 10*time.Second, "the probe is decided", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, at := range firstDecision {
			if !at.Before(restartedAt) {
				return true
			}
		}
		return false
	})
	close(restarted)
	t.Logf("Redis stopped after %d handler runs with %d tasks about to ask the limiter; restarted 2s later", ranBefore, pausedAtStop)
	if ranBefore < firstWave/2 || pausedAtStop < 1 {
		t.Errorf("outage staged after %d runs with %d tasks waiting to enter the throttle; want >= %d and >= 1",
			ranBefore, pausedAtStop, firstWave/2)
	}

	t.Cleanup(func() { // on failure, say where each unfinished task is
		if !t.Failed() {
			return
		}
		for _, id := range ids {
			if ti, err := insp.GetTaskInfo("default", id); err != nil || ti.State != asynq.TaskStateCompleted {
				t.Logf("task %s not completed: %+v, %v", id, ti, err)
			}
		}
	})
	waitUntil(t, 40*time.Second, "all 40 tasks completed", func() bool {
		qi := queueInfo(insp)
		return qi.Completed+qi.Archived == len(ids) && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0
	})
	time.Sleep(300 * time.Millisecond) // let a late duplicate run, if any, show up

	qi := queueInfo(insp)
	if qi.Archived != 0 || qi.Completed != len(ids) {
		t.Errorf("queue: %d completed, %d archived; want %d completed, none archived", qi.Completed, qi.Archived, len(ids))
	}
	// Of the tasks that asked the limiter during the outage, one (the probe) kept asking
	// until Redis came back (UnavailableWait 5s > the outage); the others were re-queued
	// at once, as unavailable, and decided when they came back.
	if got, want := toFloat64(t, metrics.Decisions.WithLabelValues(taskType, worker.OutcomeUnavailable)), float64(pausedAtStop-1); got != want {
		t.Errorf("%g decisions given up as unavailable, want %g (all but the probe of the %d that asked during the outage)", got, want, pausedAtStop)
	}
	mu.Lock()
	defer mu.Unlock()
	inOutage.Range(func(k, _ any) bool {
		if at := firstDecision[k.(string)]; at.Before(restartedAt) {
			t.Errorf("task %s asked during the outage got its first decision at %s, before Redis was back at %s",
				k, at.Format("15:04:05.000"), restartedAt.Format("15:04:05.000"))
		}
		return true
	})
	perID := map[string]int{}
	for _, r := range runs {
		perID[r.id]++
		if !r.admitted {
			t.Errorf("task %s ran without an admission", r.id)
		}
	}
	for _, id := range ids {
		switch n := perID[id]; {
		case n == 0:
			t.Errorf("task %s never ran: lost", id)
		case n > 1:
			// asynq delivers at least once: a run whose completion could not be written
			// is run again once asynq's recoverer finds its lease expired.
			t.Logf("task %s ran %d times: asynq redelivered it (its completion was not recorded)", id, n)
		}
	}
	for _, tenant := range tenants {
		logKey := lim.RedisKey(throttle.Key{TaskType: taskType, Tenant: tenant}, throttle.ScopeTenant)
		logged := admissions(t, rdb, logKey) // every admission of the run, in ms
		var mine []run
		for _, r := range runs {
			if r.tenant == tenant {
				mine = append(mine, r)
			}
		}
		// Every admission is a run and every run an admission: no slot was taken by a
		// task that did not run (a decision whose reply was lost is replayed, not made
		// twice), no task ran past the limiter, and the admissions made before the
		// outage survived it.
		if len(logged) != len(mine) || allowed[tenant] != len(mine) {
			t.Errorf("tenant %s: %d admissions in the log, %d admitting decisions, %d handler runs; want all equal",
				tenant, len(logged), allowed[tenant], len(mine))
		}
		// A run's Decision.At is its admission's score, except for a replay (At is then
		// the instant of the replaying call): match the others exactly.
		left := map[int64]int{}
		for _, s := range logged {
			left[s]++
		}
		unmatched := 0
		for _, r := range mine {
			if r.replay {
				unmatched++
				continue
			}
			if ms := r.at.UnixMilli(); left[ms] > 0 {
				left[ms]--
			} else {
				t.Errorf("tenant %s: run of %s admitted at %d has no admission in the log", tenant, r.id, ms)
			}
		}
		rest := 0
		for _, n := range left {
			rest += n
		}
		if rest != unmatched {
			t.Errorf("tenant %s: %d logged admissions match no run, want %d (one per replayed run)", tenant, rest, unmatched)
		}
		if replays[tenant] > 0 {
			t.Logf("tenant %s: %d admissions were replayed after a lost reply", tenant, replays[tenant])
		}
		var ts []time.Time
		for _, s := range logged {
			ts = append(ts, time.UnixMilli(s))
		}
		if got := throttle.MaxInWindow(ts, time.Second); got > 5 {
			t.Errorf("tenant %s: %d admissions within 1s, limit 5", tenant, got)
		}
	}
}

// TestLimiterDown runs tasks while the limiter's own Redis (not asynq's) is stopped.
// FailOpen: the task runs unthrottled, counted as failed_open. Fail closed (the default):
// it does not run, waits in state retry with its retry budget untouched (or, with no retry
// left, as a copy), is never archived, and runs once the limiter's Redis is back.
func TestLimiterDown(t *testing.T) {
	t.Parallel()
	t.Run("FailOpen", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		limSrv := redistest.StartServer(t)
		lim := newLimiter(t, limSrv.Client())
		limSrv.Stop()
		metrics, err := worker.NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		logs := &syncBuffer{}
		mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "fo:call tenant=1/1m"), Redis: rdb, FailOpen: true,
			UnavailableWait: 300 * time.Millisecond, Metrics: metrics, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var decided []bool // per run: did the handler get a Decision?
		runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
			_, ok := worker.DecisionFrom(ctx)
			mu.Lock()
			defer mu.Unlock()
			decided = append(decided, ok)
			return nil
		}, nil)
		client := asynq.NewClientFromRedisClient(rdb)
		insp := asynq.NewInspectorFromRedisClient(rdb)
		// Two tasks against a limit of 1: both run, the limiter being unreachable.
		for _, id := range []string{"a", "b"} {
			if _, err := producer.Enqueue(context.Background(), client, "fo:call", nil, "acme",
				asynq.TaskID(id), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
		waitUntil(t, 10*time.Second, "both tasks completed", func() bool { return queueInfo(insp).Completed == 2 })
		mu.Lock()
		if !reflect.DeepEqual(decided, []bool{false, false}) {
			t.Errorf("runs got a Decision: %v, want two runs without one (unthrottled)", decided)
		}
		mu.Unlock()
		want := wantOutcomes(map[string]float64{worker.OutcomeFailedOpen: 2})
		if got := outcomes(t, metrics, "fo:call"); !reflect.DeepEqual(got, want) {
			t.Errorf("outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
		}
		warned := 0
		for _, rec := range logs.records(t) {
			if rec["level"] == "WARN" && strings.Contains(fmt.Sprint(rec["msg"]), "FailOpen") && rec["tenant"] == "acme" {
				warned++
			}
		}
		if warned != 2 {
			t.Errorf("%d fail-open warnings logged, want 2: %v", warned, logs.records(t))
		}
	})

	t.Run("FailClosed", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		limSrv := redistest.StartServer(t)
		lim := newLimiter(t, limSrv.Client())
		limSrv.Stop()
		metrics, err := worker.NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, "fc:retry tenant=5/1m; fc:zero tenant=5/1m"), Redis: rdb,
			UnavailableWait: 300 * time.Millisecond, Metrics: metrics, Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil))})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		ran := map[string]int{}      // task type -> runs
		attempts := map[string]int{} // task type -> attempts (asynq deliveries)
		count := func(next asynq.Handler) asynq.Handler {
			return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
				mu.Lock()
				attempts[task.Type()]++
				mu.Unlock()
				return next.ProcessTask(ctx, task)
			})
		}
		// While the limiter is down each attempt ends unavailable. How many attempts that
		// is depends on how long go-redis takes to fail (it retries its dials), so the
		// counts are checked against the attempts seen.
		unavailable := func(typ string) (got float64, want int) {
			mu.Lock()
			defer mu.Unlock()
			return toFloat64(t, metrics.Decisions.WithLabelValues(typ, worker.OutcomeUnavailable)), attempts[typ] - ran[typ]
		}
		runAsynq(t, rdb, func(h asynq.Handler) asynq.Handler { return count(mw(h)) }, func(ctx context.Context, task *asynq.Task) error {
			if d, ok := worker.DecisionFrom(ctx); !ok || !d.Allowed {
				t.Errorf("%s ran without an admission", task.Type())
			}
			mu.Lock()
			defer mu.Unlock()
			ran[task.Type()]++
			return nil
		}, nil)
		client := asynq.NewClientFromRedisClient(rdb)
		insp := asynq.NewInspectorFromRedisClient(rdb)
		for _, tc := range []struct {
			typ, id  string
			maxRetry int
		}{{"fc:retry", "r", 3}, {"fc:zero", "z", 0}} {
			if _, err := producer.Enqueue(context.Background(), client, tc.typ, nil, "acme",
				asynq.TaskID(tc.id), asynq.MaxRetry(tc.maxRetry), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
		info := func(id string) *asynq.TaskInfo {
			ti, err := insp.GetTaskInfo("default", id)
			if err != nil {
				return &asynq.TaskInfo{}
			}
			return ti
		}
		// zCopy returns the latest copy of z (each attempt while the limiter is down
		// replaces it by the next: z:deferred:1, z:deferred:2, ...).
		zCopy := func() *asynq.TaskInfo {
			latest := &asynq.TaskInfo{}
			for n := 1; n <= 9; n++ {
				if ti := info(fmt.Sprintf("z:deferred:%d", n)); ti.ID != "" {
					latest = ti
				}
			}
			return latest
		}
		waitUntil(t, 10*time.Second, "r waits in retry and z's copy is scheduled", func() bool {
			return info("r").State == asynq.TaskStateRetry && zCopy().State == asynq.TaskStateScheduled
		})
		r := info("r")
		if r.Retried != 0 || r.MaxRetry != 3 || !strings.Contains(r.LastErr, worker.ErrUnavailable.Error()) {
			t.Errorf("r: Retried %d, MaxRetry %d, LastErr %q; want 0, 3, and %q", r.Retried, r.MaxRetry, r.LastErr, worker.ErrUnavailable)
		}
		if _, err := insp.GetTaskInfo("default", "z"); err == nil {
			t.Errorf("z: still there after its copy was enqueued")
		}
		mu.Lock()
		if len(ran) != 0 {
			t.Errorf("handler ran while the limiter was down (fail closed): %v", ran)
		}
		mu.Unlock()
		for _, typ := range []string{"fc:retry", "fc:zero"} {
			if got, want := unavailable(typ); got != float64(want) || want < 1 {
				t.Errorf("%s: unavailable = %g after %d attempts while the limiter was down, want one per attempt", typ, got, want)
			}
		}

		limSrv.Restart()
		waitUntil(t, 15*time.Second, "both tasks completed after the limiter came back", func() bool {
			return info("r").State == asynq.TaskStateCompleted && zCopy().State == asynq.TaskStateCompleted
		})
		if r := info("r"); r.Retried != 0 {
			t.Errorf("r completed with Retried %d, want 0", r.Retried)
		}
		if z := zCopy(); z.MaxRetry != 0 || z.Retried != 0 || z.Headers[worker.HeaderOriginID] != "z" {
			t.Errorf("z's copy: MaxRetry %d, Retried %d, headers %v; want 0, 0, origin z", z.MaxRetry, z.Retried, z.Headers)
		}
		if qi := queueInfo(insp); qi.Archived != 0 {
			t.Errorf("%d tasks archived, want 0", qi.Archived)
		}
		mu.Lock()
		if ran["fc:retry"] != 1 || ran["fc:zero"] != 1 {
			t.Errorf("runs %v, want one of each", ran)
		}
		mu.Unlock()
		for _, typ := range []string{"fc:retry", "fc:zero"} {
			got := outcomes(t, metrics, typ)
			u, want := unavailable(typ)
			if got[worker.OutcomeAdmitted] != 1 || u != float64(want) || got[worker.OutcomeFailedOpen] != 0 || got[worker.OutcomeRejected] != 0 ||
				got[worker.OutcomeDenied] != 0 || got[worker.OutcomeOverdue] != 0 {
				t.Errorf("%s outcomes: %s; want admitted 1 and one unavailable per attempt before it (%d)", typ, fmtOutcomes(got), want)
			}
			t.Logf("%s outcomes: %s", typ, fmtOutcomes(got))
		}
	})
}

// inFlight is a go-redis hook that counts the commands in flight on a client (a command
// is in flight from its call to its reply or error, go-redis's own retries included), and
// the most in flight at once among those that started after the first command failed
// while counting was on: the middleware can only learn that Redis is down from a failed
// call, so the calls already in flight then (up to one per worker slot) are not its doing.
type inFlight struct {
	on, failed atomic.Bool
	late, most atomic.Int32
}

func (h *inFlight) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *inFlight) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		defer h.enter()()
		return next(ctx, cmd)
	}
}

func (h *inFlight) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		defer h.enter()()
		return next(ctx, cmds)
	}
}

// enter counts a command that starts; the func it returns counts its end.
func (h *inFlight) enter() func() {
	if !h.on.Load() {
		return func() {}
	}
	if !h.failed.Load() {
		return func() { h.failed.Store(true) } // a command in flight at the outage's start: it fails
	}
	n := h.late.Add(1)
	for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
	}
	return func() { h.late.Add(-1) }
}

// TestLimiterDown_probe is issue 9's capability 5b: with the limiter on its own Redis
// stopped for 30 s, 1000 "api:call" tasks (rule "tenant=5000/1s", which never binds: this
// is about the outage, not the throttle) and 1000 unruled
// "report:build" tasks, enqueued interleaved once it is down, on a server of Concurrency
// 10 (worker.Config.Concurrency 10). Each handler works 5ms. Then:
//   - all 1000 report:build tasks complete during the outage (the issue asks >= 990): at
//     most one task at a time asks the dead limiter (the probe, for up to UnavailableWait),
//     every other api:call is re-queued at once for UnavailableRetryDelay, so 9 worker slots
//     or more are left to report:build, whose 1000 x 5ms take about 0.6 s on them;
//   - once a call has failed, at most 1 command at a time is in flight to the limiter's
//     Redis during the outage (a go-redis hook on its client counts them; the sweep, which
//     would also ask it, is off); before, each worker slot's task may have asked it;
//   - no api:call runs during the outage (fail closed), none is archived, and none spends
//     a retry (Retried 0 on every completed task);
//   - all 1000 api:call tasks complete within 30 s of the limiter's return: each comes back
//     within UnavailableRetryDelay (5 s) plus the forwarder, and is admitted at once.
func TestLimiterDown_probe(t *testing.T) {
	t.Parallel()
	const (
		n       = 1000
		outage  = 30 * time.Second
		work    = 5 * time.Millisecond
		limited = "api:call"
		free    = "report:build"
	)
	rdb := redistest.Start(t)
	limSrv := redistest.StartServer(t)
	limRdb := limSrv.Client()
	hook := &inFlight{}
	limRdb.AddHook(hook)
	lim := newLimiter(t, limRdb)
	mw, err := worker.New(lim, worker.Config{
		Rules:         mustRules(t, limited+" tenant=5000/1s"),
		Redis:         rdb,
		Concurrency:   10,
		SweepInterval: -1,
		Logger:        slog.New(slog.NewTextHandler(&syncBuffer{}, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	done := map[string][]time.Time{} // task type -> the instants its handlers returned
	var callsStarted []time.Time
	runAsynq(t, rdb, mw, func(_ context.Context, task *asynq.Task) error {
		if task.Type() == limited {
			mu.Lock()
			callsStarted = append(callsStarted, time.Now())
			mu.Unlock()
		}
		time.Sleep(work)
		mu.Lock()
		done[task.Type()] = append(done[task.Type()], time.Now())
		mu.Unlock()
		return nil
	}, func(c *asynq.Config) { c.Concurrency = 10 })

	limSrv.Stop()
	hook.on.Store(true)
	stoppedAt := time.Now()
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range n {
		if _, err := producer.Enqueue(context.Background(), client, limited, []byte(fmt.Sprint(i)), "acme", asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
		if _, err := client.Enqueue(asynq.NewTask(free, []byte(fmt.Sprint(i))), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(time.Until(stoppedAt.Add(outage)))
	hook.on.Store(false)
	restarting := time.Now() // the limiter's Redis answers nothing before (see TestRedisOutage)
	limSrv.Restart()
	restartedAt := time.Now()

	count := func(typ string, before time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		k := 0
		for _, at := range done[typ] {
			if at.Before(before) {
				k++
			}
		}
		return k
	}
	if got := count(free, restartedAt); got != n {
		t.Errorf("%d %s tasks completed during the %s outage, want %d", got, free, outage, n)
	}
	mu.Lock()
	for _, at := range callsStarted {
		if at.Before(restarting) {
			t.Errorf("%s ran at %s, during the outage (fail closed: it must not run)", limited, at.Format("15:04:05.000"))
		}
	}
	mu.Unlock()
	if got := hook.most.Load(); got != 1 {
		t.Errorf("at most %d commands in flight at once to the limiter's Redis after the first failed, want 1 (one probe)", got)
	}

	insp := asynq.NewInspectorFromRedisClient(rdb)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("queue at the end: %+v", queueInfo(insp))
		}
	})
	waitUntil(t, 30*time.Second, "every task completed after the limiter came back", func() bool {
		qi := queueInfo(insp)
		return qi.Completed+qi.Archived == 2*n && qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0
	})
	t.Logf("%d %s tasks done %s after the limiter came back", n, limited, time.Since(restartedAt).Round(100*time.Millisecond))
	if qi := queueInfo(insp); qi.Archived != 0 || qi.Completed != 2*n {
		t.Errorf("queue: %d completed, %d archived; want %d completed, none archived", qi.Completed, qi.Archived, 2*n)
	}
	if got := count(limited, time.Now().Add(time.Hour)); got != n {
		t.Errorf("%s ran %d times, want %d (each once)", limited, got, n)
	}
	retried := 0
	for page := 1; page <= 2*n/500; page++ {
		tasks, err := insp.ListCompletedTasks("default", asynq.PageSize(500), asynq.Page(page))
		if err != nil {
			t.Fatal(err)
		}
		for _, ti := range tasks {
			retried += ti.Retried
		}
	}
	if retried != 0 {
		t.Errorf("the completed tasks spent %d retries in all, want 0", retried)
	}
}
