package worker_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
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

// The two-process backpressure test: TestBackpressure_pausesTenantAcrossProcesses runs
// one asynq server itself and a second one in a child process, this test binary run
// again as TestBackpressureChild (told by the environment variable bpChildEnv that it is
// a child). Both servers run the middleware on one Redis, so a pause that one process
// writes must hold in the other: issue 8's "a 429 with Retry-After: 3 pauses a tenant on
// two worker processes for 3 s".

// bpChildEnv carries a JSON bpChildConfig; it is set only in the child.
const bpChildEnv = "WORKER_BACKPRESSURE_CHILD"

// bpChildConfig tells the child what to run.
type bpChildConfig struct {
	Addr     string // Redis
	Queue    string // the one queue the child's server works
	TaskType string
	Rules    string // THROTTLE_RULES text
	StartMS  int64  // Unix ms: the parent's start; the child reports its instants from it
}

// bpRun is one handler run, in either process.
type bpRun struct {
	proc, tenant, task string
	at                 time.Duration // since bpChildConfig.StartMS's instant, µs precision
}

// TestBackpressureChild is the child process of
// TestBackpressure_pausesTenantAcrossProcesses. Unless the environment says it is a
// child, it does nothing. A child runs an asynq server with the middleware on the queue
// of its config and prints "ready" once it has started, then one line per handler run,
// "run <tenant> <payload> <µs since StartMS>" (its handler succeeds at once). When its
// stdin closes, it shuts the server down, prints "outcomes <fmtOutcomes of the task
// type>" and returns.
func TestBackpressureChild(t *testing.T) {
	env := os.Getenv(bpChildEnv)
	if env == "" {
		return // not a child: nothing to do
	}
	var cfg bpChildConfig
	if err := json.Unmarshal([]byte(env), &cfg); err != nil {
		t.Fatalf("%s=%q: %v", bpChildEnv, env, err)
	}
	start := time.UnixMilli(cfg.StartMS)
	rdb := redis.NewClient(&redis.Options{Addr: cfg.Addr})
	defer rdb.Close()
	m, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, cfg.Rules), Redis: rdb, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex // one line at a time on stdout
	handler := func(ctx context.Context, task *asynq.Task) error {
		at := time.Since(start)
		tenant, _ := producer.Tenant(task)
		mu.Lock()
		defer mu.Unlock()
		fmt.Printf("run %s %s %d\n", tenant, task.Payload(), at.Microseconds())
		return nil
	}
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{
		Concurrency:              10,
		Queues:                   map[string]int{cfg.Queue: 1},
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          2 * time.Second,
		LogLevel:                 asynq.FatalLevel,
	}))
	if err := srv.Start(mw(asynq.HandlerFunc(handler))); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	fmt.Println("ready")
	mu.Unlock()
	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it (or dies)
	srv.Shutdown()
	fmt.Printf("outcomes %s\n", fmtOutcomes(outcomes(t, m, cfg.TaskType)))
}

// TestBackpressure_pausesTenantAcrossProcesses: two worker processes on one Redis, this
// one working queue "a", a child (TestBackpressureChild) working queue "b", rule
// "bp:call tenant=100/1s". The parent's handler returns worker.Backpressure for a 429
// with Retry-After: 3 on acme's first run, once; every other run succeeds. Then:
//   - acme's log is paused until exactly the error's RetryAt, 3s after the 429;
//   - acme's tasks enqueued during the pause (acme/2 on a, acme/3 on b) and acme/1 run 0
//     times in either process from the 429's instant to the pause's end, and each is
//     denied once as paused: the child counts exactly 1 paused and 2 admitted decisions,
//     the parent 1 backpressure, 2 admitted after the pause, 1 paused, 1 for globex/1;
//   - globex's tasks enqueued during the pause, one per process, each run exactly once,
//     inside the pause window, in the process whose queue holds it;
//   - every task runs to success exactly once (acme/1 twice in all, its first run
//     refused), and acme/1's Retried is 0 of its MaxRetry 3; nothing is archived.
func TestBackpressure_pausesTenantAcrossProcesses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	const rule = "bp:call tenant=100/1s"
	start := time.Now()

	// The child, killed if it overruns: the test takes ~5s (3s of pause) when well.
	cctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	cfg, err := json.Marshal(bpChildConfig{Addr: srv.Addr, Queue: "b", TaskType: "bp:call", Rules: rule, StartMS: start.UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	start = time.UnixMilli(start.UnixMilli()) // the child's origin, to the ms
	child := exec.CommandContext(cctx, os.Args[0], "-test.run=^TestBackpressureChild$", "-test.count=1")
	child.Env = append(os.Environ(), bpChildEnv+"="+string(cfg))
	var stderr bytes.Buffer
	child.Stderr = &stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		runs     []bpRun
		outcome  string // the child's "outcomes" line
		lines    []string
		ready    = make(chan struct{})
		readDone = make(chan struct{})
	)
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			f := strings.Fields(line)
			mu.Lock()
			lines = append(lines, line)
			switch {
			case line == "ready":
				close(ready)
			case len(f) == 4 && f[0] == "run":
				us, err := strconv.ParseInt(f[3], 10, 64)
				if err == nil {
					runs = append(runs, bpRun{proc: "child", tenant: f[1], task: f[2], at: time.Duration(us) * time.Microsecond})
				}
			case len(f) >= 1 && f[0] == "outcomes":
				outcome = strings.TrimPrefix(line, "outcomes ")
			}
			mu.Unlock()
		}
	}()
	stopChild := func() error {
		stdin.Close()
		<-readDone
		return child.Wait()
	}
	childStopped := false
	t.Cleanup(func() {
		if !childStopped {
			_ = stopChild()
		}
	})
	select {
	case <-ready:
	case <-time.After(20 * time.Second):
		t.Fatalf("the child never started its server; stderr:\n%s", stderr.String())
	}

	// The parent's worker: acme's first run gets the 429.
	var refusedAt time.Duration
	bpErrs := make(chan *worker.BackpressureError, 1)
	refusedOnce := false
	handler := func(ctx context.Context, task *asynq.Task) error {
		at := time.Since(start)
		tenant, _ := producer.Tenant(task)
		mu.Lock()
		defer mu.Unlock()
		if tenant == "acme" && !refusedOnce {
			refusedOnce, refusedAt = true, at
			err := worker.Backpressure(&http.Response{StatusCode: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"3"}}})
			var bp *worker.BackpressureError
			if errors.As(err, &bp) {
				bpErrs <- bp
			}
			return err
		}
		runs = append(runs, bpRun{proc: "parent", tenant: tenant, task: string(task.Payload()), at: at})
		return nil
	}
	lim := newLimiter(t, rdb)
	m, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(lim, worker.Config{Rules: mustRules(t, rule), Redis: rdb, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	runAsynq(t, rdb, mw, handler, func(c *asynq.Config) { c.Queues = map[string]int{"a": 1} })
	client := asynq.NewClientFromRedisClient(rdb)
	t.Cleanup(func() { client.Close() })
	enqueue := func(tenant, name, queue string) string {
		t.Helper()
		info, err := producer.Enqueue(ctx, client, "bp:call", []byte(name), tenant, asynq.Queue(queue), asynq.MaxRetry(3), asynq.Retention(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		return info.ID
	}

	first := enqueue("acme", "acme/1", "a")
	var bp *worker.BackpressureError
	select {
	case bp = <-bpErrs:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never returned the 429's error")
	}
	if bp.StatusCode != 429 || bp.RetryAfter != 3*time.Second || bp.Scope != throttle.ScopeTenant {
		t.Fatalf("BackpressureError = %+v; want 429, RetryAfter 3s, the tenant's scope", *bp)
	}
	acme := throttle.Key{TaskType: "bp:call", Tenant: "acme"}
	var until time.Time
	waitUntil(t, 5*time.Second, "acme's log is paused", func() bool {
		u, ok, err := lim.PausedUntil(ctx, acme, throttle.ScopeTenant)
		until = u
		return err == nil && ok
	})
	if want := time.UnixMilli(bp.RetryAt.UnixMilli()); !until.Equal(want) {
		t.Fatalf("acme paused until %s, want the error's RetryAt %s", until.Format(time.RFC3339Nano), want.Format(time.RFC3339Nano))
	}
	pauseEnd := until.Sub(start)
	mu.Lock()
	pauseStart := refusedAt
	mu.Unlock()
	if d := pauseEnd - pauseStart; d < 3*time.Second-time.Millisecond || d > 4*time.Second {
		// The pause is 3s from the error's instant (RetryAt, stored to the ms), which
		// follows the handler's instant by a few µs; up to a second more on a loaded
		// machine.
		t.Fatalf("the pause ends %s after the 429, want 3s (up to 4s on a loaded machine)", d)
	}

	// During the pause: one acme task and one globex task for each process.
	enqueue("acme", "acme/2", "a")
	enqueue("acme", "acme/3", "b")
	enqueue("globex", "globex/1", "a")
	enqueue("globex", "globex/2", "b")
	enqueuedBy := time.Since(start)
	if enqueuedBy >= pauseEnd {
		t.Fatalf("the tasks were enqueued %s after the pause's end; the machine is too loaded for this test", enqueuedBy-pauseEnd)
	}
	want := map[string]string{"acme/1": "parent", "acme/2": "parent", "acme/3": "child", "globex/1": "parent", "globex/2": "child"}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	waitUntil(t, 15*time.Second, "every task completed", func() bool {
		n := 0
		for _, q := range []string{"a", "b"} {
			qi, err := insp.GetQueueInfo(q)
			if err != nil {
				return false
			}
			n += qi.Completed
		}
		return n == len(want)
	})
	time.Sleep(300 * time.Millisecond) // a duplicate run, if any, shows up
	childStopped = true
	if err := stopChild(); err != nil {
		t.Fatalf("child: %v\nstdout:\n%s\nstderr:\n%s", err, strings.Join(lines, "\n"), stderr.String())
	}

	mu.Lock()
	defer mu.Unlock()
	got := map[string][]bpRun{}
	inPause := map[string]int{} // tenant -> runs from the 429 to the pause's end, either process
	for _, r := range runs {
		got[r.task] = append(got[r.task], r)
		if r.at >= pauseStart && r.at < pauseEnd {
			inPause[r.tenant]++
		}
	}
	for task, proc := range want {
		if rs := got[task]; len(rs) != 1 || rs[0].proc != proc {
			t.Errorf("task %s's successful runs: %+v; want exactly 1, in the %s", task, rs, proc)
		}
	}
	if len(runs) != len(want) {
		t.Errorf("%d successful handler runs in all, want %d: %+v", len(runs), len(want), runs)
	}
	if inPause["acme"] != 0 || inPause["globex"] != 2 {
		t.Errorf("handler runs from the 429 (%s) to the pause's end (%s): acme %d, globex %d; want 0 and 2 (one per process)\nruns: %+v",
			pauseStart, pauseEnd, inPause["acme"], inPause["globex"], runs)
	}
	for _, task := range []string{"acme/1", "acme/2", "acme/3"} {
		if rs := got[task]; len(rs) == 1 && rs[0].at < pauseEnd {
			t.Errorf("%s ran at %s, before the pause's end %s", task, rs[0].at, pauseEnd)
		}
	}
	info, err := insp.GetTaskInfo("a", first)
	if err != nil {
		t.Fatal(err)
	}
	if info.State != asynq.TaskStateCompleted || info.Retried != 0 || info.MaxRetry != 3 {
		t.Errorf("acme/1 after its 429: state %s, Retried %d, MaxRetry %d; want completed, 0, 3", info.State, info.Retried, info.MaxRetry)
	}
	for q, wantCompleted := range map[string]int{"a": 3, "b": 2} {
		qi, err := insp.GetQueueInfo(q)
		if err != nil {
			t.Fatal(err)
		}
		if qi.Archived != 0 || qi.Completed != wantCompleted || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
			t.Errorf("queue %s: archived %d completed %d pending %d active %d scheduled %d retry %d; want 0 archived, %d completed, nothing left",
				q, qi.Archived, qi.Completed, qi.Pending, qi.Active, qi.Scheduled, qi.Retry, wantCompleted)
		}
	}
	// Parent: acme/1 admitted, backpressure, admitted again; acme/2 paused, then
	// admitted; globex/1 admitted. Child: acme/3 paused, then admitted; globex/2 admitted.
	wantParent := wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 4, worker.OutcomeBackpressure: 1, worker.OutcomePaused: 1})
	if got := outcomes(t, m, "bp:call"); fmtOutcomes(got) != fmtOutcomes(wantParent) {
		t.Errorf("parent's decisions:\n got  %s\n want %s", fmtOutcomes(got), fmtOutcomes(wantParent))
	}
	wantChild := fmtOutcomes(wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 2, worker.OutcomePaused: 1}))
	if outcome != wantChild {
		t.Errorf("child's decisions:\n got  %s\n want %s", outcome, wantChild)
	}
}
