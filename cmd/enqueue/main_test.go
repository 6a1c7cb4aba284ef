package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestParseFlags(t *testing.T) {
	t.Parallel()
	defaults := config{
		taskType: "api:call", tenants: []string{"acme", "globex", "initech"}, perTenant: 20,
		queue: "default", maxRetry: 25,
	}
	tests := []struct {
		name    string
		args    []string
		want    config
		wantErr string // exact; empty means no error
	}{
		{name: "Defaults", args: nil, want: defaults},
		{
			name: "AllSet",
			args: []string{"-type", "email:send", "-tenants", " a , b ", "-n", "3", "-queue", "low",
				"-payload", `{"x":1}`, "-max-retry", "0", "-retention", "2m"},
			want: config{taskType: "email:send", tenants: []string{"a", "b"}, perTenant: 3, queue: "low",
				payload: []byte(`{"x":1}`), maxRetry: 0, retention: 2 * time.Minute},
		},
		{
			name: "EmptyPayloadIsSet",
			args: []string{"-payload", ""},
			want: func() config { c := defaults; c.payload = []byte{}; return c }(),
		},
		{
			name: "NMost", // 3 tenants x 3,333,333: under 10,000,000 in all (NTooMany: over)
			args: []string{"-n", "3333333"},
			want: func() config { c := defaults; c.perTenant = 3_333_333; return c }(),
		},
		{
			name: "MaxRetryAsynqDefault",
			args: []string{"-max-retry", "-1"},
			want: func() config { c := defaults; c.maxRetry = -1; return c }(),
		},
		{name: "Help", args: []string{"-h"}, wantErr: flag.ErrHelp.Error()},
		{name: "EmptyTenant", args: []string{"-tenants", "acme,,initech"}, wantErr: `-tenants "acme,,initech": tenant 2 of 3 is empty`},
		{name: "BlankTenant", args: []string{"-tenants", "acme, "}, wantErr: `-tenants "acme, ": tenant 2 of 2 is empty`},
		{name: "NoTenants", args: []string{"-tenants", ""}, wantErr: `-tenants "": tenant 1 of 1 is empty`},
		{name: "DuplicateTenant", args: []string{"-tenants", "acme,globex, acme"}, wantErr: `-tenants "acme,globex, acme": tenant "acme" is listed twice`},
		{name: "TenantNotUTF8", args: []string{"-tenants", "acme,caf\xe9"}, wantErr: `-tenants "acme,caf\xe9": tenant 2 of 2, "caf\xe9", is not valid UTF-8`},
		{name: "TenantTooLong", args: []string{"-tenants", strings.Repeat("t", 1025)},
			wantErr: `-tenants "` + strings.Repeat("t", 64) + `"...(1025 bytes): tenant 1 of 1 is 1025 bytes, more than throttle.MaxTenantBytes (1024)`},
		{name: "NZero", args: []string{"-n", "0"}, wantErr: `-n 0: must be at least 1`},
		{name: "NNegative", args: []string{"-n", "-5"}, wantErr: `-n -5: must be at least 1`},
		{name: "NNotANumber", args: []string{"-n", "many"}, wantErr: `invalid value "many" for flag -n: parse error`},
		{name: "EmptyType", args: []string{"-type", " "}, wantErr: `-type " ": must not be empty`},
		{name: "TypeNotUTF8", args: []string{"-type", "bad\xff"}, wantErr: `-type "bad\xff": is not valid UTF-8, which asynq cannot encode`},
		// 10,000,000 in all at most: 3 tenants x 3,333,333 fit, x 3,333,334 do not; a count
		// of 2^62 per tenant no longer wraps the total around.
		{name: "NTooMany", args: []string{"-n", "3333334"}, wantErr: `-n 3333334: 3 tenants x 3333334 tasks is more than 10000000; enqueue from your own code (package producer) for more`},
		{name: "NOverflows", args: []string{"-n", "4611686018427387904", "-tenants", "a,b,c,d"},
			wantErr: `-n 4611686018427387904: 4 tenants x 4611686018427387904 tasks is more than 10000000; enqueue from your own code (package producer) for more`},
		{name: "EmptyQueue", args: []string{"-queue", ""}, wantErr: `-queue "": must not be empty`},
		{name: "MaxRetryBelowMinusOne", args: []string{"-max-retry", "-2"}, wantErr: `-max-retry -2: must be -1 (asynq's default) or at least 0`},
		{name: "RetentionNegative", args: []string{"-retention", "-1s"}, wantErr: `-retention -1s: must not be negative`},
		{name: "RetentionSubSecond", args: []string{"-retention", "1500ms"}, wantErr: `-retention 1.5s: asynq keeps tasks for whole seconds; use 0 or a multiple of 1s`},
		{name: "RetentionNotADuration", args: []string{"-retention", "10"}, wantErr: `invalid value "10" for flag -retention: parse error`},
		{name: "UnknownFlag", args: []string{"-tenant", "acme"}, wantErr: `flag provided but not defined: -tenant`},
		{name: "PositionalArgument", args: []string{"-n", "2", "acme"}, wantErr: `unexpected argument "acme": enqueue takes flags only`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := parseFlags(tc.args)
			if tc.wantErr != "" {
				if err == nil || err.Error() != tc.wantErr {
					t.Fatalf("parseFlags(%q) error = %v, want %s", tc.args, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseFlags(%q) error = %v", tc.args, err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("parseFlags(%q) = %+v, want %+v", tc.args, got, tc.want)
			}
		})
	}
}

func TestJobs_interleaved(t *testing.T) {
	t.Parallel()
	got := slices.Collect(jobs([]string{"acme", "globex", "initech"}, 2))
	want := []job{{"acme", 1}, {"globex", 1}, {"initech", 1}, {"acme", 2}, {"globex", 2}, {"initech", 2}}
	if !slices.Equal(got, want) {
		t.Errorf("jobs = %v, want %v", got, want)
	}

	var first []job
	for j := range jobs([]string{"a", "b"}, 3) {
		if len(first) == 3 {
			break // the iterator must stop when asked
		}
		first = append(first, j)
	}
	if want := []job{{"a", 1}, {"b", 1}, {"a", 2}}; !slices.Equal(first, want) {
		t.Errorf("first 3 jobs = %v, want %v", first, want)
	}
}

func TestDefaultPayload(t *testing.T) {
	t.Parallel()
	if got, want := string(defaultPayload(job{tenant: "acme", seq: 7})), `{"tenant":"acme","seq":7}`; got != want {
		t.Errorf("defaultPayload = %s, want %s", got, want)
	}
	if got, want := string(defaultPayload(job{tenant: `a"b`, seq: 1})), `{"tenant":"a\"b","seq":1}`; got != want {
		t.Errorf("defaultPayload = %s, want %s (escaped)", got, want)
	}
}

func TestReport(t *testing.T) {
	t.Parallel()
	cfg := config{taskType: "api:call", tenants: []string{"acme", "globex", "initech"}, perTenant: 20, queue: "default"}
	day := throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 15, Window: 24 * time.Hour}}
	refusal := &producer.QuotaError{TaskType: "api:call", Quota: day, RetryAfter: 24 * time.Hour}
	tests := []struct {
		name    string
		tallies map[string]*tally
		want    []string
	}{
		{
			name:    "All",
			tallies: map[string]*tally{"acme": {enqueued: 20}, "globex": {enqueued: 20}, "initech": {enqueued: 20}},
			want: []string{
				"enqueued 60 tasks of type api:call to queue default",
				`  "acme": 20 enqueued`, `  "globex": 20 enqueued`, `  "initech": 20 enqueued`,
			},
		},
		{
			name:    "Partial",
			tallies: map[string]*tally{"acme": {enqueued: 2}, "globex": {enqueued: 1}, "initech": {}},
			want: []string{
				"enqueued 3 of 60 tasks of type api:call to queue default",
				`  "acme": 2 enqueued`, `  "globex": 1 enqueued`, `  "initech": 0 enqueued`,
			},
		},
		{
			name: "RefusedFirst",
			tallies: map[string]*tally{"acme": {enqueued: 20}, "globex": {enqueued: 15, refused: 5, first: refusal, firstSeq: 16},
				"initech": {enqueued: 19, refused: 1, first: refusal, firstSeq: 20}},
			want: []string{
				`enqueued 54 of 60 tasks of type api:call to queue default; ENQUEUE_QUOTA "tenant=15/24h" refused 6, of 2 tenants`,
				`  "globex": 15 enqueued, 5 refused; the first, task 16, by tenant=15/24h: retry after 24h0m0s`,
				`  "initech": 19 enqueued, 1 refused; the first, task 20, by tenant=15/24h: retry after 24h0m0s`,
				`  "acme": 20 enqueued`,
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if got := report(cfg, quotas{day}, tc.tallies); !slices.Equal(got, tc.want) {
				t.Errorf("report =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// A report line shows a tenant quoted and cut to its first 64 bytes (internal/quote), so
// that a 10 kB tenant, or one with a newline or a terminal escape, keeps the line whole.
func TestReport_quotesAndCutsTenants(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("a", 10000)
	cfg := config{taskType: "api:call", perTenant: 1, queue: "default",
		tenants: []string{long, "evil\ntenant=acme", "caf\u00e9 \x1b[31m"}}
	tallies := map[string]*tally{long: {enqueued: 1}, "evil\ntenant=acme": {enqueued: 1}, "caf\u00e9 \x1b[31m": {enqueued: 1}}
	want := []string{
		"enqueued 3 tasks of type api:call to queue default",
		`  "` + strings.Repeat("a", 64) + `"...(10000 bytes): 1 enqueued`,
		`  "evil\ntenant=acme": 1 enqueued`,
		`  "café \x1b[31m": 1 enqueued`,
	}
	if got := report(cfg, nil, tallies); !slices.Equal(got, want) {
		t.Errorf("report =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestReport_oneTask: one task is "1 task" (a trial saw "enqueued 1 tasks"), and none of
// one "0 of 1 task".
func TestReport_oneTask(t *testing.T) {
	t.Parallel()
	cfg := config{taskType: "api:call", tenants: []string{"x"}, perTenant: 1, queue: "default"}
	for _, tc := range []struct {
		enqueued int
		want     string
	}{{1, "enqueued 1 task of type api:call to queue default"}, {0, "enqueued 0 of 1 task of type api:call to queue default"}} {
		if got := report(cfg, nil, map[string]*tally{"x": {enqueued: tc.enqueued}}); len(got) == 0 || got[0] != tc.want {
			t.Errorf("%d enqueued: report %q, want first %q", tc.enqueued, got, tc.want)
		}
	}
}

// A report shows at most maxTenantLines tenants, and says how many it left out.
func TestReport_capsTenantLines(t *testing.T) {
	t.Parallel()
	cfg := config{taskType: "api:call", perTenant: 1, queue: "default"}
	tallies := map[string]*tally{}
	for i := range 5000 {
		tenant := fmt.Sprintf("t%04d", i)
		cfg.tenants = append(cfg.tenants, tenant)
		tallies[tenant] = &tally{enqueued: 1}
	}
	got := report(cfg, nil, tallies)
	if len(got) != 1+maxTenantLines+1 {
		t.Fatalf("report has %d lines, want %d:\n%s", len(got), 1+maxTenantLines+1, strings.Join(got, "\n"))
	}
	if got[1] != `  "t0000": 1 enqueued` || got[maxTenantLines] != `  "t0019": 1 enqueued` {
		t.Errorf("tenant lines run %q .. %q, want t0000 .. t0019", got[1], got[maxTenantLines])
	}
	if want := "  ... and 4980 more tenants"; got[len(got)-1] != want {
		t.Errorf("last line = %q, want %q", got[len(got)-1], want)
	}

	cfg.tenants, tallies = cfg.tenants[:maxTenantLines+1], map[string]*tally{}
	for _, tenant := range cfg.tenants {
		tallies[tenant] = &tally{enqueued: 1}
	}
	if got := report(cfg, nil, tallies); got[len(got)-1] != "  ... and 1 more tenant" {
		t.Errorf("last line = %q, want \"  ... and 1 more tenant\"", got[len(got)-1])
	}
}

func TestConfig_options(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  config
		want []string // asynq.Option Strings
	}{
		{name: "QueueMaxRetry", cfg: config{queue: "q", maxRetry: 25}, want: []string{`Queue("q")`, "MaxRetry(25)"}},
		{name: "AsynqDefaultRetry", cfg: config{queue: "q", maxRetry: -1}, want: []string{`Queue("q")`}},
		{name: "Retention", cfg: config{queue: "q", maxRetry: 0, retention: time.Hour}, want: []string{`Queue("q")`, "MaxRetry(0)", "Retention(1h0m0s)"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var got []string
			for _, o := range tc.cfg.options() {
				got = append(got, o.String())
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("options = %q, want %q", got, tc.want)
			}
		})
	}
}

// pendingTasks lists the pending tasks of queue, oldest (next to run) first.
func pendingTasks(t *testing.T, ins *asynq.Inspector, queue string) []*asynq.TaskInfo {
	t.Helper()
	tasks, err := ins.ListPendingTasks(queue, asynq.PageSize(1000))
	if err != nil {
		t.Fatal(err)
	}
	return tasks
}

// newEnqueuer returns an Enqueuer without quotas on rdb, failing t on error.
func newEnqueuer(t *testing.T, rdb redis.UniversalClient) *producer.Enqueuer {
	t.Helper()
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return enq
}

// enqueuedCounts returns the enqueued count of each tenant's tally, failing t on a refusal.
func enqueuedCounts(t *testing.T, tallies map[string]*tally) map[string]int {
	t.Helper()
	n := map[string]int{}
	for tenant, tl := range tallies {
		if tl.refused != 0 {
			t.Errorf("tenant %q: %d refused, want none", tenant, tl.refused)
		}
		n[tenant] = tl.enqueued
	}
	return n
}

func TestEnqueueAll(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	cfg := config{taskType: "api:call", tenants: []string{"acme", "globex", "initech"}, perTenant: 4,
		queue: "bulk", maxRetry: 3, retention: time.Minute}
	calls := 0
	tallies, err := enqueueAll(context.Background(), newEnqueuer(t, rdb), cfg, func() { calls++ })
	if err != nil {
		t.Fatal(err)
	}
	if counts, want := enqueuedCounts(t, tallies), map[string]int{"acme": 4, "globex": 4, "initech": 4}; !reflect.DeepEqual(counts, want) || calls != 12 {
		t.Errorf("counts = %v after %d progress calls, want %v after 12", counts, calls, want)
	}

	tasks := pendingTasks(t, asynq.NewInspectorFromRedisClient(rdb), "bulk")
	perTenant := map[string]int{}
	var order []string
	for _, ti := range tasks {
		tenant := ti.Headers[producer.TenantHeader]
		perTenant[tenant]++
		order = append(order, fmt.Sprintf("%s:%s", tenant, ti.Payload))
		if ti.Type != "api:call" || ti.MaxRetry != 3 || ti.Retention != time.Minute {
			t.Errorf("task %s: type %q max retry %d retention %v, want api:call 3 1m0s", ti.ID, ti.Type, ti.MaxRetry, ti.Retention)
		}
	}
	if want := map[string]int{"acme": 4, "globex": 4, "initech": 4}; !reflect.DeepEqual(perTenant, want) {
		t.Errorf("pending per tenant = %v, want %v", perTenant, want)
	}
	var wantOrder []string
	for j := range jobs(cfg.tenants, cfg.perTenant) {
		wantOrder = append(wantOrder, fmt.Sprintf(`%s:{"tenant":%q,"seq":%d}`, j.tenant, j.tenant, j.seq))
	}
	if !slices.Equal(order, wantOrder) {
		t.Errorf("pending order = %v, want %v", order, wantOrder)
	}
}

func TestEnqueueAll_stopsAtFirstError(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	enq := newEnqueuer(t, rdb)
	cfg := config{taskType: "api:call", tenants: []string{"acme", "globex", "initech"}, perTenant: 5,
		queue: "default", payload: []byte("same"), maxRetry: -1}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	calls := 0
	tallies, err := enqueueAll(ctx, enq, cfg, func() {
		if calls++; calls == 4 {
			cancel() // the 5th enqueue fails
		}
	})
	if !errors.Is(err, context.Canceled) || err.Error() != "stopped before task 5 of 15: context canceled" {
		t.Fatalf("error = %v, want stopped before task 5 of 15: context canceled", err)
	}
	if counts, want := enqueuedCounts(t, tallies), map[string]int{"acme": 2, "globex": 1, "initech": 1}; !reflect.DeepEqual(counts, want) {
		t.Errorf("counts = %v, want %v", counts, want)
	}
	tasks := pendingTasks(t, asynq.NewInspectorFromRedisClient(rdb), "default")
	if len(tasks) != 4 {
		t.Fatalf("%d pending tasks, want 4", len(tasks))
	}
	for _, ti := range tasks {
		if string(ti.Payload) != "same" || ti.MaxRetry != 25 {
			t.Errorf("task %s: payload %q max retry %d, want \"same\" and asynq's default 25", ti.ID, ti.Payload, ti.MaxRetry)
		}
	}
}

// setRedisEnv points the Redis variables at addr for this test (so no t.Parallel).
func setRedisEnv(t *testing.T, addr string) {
	t.Helper()
	for _, k := range []string{"REDIS_MASTER_NAME", "REDIS_PASSWORD", "REDIS_DB", "THROTTLE_TENANT_HEADER", "THROTTLE_PREFIX", "ENQUEUE_QUOTA"} {
		t.Setenv(k, "")
		if err := os.Unsetenv(k); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("REDIS_ADDR", addr)
}

func TestRun(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-tenants", "acme,globex", "-n", "3", "-queue", "critical"}, &stdout, &stderr)
	if code != exitOK {
		t.Fatalf("exit %d, want 0; stderr:\n%s", code, stderr.String())
	}
	if got, want := stdout.String(), "enqueued 6 tasks of type api:call to queue critical\n  \"acme\": 3 enqueued\n  \"globex\": 3 enqueued\n"; got != want {
		t.Errorf("stdout = %q, want %q", got, want)
	}
	if !strings.Contains(stderr.String(), "(6/6") {
		t.Errorf("stderr has no finished progress bar:\n%q", stderr.String())
	}

	perTenant := map[string]int{}
	for _, ti := range pendingTasks(t, asynq.NewInspectorFromRedisClient(srv.Client()), "critical") {
		perTenant[ti.Headers[producer.TenantHeader]]++
	}
	if want := map[string]int{"acme": 3, "globex": 3}; !reflect.DeepEqual(perTenant, want) {
		t.Errorf("pending per tenant = %v, want %v", perTenant, want)
	}
}

// TestRun_redisDBOutOfRange: REDIS_DB=99 on a Redis with 16 databases is a bad variable
// (exit status 2), reported before any enqueue, naming REDIS_DB.
func TestRun_redisDBOutOfRange(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	t.Setenv("REDIS_DB", "99")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-tenants", "acme", "-n", "2"}, &stdout, &stderr); code != exitUsage {
		t.Errorf("exit %d, want 2", code)
	}
	want := `enqueue: redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="` + srv.Addr + `" has no database 99 (ERR DB index is out of range); ` +
		`it has databases 0 to N-1, N its "databases" setting (16 by default)` + "\n"
	if stderr.String() != want || stdout.Len() != 0 {
		t.Errorf("stderr %q\nwant   %q\nstdout %q, want none", stderr.String(), want, stdout.String())
	}
}

// TestRun_redisDown: a Redis that does not answer the first PING is reported once, naming
// REDIS_ADDR, with exit 1 and nothing on stdout: no task is tried. (A Redis lost mid-run
// stops at the first failed enqueue: TestEnqueueAll_stopsAtFirstError.)
func TestRun_redisDown(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	srv.Stop()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), []string{"-tenants", "acme", "-n", "2"}, &stdout, &stderr)
	if code != exitEnqueue {
		t.Fatalf("exit %d, want 1; stderr:\n%s", code, stderr.String())
	}
	want := `enqueue: Redis at REDIS_ADDR="` + srv.Addr + `" does not answer: dial tcp ` + srv.Addr + `: connect: connection refused` + "\n"
	if stderr.String() != want || stdout.Len() != 0 {
		t.Errorf("stderr %q\nwant   %q\nstdout %q, want none", stderr.String(), want, stdout.String())
	}
}

func TestRun_usageErrors(t *testing.T) {
	tests := []struct {
		name       string
		addr       string
		env        map[string]string
		args       []string
		wantCode   int
		wantStderr string
	}{
		{
			name: "BadFlag", addr: "127.0.0.1:6379", args: []string{"-tenants", "acme,"}, wantCode: exitUsage,
			wantStderr: "enqueue: -tenants \"acme,\": tenant 2 of 2 is empty\nRun 'enqueue -h' for usage.\n",
		},
		{
			name: "BadRedisAddr", addr: "localhost", wantCode: exitUsage,
			wantStderr: "enqueue: redisenv: REDIS_ADDR=\"localhost\": \"localhost\" is not host:port: missing port in address\n",
		},
		{
			name: "QuotaWithoutWindow", addr: "127.0.0.1:6379", env: map[string]string{"ENQUEUE_QUOTA": "tenant=10000"}, wantCode: exitUsage,
			wantStderr: "enqueue: ENQUEUE_QUOTA=\"tenant=10000\": \"tenant=10000\": throttle: limit \"10000\": want events/window, e.g. 5/2s\n",
		},
		{
			name: "QuotaUnknownScope", addr: "127.0.0.1:6379", env: map[string]string{"ENQUEUE_QUOTA": "tenant=5/1h queue=9/1h"}, wantCode: exitUsage,
			wantStderr: "enqueue: ENQUEUE_QUOTA=\"tenant=5/1h queue=9/1h\": \"queue=9/1h\": unknown scope \"queue\"; want tenant or type\n",
		},
		{
			name: "QuotaSameWindowTwice", addr: "127.0.0.1:6379", env: map[string]string{"ENQUEUE_QUOTA": "tenant=5/24h tenant=9/24h"}, wantCode: exitUsage,
			wantStderr: "enqueue: ENQUEUE_QUOTA=\"tenant=5/24h tenant=9/24h\": tenant=5/24h and tenant=9/24h have the same scope and window; keep one\n",
		},
		{
			name: "EmptyTenantHeader", addr: "127.0.0.1:6379", env: map[string]string{"THROTTLE_TENANT_HEADER": ""}, wantCode: exitUsage,
			wantStderr: "enqueue: THROTTLE_TENANT_HEADER=\"\": must not be empty\n",
		},
		{
			name: "TenantHeaderNotUTF8", addr: "127.0.0.1:6379", env: map[string]string{"THROTTLE_TENANT_HEADER": "h\xff"}, wantCode: exitUsage,
			wantStderr: "enqueue: THROTTLE_TENANT_HEADER=\"h\\xff\": is not valid UTF-8, which asynq cannot encode\n",
		},
		{
			name: "PrefixWithBrace", addr: "127.0.0.1:6379", env: map[string]string{"THROTTLE_PREFIX": "a{b"}, wantCode: exitUsage,
			wantStderr: "enqueue: THROTTLE_PREFIX=\"a{b\": must not contain '{' or '}': they would move the Redis Cluster hash tag\n",
		},
		{
			name: "PrefixEndsInEnqueue", addr: "127.0.0.1:6379", env: map[string]string{"THROTTLE_PREFIX": "throttle:enqueue"}, wantCode: exitUsage,
			wantStderr: `enqueue: THROTTLE_PREFIX="throttle:enqueue": ` + "producer: prefix \"throttle:enqueue\": its last ':'-separated segment is \"enqueue\", which enqueue quotas put after the workers' prefix (\"<prefix>:enqueue:{<task type>}:...\"): a worker's keys under it would be enqueue quotas' keys; choose another\n",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			setRedisEnv(t, tc.addr)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var stdout, stderr bytes.Buffer
			if code := run(context.Background(), tc.args, &stdout, &stderr); code != tc.wantCode {
				t.Errorf("exit %d, want %d", code, tc.wantCode)
			}
			if stderr.String() != tc.wantStderr || stdout.Len() != 0 {
				t.Errorf("stderr = %q, stdout = %q; want stderr %q, empty stdout", stderr.String(), stdout.String(), tc.wantStderr)
			}
		})
	}
}

func TestRun_help(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-h"}, &stdout, &stderr); code != exitOK {
		t.Errorf("exit %d, want 0", code)
	}
	for _, want := range []string{"Usage: enqueue [flags]", "-tenants list", "-max-retry int", "REDIS_ADDR",
		"THROTTLE_TENANT_HEADER", "THROTTLE_PREFIX", "ENQUEUE_QUOTA", "3 ENQUEUE_QUOTA refused some tasks"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("usage lacks %q:\n%s", want, stdout.String())
		}
	}
}

// pendingByHeader counts queue's pending tasks by the value of header ("<none>" without it).
func pendingByHeader(t *testing.T, rdb redis.UniversalClient, queue, header string) map[string]int {
	t.Helper()
	n := map[string]int{}
	for _, ti := range pendingTasks(t, asynq.NewInspectorFromRedisClient(rdb), queue) {
		v, ok := ti.Headers[header]
		if !ok {
			v = "<none>"
		}
		n[v]++
	}
	return n
}

// THROTTLE_TENANT_HEADER names the header tasks are tagged with, as the worker reads it.
func TestRun_tenantHeader(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	t.Setenv("THROTTLE_TENANT_HEADER", "x-org")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-tenants", "acme,globex", "-n", "2"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("exit %d, want 0; stderr:\n%s", code, stderr.String())
	}
	if got, want := pendingByHeader(t, srv.Client(), "default", "x-org"), map[string]int{"acme": 2, "globex": 2}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by x-org = %v, want %v", got, want)
	}
	if got, want := pendingByHeader(t, srv.Client(), "default", producer.TenantHeader), map[string]int{"<none>": 4}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by %s = %v, want %v (no default header)", producer.TenantHeader, got, want)
	}
}

// ENQUEUE_QUOTA refuses each tenant's tasks past its quota, reports them with their
// exact retry-after, goes on with the other tenants, and exits 3.
func TestRun_enqueueQuota(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	t.Setenv("ENQUEUE_QUOTA", "tenant=3/24h")
	t.Setenv("THROTTLE_TENANT_HEADER", "x-org")
	t.Setenv("THROTTLE_PREFIX", "myapp")
	t0 := time.Date(2026, 3, 2, 9, 0, 0, 0, time.UTC)
	now := t0
	clock := func() time.Time { return now }

	var stdout, stderr bytes.Buffer
	code := runAt(context.Background(), []string{"-tenants", "acme,globex,initech", "-n", "5"}, &stdout, &stderr, clock)
	if code != exitRefused {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, exitRefused, stderr.String())
	}
	want := `enqueued 9 of 15 tasks of type api:call to queue default; ENQUEUE_QUOTA "tenant=3/24h" refused 6, of 3 tenants
  "acme": 3 enqueued, 2 refused; the first, task 4, by tenant=3/24h: retry after 24h0m0s
  "globex": 3 enqueued, 2 refused; the first, task 4, by tenant=3/24h: retry after 24h0m0s
  "initech": 3 enqueued, 2 refused; the first, task 4, by tenant=3/24h: retry after 24h0m0s
`
	if stdout.String() != want {
		t.Errorf("stdout =\n%s\nwant\n%s", stdout.String(), want)
	}
	if !strings.Contains(stderr.String(), "(15/15") {
		t.Errorf("stderr has no finished progress bar:\n%q", stderr.String())
	}
	if got, want := pendingByHeader(t, srv.Client(), "default", "x-org"), map[string]int{"acme": 3, "globex": 3, "initech": 3}; !reflect.DeepEqual(got, want) {
		t.Errorf("pending tasks by x-org = %v, want %v", got, want)
	}
	keys, err := srv.Client().Keys(context.Background(), "myapp*").Result()
	slices.Sort(keys)
	if want := []string{"myapp:enqueue:{api:call}:tenant:acme", "myapp:enqueue:{api:call}:tenant:globex", "myapp:enqueue:{api:call}:tenant:initech"}; err != nil || !slices.Equal(keys, want) {
		t.Errorf("keys = %q, %v; want %q", keys, err, want)
	}

	// An hour later globex still waits, 23h now; zeta, a new tenant, has room.
	now = t0.Add(time.Hour)
	stdout.Reset()
	stderr.Reset()
	code = runAt(context.Background(), []string{"-tenants", "globex,zeta", "-n", "1"}, &stdout, &stderr, clock)
	if code != exitRefused {
		t.Fatalf("second run: exit %d, want %d; stderr:\n%s", code, exitRefused, stderr.String())
	}
	want = `enqueued 1 of 2 tasks of type api:call to queue default; ENQUEUE_QUOTA "tenant=3/24h" refused 1, of 1 tenant
  "globex": 0 enqueued, 1 refused; the first, task 1, by tenant=3/24h: retry after 23h0m0s
  "zeta": 1 enqueued
`
	if stdout.String() != want {
		t.Errorf("second run: stdout =\n%s\nwant\n%s", stdout.String(), want)
	}
}

// TestRun_sentinelUnknownMaster: a REDIS_MASTER_NAME the sentinels do not know is named
// before any enqueue (go-redis would say "all sentinels specified in configuration are
// unreachable"), exit 1, nothing enqueued.
func TestRun_sentinelUnknownMaster(t *testing.T) {
	s := redistest.StartSentinel(t)
	addr := strings.Join(s.Addrs, ",")
	setRedisEnv(t, addr)
	t.Setenv("REDIS_MASTER_NAME", "nosuch")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-n", "1"}, &stdout, &stderr); code != exitEnqueue {
		t.Errorf("exit %d, want %d", code, exitEnqueue)
	}
	want := `enqueue: Redis at REDIS_ADDR="` + addr + `" does not answer: redisenv: no Sentinel in REDIS_ADDR="` + addr + `" knows REDIS_MASTER_NAME="nosuch"` + "\n"
	if stderr.String() != want || stdout.Len() != 0 {
		t.Errorf("stdout %q, stderr\n%s\nwant nothing and\n%s", stdout.String(), stderr.String(), want)
	}
	if n, err := s.Primary.Client().DBSize(context.Background()).Result(); err != nil || n != 0 {
		t.Errorf("DBSIZE on the primary = %d, %v; want 0 (nothing enqueued)", n, err)
	}
}

// TestRun_sentinel enqueues through Sentinel: REDIS_ADDR lists the sentinels of
// redistest.StartSentinel, REDIS_MASTER_NAME names their master. With ENQUEUE_QUOTA the
// quota is decided there too: 2 of each tenant's 3 tasks are enqueued, on the primary, and
// the quota's logs, each with a TTL, are the primary's; both reach the replica.
func TestRun_sentinel(t *testing.T) {
	s := redistest.StartSentinel(t)
	setRedisEnv(t, strings.Join(s.Addrs, ","))
	t.Setenv("REDIS_MASTER_NAME", "mymaster")
	t.Setenv("ENQUEUE_QUOTA", "tenant=2/24h")
	now := func() time.Time { return time.Date(2026, 3, 2, 9, 0, 0, 0, time.UTC) }
	var stdout, stderr bytes.Buffer
	code := runAt(context.Background(), []string{"-tenants", "acme,globex", "-n", "3"}, &stdout, &stderr, now)
	if code != exitRefused {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, exitRefused, stderr.String())
	}
	want := `enqueued 4 of 6 tasks of type api:call to queue default; ENQUEUE_QUOTA "tenant=2/24h" refused 2, of 2 tenants
  "acme": 2 enqueued, 1 refused; the first, task 3, by tenant=2/24h: retry after 24h0m0s
  "globex": 2 enqueued, 1 refused; the first, task 3, by tenant=2/24h: retry after 24h0m0s
`
	if stdout.String() != want {
		t.Errorf("stdout =\n%s\nwant\n%s", stdout.String(), want)
	}
	ctx := context.Background()
	if n, err := s.Client().Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT 1 5000 = %d, %v; want the replica caught up", n, err)
	}
	for name, srv := range map[string]*redistest.Server{"primary": s.Primary, "replica": s.Replica} {
		rdb := srv.Client()
		if got, want := pendingByHeader(t, rdb, "default", producer.TenantHeader), map[string]int{"acme": 2, "globex": 2}; !reflect.DeepEqual(got, want) {
			t.Errorf("pending tasks on the %s by tenant = %v, want %v", name, got, want)
		}
		keys, err := rdb.Keys(ctx, "throttle:enqueue:*").Result()
		slices.Sort(keys)
		if want := []string{"throttle:enqueue:{api:call}:tenant:acme", "throttle:enqueue:{api:call}:tenant:globex"}; err != nil || !slices.Equal(keys, want) {
			t.Errorf("quota keys on the %s = %q, %v; want %q", name, keys, err, want)
		}
		for _, k := range keys {
			if ttl, err := rdb.PTTL(ctx, k).Result(); err != nil || ttl <= 0 {
				t.Errorf("PTTL %s on the %s = %v, %v; want > 0", k, name, ttl, err)
			}
		}
	}
}

// TestRun_barInAPipe: into a pipe, not a terminal, the progress bar is drawn when it
// starts and when it ends, not every 65ms: 3000 tasks (a few hundred ms) leave 2 frames, the last the
// finished bar.
func TestRun_barInAPipe(t *testing.T) {
	srv := redistest.StartServer(t)
	setRedisEnv(t, srv.Addr)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		got <- string(b)
	}()
	var stdout bytes.Buffer
	if isTerminal(w) {
		t.Fatal("isTerminal(a pipe) = true")
	}
	code := run(context.Background(), []string{"-tenants", "acme", "-n", "3000"}, &stdout, w)
	w.Close()
	out := <-got
	if code != exitOK {
		t.Fatalf("exit %d, want 0; stderr:\n%s", code, out)
	}
	if n := strings.Count(out, "enqueue "); n != 2 || !strings.Contains(out, "(3000/3000") {
		t.Errorf("stderr drew %d frames, want 2, the last (3000/3000 ...):\n%q", n, out)
	}
}
