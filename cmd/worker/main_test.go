package main

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
)

// syncBuffer is a bytes.Buffer safe for the worker's goroutines and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// runningWorker is the worker's run in a goroutine, as the end-to-end tests start it.
type runningWorker struct {
	stdout, stderr syncBuffer
	cancel         context.CancelFunc
	exited         chan int // run's exit status
}

// startWorker runs the worker with the environment the test has set; the test's cleanup
// cancels it if the test did not stop it.
func startWorker(t *testing.T) *runningWorker {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w := &runningWorker{cancel: cancel, exited: make(chan int, 1)}
	go func() { w.exited <- run(ctx, nil, &w.stdout, &w.stderr) }()
	return w
}

// metricsURL waits up to 10s for the worker's startup line naming where it serves its
// metrics (METRICS_ADDR) and returns that URL.
func (w *runningWorker) metricsURL(t *testing.T) string {
	t.Helper()
	var url string
	waitFor(t, 10*time.Second, "the worker logs its metrics address", func() bool {
		m := metricsURL.FindStringSubmatch(w.stdout.String())
		if m != nil {
			url = m[1]
		}
		return m != nil
	})
	return url
}

// stop cancels the run, as SIGTERM does, and fails the test unless it exits 0 within limit.
func (w *runningWorker) stop(t *testing.T, limit time.Duration) {
	t.Helper()
	w.cancel()
	select {
	case code := <-w.exited:
		if code != exitOK {
			t.Errorf("exit status %d, want 0; stderr:\n%s", code, w.stderr.String())
		}
	case <-time.After(limit):
		t.Fatalf("worker did not stop within %s of cancel", limit)
	}
}

func TestRun_configErrorExits2(t *testing.T) {
	tests := []struct {
		env    []string
		args   []string
		stderr string // the whole of stderr
	}{
		{env: []string{"THROTTLE_RULES", "api:call tenant=5"},
			stderr: `THROTTLE_RULES="api:call tenant=5": worker: rule 1 "api:call tenant=5": quota "tenant=5": throttle: limit "5": want events/window, e.g. 5/2s` + "\n"},
		{env: []string{"WORKER_CONCURRENCY", "ten"}, stderr: `WORKER_CONCURRENCY="ten": not an integer` + "\n"},
		{env: []string{"REDIS_ADDR", "localhost"},
			stderr: `redisenv: REDIS_ADDR="localhost": "localhost" is not host:port: missing port in address` + "\n"},
		{env: []string{"REDIS_DB", "-1"}, stderr: `redisenv: REDIS_DB="-1": must be at least 0` + "\n"},
		{args: []string{"extra"},
			stderr: `worker: unexpected argument "extra": the worker is configured by environment variables (worker -h lists them)` + "\n"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(append(tc.env, tc.args...), "="), func(t *testing.T) {
			clearEnv(t, tc.env...)
			var stdout, stderr bytes.Buffer
			if code := run(context.Background(), tc.args, &stdout, &stderr); code != 2 {
				t.Errorf("exit status %d, want 2", code)
			}
			if stderr.String() != tc.stderr || stdout.Len() != 0 {
				t.Errorf("stderr %q\nwant   %q\nstdout %q, want none", stderr.String(), tc.stderr, stdout.String())
			}
		})
	}
}

func TestRun_help(t *testing.T) {
	clearEnv(t)
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-h"}, &stdout, &stderr); code != 0 {
		t.Errorf("exit status %d, want 0", code)
	}
	// Each variable has a line of its own: name, default (maybe none), and a meaning.
	for _, name := range envVars {
		line := regexp.MustCompile(`\n` + name + ` +(\S+ +)?(\S.*)\n`).FindStringSubmatch(stderr.String())
		if line == nil || len(line[2]) < 20 {
			t.Errorf("usage does not explain %s:\n%s", name, stderr.String())
		}
	}
	for _, want := range []string{`\nREDIS_ADDR +127\.0\.0\.1:6379 +host:port of Redis; `,
		`\nREDIS_PASSWORD +password of the Redis data nodes`,
		`\nExit status: 0 after a shutdown by SIGINT or SIGTERM; 1 if Redis does not answer within 5s at start`} {
		if !regexp.MustCompile(want).MatchString(stderr.String()) {
			t.Errorf("usage does not match %q:\n%s", want, stderr.String())
		}
	}
}

func TestRun_redisDownExits1(t *testing.T) {
	srv := redistest.StartServer(t)
	srv.Stop()
	clearEnv(t, "REDIS_ADDR", srv.Addr)
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), nil, &stdout, &stderr); code != 1 {
		t.Errorf("exit status %d, want 1", code)
	}
	if want := fmt.Sprintf("worker: Redis at REDIS_ADDR=%q does not answer: ", srv.Addr); !strings.HasPrefix(stderr.String(), want) {
		t.Errorf("stderr %q, want it to start with %q", stderr.String(), want)
	}
}

// TestRun_redisDBOutOfRangeExits2: REDIS_DB=99 on a Redis with 16 databases is a bad
// value, not an outage: exit status 2 and a message naming REDIS_DB.
func TestRun_redisDBOutOfRangeExits2(t *testing.T) {
	srv := redistest.StartServer(t)
	clearEnv(t, "REDIS_ADDR", srv.Addr, "REDIS_DB", "99")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), nil, &stdout, &stderr); code != 2 {
		t.Errorf("exit status %d, want 2", code)
	}
	want := `redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="` + srv.Addr + `" has no database 99 (ERR DB index is out of range); ` +
		`it has databases 0 to N-1, N its "databases" setting (16 by default)` + "\n"
	if stderr.String() != want || stdout.Len() != 0 {
		t.Errorf("stderr %q\nwant   %q\nstdout %q, want none", stderr.String(), want, stdout.String())
	}
}

// activityLine matches a per-interval line of the worker's log.
var activityLine = regexp.MustCompile(`^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (\S+) tenant="(\S+)" ran=(\d+) throttled=(\d+)( failed=\d+ last_error=".*"(\.\.\.\(\d+ bytes\))?)?$`)

// TestRun_archivedCounted: a task whose cost header cannot be read is archived by the
// middleware without running, and the worker's line says so: ran=0 throttled=0
// archived=1 (a trial found such tasks in no line at all).
func TestRun_archivedCounted(t *testing.T) {
	redisSrv := redistest.StartServer(t)
	clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "THROTTLE_RULES", "api:call tenant=5/1s cost=header:tokens")
	rdb := redisSrv.Client()
	w := startWorker(t)
	task := asynq.NewTaskWithHeaders("api:call", []byte("{}"), map[string]string{producer.TenantHeader: "acme", "tokens": "abc"})
	if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(task); err != nil {
		t.Fatal(err)
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if qi, err := insp.GetQueueInfo("default"); err == nil && qi.Archived == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s the task is not archived\nstdout:\n%s\nstderr:\n%s", w.stdout.String(), w.stderr.String())
		}
	}
	w.stop(t, 15*time.Second)
	if want := ` api:call tenant="acme" ran=0 throttled=0 archived=1` + "\n"; !strings.Contains(w.stdout.String(), want) {
		t.Errorf("stdout lacks %q:\n%s", want, w.stdout.String())
	}
}

// TestRun_endToEnd runs the worker against a throwaway redis-server with
// "api:call tenant=5/1s" and 3 tenants x 20 tasks: all 60 complete, none is archived or
// left behind, and the worker's lines count exactly 20 runs per tenant and some throttling.
func TestRun_endToEnd(t *testing.T) {
	redisSrv := redistest.StartServer(t)
	clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "THROTTLE_RULES", "api:call tenant=5/1s")
	rdb := redisSrv.Client()

	w := startWorker(t)
	ctx, stdout, stderr := context.Background(), &w.stdout, &w.stderr

	client := asynq.NewClientFromRedisClient(rdb)
	tenants := []string{"acme", "globex", "initech"}
	for i := 1; i <= 20; i++ {
		for _, tenant := range tenants {
			payload := []byte(fmt.Sprintf(`{"seq":%d}`, i))
			// Retention keeps completed tasks, so the Inspector counts them exactly.
			if _, err := producer.Enqueue(ctx, client, "api:call", payload, tenant, asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
	}

	insp := asynq.NewInspectorFromRedisClient(rdb)
	start := time.Now()
	deadline := start.Add(60 * time.Second)
	var qi *asynq.QueueInfo
	for {
		var err error
		if qi, err = insp.GetQueueInfo("default"); err != nil {
			t.Fatal(err)
		}
		if qi.Completed+qi.Archived >= 60 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 60s: completed=%d archived=%d pending=%d active=%d scheduled=%d retry=%d\nstdout:\n%s\nstderr:\n%s",
				qi.Completed, qi.Archived, qi.Pending, qi.Active, qi.Scheduled, qi.Retry, stdout.String(), stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("60 tasks completed in %s", time.Since(start).Round(100*time.Millisecond))
	if qi.Completed != 60 || qi.Archived != 0 || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
		t.Errorf("queue: completed=%d archived=%d pending=%d active=%d scheduled=%d retry=%d; want 60 completed, nothing else",
			qi.Completed, qi.Archived, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
	}

	w.stop(t, 15*time.Second)

	ran, throttled := map[string]int{}, 0
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		m := activityLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		if m[1] != "api:call" || m[5] != "" {
			t.Errorf("unexpected line %q", line)
		}
		n, _ := strconv.Atoi(m[3])
		d, _ := strconv.Atoi(m[4])
		ran[m[2]] += n
		throttled += d
	}
	for _, tenant := range tenants {
		if ran[tenant] != 20 {
			t.Errorf("tenant %s: the worker logged ran=%d in all, want 20", tenant, ran[tenant])
		}
	}
	if throttled == 0 {
		t.Errorf("no task was logged as throttled")
	}
	for _, want := range []string{" rule api:call tenant=5/1s\n", ` redis REDIS_ADDR="` + redisSrv.Addr + `"`,
		" queues default:1 concurrency 10 forwarder interval 500ms "} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("startup log lacks %q:\n%s", want, stdout.String())
		}
	}
	if stderr.String() != "" {
		t.Errorf("stderr (asynq's warnings and errors): %s", stderr.String())
	}
	if t.Failed() {
		t.Logf("stdout:\n%s", stdout.String())
	}
}

// TestRun_shutdownTimeout stops the worker (as SIGTERM does) while a task is running:
// with WORKER_SHUTDOWN_TIMEOUT=12s a task of 9s (longer than asynq's own default of 8s)
// finishes and completes; with 1s a task of 3s is put back in its queue, pending, with no
// retry spent, as the README says.
func TestRun_shutdownTimeout(t *testing.T) {
	tests := []struct {
		timeout, work string
		want          asynq.TaskState
	}{
		{timeout: "12s", work: "9s", want: asynq.TaskStateCompleted},
		{timeout: "1s", work: "3s", want: asynq.TaskStatePending},
	}
	for _, tc := range tests {
		t.Run(tc.timeout, func(t *testing.T) {
			redisSrv := redistest.StartServer(t)
			clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "WORKER_SHUTDOWN_TIMEOUT", tc.timeout, "WORKER_WORK_TIME", tc.work)
			rdb := redisSrv.Client()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var stdout, stderr syncBuffer
			exited := make(chan int, 1)
			go func() { exited <- run(ctx, nil, &stdout, &stderr) }()

			client := asynq.NewClientFromRedisClient(rdb)
			if _, err := producer.Enqueue(ctx, client, "api:call", nil, "acme", asynq.TaskID("long"), asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
			insp := asynq.NewInspectorFromRedisClient(rdb)
			state := func() *asynq.TaskInfo {
				info, err := insp.GetTaskInfo("default", "long")
				if err != nil {
					t.Fatal(err)
				}
				return info
			}
			waitFor(t, 10*time.Second, "the task runs", func() bool { return state().State == asynq.TaskStateActive })
			cancel() // what SIGTERM does
			select {
			case code := <-exited:
				if code != exitOK {
					t.Errorf("exit status %d, want 0; stderr:\n%s", code, stderr.String())
				}
			case <-time.After(30 * time.Second):
				t.Fatal("worker did not stop within 30s")
			}
			if info := state(); info.State != tc.want || info.Retried != 0 {
				t.Errorf("after shutdown the task is %s with Retried %d, want %s with 0", info.State, info.Retried, tc.want)
			}
			if want := " shutting down: running tasks have up to WORKER_SHUTDOWN_TIMEOUT=" + tc.timeout + " to finish\n"; !strings.Contains(stdout.String(), want) {
				t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
			}
			requeued := strings.Contains(stderr.String(), "WARN: Quitting worker. task id=long\n")
			if requeued != (tc.want == asynq.TaskStatePending) {
				t.Errorf("asynq's warning that it put the task back: %t, want %t; stderr:\n%s", requeued, !requeued, stderr.String())
			}
		})
	}
}
