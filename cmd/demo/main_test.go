package main

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestRealMain_badFlags(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args []string
		want string // in stderr
	}{
		{[]string{"-n", "0"}, "-n 0:"},
		{[]string{"-n", "x"}, `invalid value "x" for flag -n`},
		{[]string{"-n", "333334"}, "-n 333334: 3 tenants x 333334 tasks is more than the demo's 1000000 tasks in all"},
		{[]string{"-tenants", "acme,,globex"}, "-tenants"},
		{[]string{"-tenants", "acme,acme"}, `-tenants "acme,acme": tenant "acme" given twice`},
		{[]string{"-api-limit", "0"}, "-api-limit 0:"},
		{[]string{"-api-window", "1500us"}, "-api-window 1.5ms:"},
		{[]string{"-margin", "-1s"}, "-margin -1s:"},
		{[]string{"-jitter", "-1ms"}, "-jitter -1ms:"},
		{[]string{"-concurrency", "0"}, "-concurrency 0:"},
		{[]string{"-timeout", "0s"}, "-timeout 0s:"},
		{[]string{"-bogus"}, "flag provided but not defined: -bogus"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	}
	for _, tc := range tests {
		var stdout, stderr bytes.Buffer
		if code := realMain(context.Background(), tc.args, &stdout, &stderr); code != 2 {
			t.Errorf("%q: exit %d, want 2", tc.args, code)
		}
		if !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%q: stderr %q lacks %q", tc.args, stderr.String(), tc.want)
		}
		if stdout.Len() > 0 {
			t.Errorf("%q: stdout %q, want nothing", tc.args, stdout.String())
		}
	}
}

// setRedisEnv sets the REDIS_* variables redisenv reads, so the caller's environment
// does not leak in.
func setRedisEnv(t *testing.T, addr string) {
	t.Setenv("REDIS_ADDR", addr)
	t.Setenv("REDIS_PASSWORD", "")
	t.Setenv("REDIS_MASTER_NAME", "")
	t.Setenv("REDIS_DB", "0")
}

func TestRealMain_badRedisEnv(t *testing.T) {
	setRedisEnv(t, "127.0.0.1:6379")
	t.Setenv("REDIS_DB", "abc")
	var stdout, stderr bytes.Buffer
	if code := realMain(context.Background(), nil, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "REDIS_DB") {
		t.Errorf("exit %d, stderr %q; want 2 naming REDIS_DB", code, stderr.String())
	}
}

// A REDIS_DB the server does not have is a bad value too, shown by Redis's answer: exit 2
// with the message every command prints, not 1 as for an outage.
func TestRealMain_noSuchDB(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	t.Setenv("REDIS_DB", "99")
	var stdout, stderr bytes.Buffer
	want := `redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="` + srv.Addr + `" has no database 99`
	if code := realMain(context.Background(), []string{"-n", "1"}, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), want) {
		t.Errorf("exit %d, stderr %q; want 2 and %q", code, stderr.String(), want)
	}
}

func TestRealMain_redisDown(t *testing.T) {
	srv := redistest.StartServer(t)
	srv.Stop()
	setRedisEnv(t, srv.Addr)
	var stdout, stderr bytes.Buffer
	if code := realMain(context.Background(), []string{"-n", "1"}, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), srv.Addr) {
		t.Errorf("exit %d, stderr %q; want 1 naming %s", code, stderr.String(), srv.Addr)
	}
}

// smallRun is a whole demo small enough for a test: 3 tenants x 10 tasks against an API
// of 3 per 500ms, so each tenant is throttled for a few windows. Its margin, 250ms, covers
// the jitter between an admission and its API call on a loaded 2-core machine running the
// other packages' tests at once: with 50ms, the API saw a 429 now and then (two calls
// 550ms apart by the limiter arriving less than 500ms apart).
var smallRun = []string{"-json", "-n", "10", "-api-limit", "3", "-api-window", "500ms", "-margin", "250ms", "-timeout", "45s"}

// checkSmallRun runs the demo with smallRun on the Redis of the environment and checks
// the report.
func checkSmallRun(t *testing.T, backend string) {
	t.Helper()
	start := time.Now()
	var stdout, stderr bytes.Buffer
	code := realMain(context.Background(), smallRun, &stdout, &stderr)
	t.Logf("demo took %s; stderr:\n%s", time.Since(start), stderr.String())
	if code != 0 {
		t.Errorf("exit %d, want 0", code)
	}
	r := checkJSONShape(t, stdout.Bytes())
	if !strings.HasPrefix(r.Backend, backend) {
		t.Errorf("backend %q, want %s...", r.Backend, backend)
	}
	if r.WorkerRule != "demo:call tenant=3/750ms" || !r.OK || len(r.Failures) != 0 {
		t.Errorf("rule %q, OK %v, failures %q", r.WorkerRule, r.OK, r.Failures)
	}
	if len(r.Tenants) != 3 {
		t.Fatalf("%d tenants, want 3", len(r.Tenants))
	}
	for i, want := range []string{"acme", "globex", "initech"} {
		tr := r.Tenants[i]
		if tr.Tenant != want || tr.Enqueued != 10 || tr.Completed != 10 || tr.Admitted != 10 ||
			tr.Archived != 0 || tr.Pending != 0 || tr.Lost != 0 || tr.APIAccepted != 10 || tr.API429 != 0 {
			t.Errorf("tenant %d = %+v, want %s with 10 enqueued, admitted, completed, accepted", i, tr, want)
		}
		if tr.MaxInWorkerWindow != 3 || tr.MaxInAPIWindow > 3 || tr.MaxArrivalsInAPIWindow > 3 {
			t.Errorf("%s: max %d per 750ms, %d per 500ms, %d arrivals per 500ms; want 3, <= 3, <= 3",
				tr.Tenant, tr.MaxInWorkerWindow, tr.MaxInAPIWindow, tr.MaxArrivalsInAPIWindow)
		}
		if tr.Throttled < 7 { // 10 tasks, 3 per window: at least 7 wait once
			t.Errorf("%s: throttled %d times, want at least 7", tr.Tenant, tr.Throttled)
		}
	}
	if r.Total.Completed != 30 || r.Total.Enqueued != 30 {
		t.Errorf("total = %+v, want 30 of 30 completed", r.Total)
	}
}

func TestRealMain_miniredis(t *testing.T) {
	setRedisEnv(t, "")
	checkSmallRun(t, "embedded miniredis")
}

func TestRealMain_redisServer(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	checkSmallRun(t, "Redis "+srv.Addr)

	// The run deletes its queue and the queue's counters: only the limiter's keys (logs,
	// reservation sets, the sweeper's lock), which all expire, are left (a trial found
	// asynq's processed counter left without a TTL after every run).
	keys, err := srv.Client().Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		switch {
		case strings.HasPrefix(k, "throttle:{demo:call}:"):
			if ttl := srv.Client().PTTL(context.Background(), k).Val(); ttl <= 0 {
				t.Errorf("key %s has TTL %s, want > 0", k, ttl)
			}
		default:
			t.Errorf("key %s left in Redis", k)
		}
	}
}

// A run that times out reports the tasks still queued as pending, not lost, and exits 1
// with the reason on stderr.
func TestRealMain_timeout(t *testing.T) {
	setRedisEnv(t, "")
	var stdout, stderr bytes.Buffer
	args := []string{"-json", "-n", "10", "-api-limit", "3", "-api-window", "500ms", "-margin", "50ms", "-timeout", "700ms"}
	if code := realMain(context.Background(), args, &stdout, &stderr); code != 1 {
		t.Errorf("exit %d, want 1", code)
	}
	if !strings.Contains(stderr.String(), "demo: FAIL: timed out after 700ms with ") {
		t.Errorf("stderr lacks the reason:\n%s", stderr.String())
	}
	r := checkJSONShape(t, stdout.Bytes())
	// Tasks active at the timeout (some wait for their slot inside the handler) may still
	// complete while the worker shuts down; the run failed all the same.
	if r.OK || !strings.HasPrefix(r.Stopped, "timed out after 700ms") {
		t.Errorf("OK %v, stopped %q; want a failed run that timed out", r.OK, r.Stopped)
	}
	// The reason's last count is the report's: the tasks completed once the shutdown let
	// the running ones finish (a trial's FAIL line said 120 of 300 beside 3 x 50).
	completed := 0
	for _, tr := range r.Tenants {
		completed += tr.Completed
	}
	var then, total, after int
	if n, _ := fmt.Sscanf(r.Stopped, "timed out after 700ms with %d of %d tasks completed by then, %d once", &then, &total, &after); n == 3 {
		if after != completed || then >= after {
			t.Errorf("stopped %q: %d completed by then, %d after the shutdown; the tenants' completed add up to %d", r.Stopped, then, after, completed)
		}
	} else if n != 2 || then != completed || r.Stopped != fmt.Sprintf("timed out after 700ms with %d of %d tasks completed by then", then, total) {
		t.Errorf("stopped %q: the tenants' completed add up to %d", r.Stopped, completed)
	}
	for _, tr := range r.Tenants {
		if tr.Completed+tr.Pending != 10 || tr.Lost != 0 || tr.Archived != 0 {
			t.Errorf("%s: %d completed + %d pending, %d lost, %d archived; want 10 + 0 + 0", tr.Tenant, tr.Completed, tr.Pending, tr.Lost, tr.Archived)
		}
	}
}

// TestRealMain_sentinel runs the small demo through Sentinel: REDIS_ADDR lists the
// sentinels of redistest.StartSentinel and REDIS_MASTER_NAME names their master. The run
// is the same as on one Redis, and it ran on the primary: the limiter's keys are there.
// An unknown master name exits 1 and says so.
func TestRealMain_sentinel(t *testing.T) {
	s := redistest.StartSentinel(t)
	sentinels := strings.Join(s.Addrs, ",")
	setRedisEnv(t, sentinels)
	t.Setenv("REDIS_MASTER_NAME", "mymaster")
	checkSmallRun(t, `Redis Sentinel master "mymaster" via `+sentinels)
	primary := s.Primary.Client()
	lim, err := throttle.New(primary, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"acme", "globex", "initech"} {
		k := lim.RedisKey(throttle.Key{TaskType: taskType, Tenant: tenant}, throttle.ScopeTenant)
		if ttl, err := primary.PTTL(context.Background(), k).Result(); err != nil || ttl <= 0 {
			t.Errorf("window log %s on the primary: PTTL %v, %v; want it there, expiring", k, ttl, err)
		}
	}

	t.Setenv("REDIS_MASTER_NAME", "nosuch")
	var stdout, stderr bytes.Buffer
	want := `demo: Redis Sentinel master "nosuch" via ` + sentinels + `: redisenv: no Sentinel in REDIS_ADDR="` + sentinels + `" knows REDIS_MASTER_NAME="nosuch"` + "\n"
	if code := realMain(context.Background(), []string{"-n", "1"}, &stdout, &stderr); code != 1 || stderr.String() != want {
		t.Errorf("exit %d, stderr %q; want 1 and %q", code, stderr.String(), want)
	}
}
