package throttle_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The multi-process stress test: TestLimiter_Allow_multiProcess runs this test binary
// again as stressProcs child processes (TestStressChild, told by the environment variable
// stressEnv that it is a child), each with stressGoroutines goroutines that call
// Limiter.Allow on the real clock in a tight loop against one key, and checks what they
// report: the sliding window was never exceeded, and it was used.

const (
	stressEnv        = "THROTTLE_STRESS_CHILD" // JSON stressConfig; set only in a child
	stressProcs      = 4
	stressGoroutines = 16
	stressEvents     = 10
	stressWindow     = 200 * time.Millisecond
	stressRun        = 3 * time.Second
	stressStartAfter = time.Second // for the children to start before the run begins
)

// stressConfig tells a child what to do.
type stressConfig struct {
	Addr       string // Redis
	TaskType   string
	Tenant     string
	Proc       int   // the child's number, in its members
	StartMS    int64 // Unix ms: begin calling then, all together
	DeadlineMS int64 // Unix ms: stop calling then
}

func stressQuotas() []throttle.Quota {
	return []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: stressEvents, Window: stressWindow}}}
}

// TestStressChild is the child process of TestLimiter_Allow_multiProcess. Unless the
// environment says it is a child, it does nothing. A child calls Allow from
// stressGoroutines goroutines until the deadline, then prints one line per admission,
// "admit <member> <At in Unix ms>", and a line "calls <n> admitted <n> fallbacks <n>".
func TestStressChild(t *testing.T) {
	env := os.Getenv(stressEnv)
	if env == "" {
		return // not a child: nothing to do
	}
	var cfg stressConfig
	if err := json.Unmarshal([]byte(env), &cfg); err != nil {
		t.Fatalf("%s=%q: %v", stressEnv, env, err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: stressGoroutines})
	defer rdb.Close()
	l, err := throttle.New(rdb, throttle.Config{Clock: throttle.ClockLocal})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.UnixMilli(cfg.DeadlineMS)
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(2*time.Second))
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil { // connect before the start
		t.Fatal(err)
	}
	time.Sleep(time.Until(time.UnixMilli(cfg.StartMS)))

	type admission struct {
		member string
		at     int64
	}
	var (
		mu        sync.Mutex
		admits    []admission
		calls     int
		fallbacks int
		wg        sync.WaitGroup
	)
	for g := range stressGoroutines {
		wg.Go(func() {
			var mine []admission
			n, skewed := 0, 0
			for ; time.Now().Before(deadline); n++ {
				member := fmt.Sprintf("p%d-g%d-%d", cfg.Proc, g, n)
				d, err := l.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: cfg.TaskType, Tenant: cfg.Tenant},
					Quotas: stressQuotas(), Member: member})
				if err != nil {
					t.Errorf("Allow: %v", err)
					return
				}
				if d.SkewFallback {
					skewed++
				}
				if d.Allowed {
					mine = append(mine, admission{member, d.At.UnixMilli()})
				}
			}
			mu.Lock()
			defer mu.Unlock()
			admits = append(admits, mine...)
			calls += n
			fallbacks += skewed
		})
	}
	wg.Wait()
	w := bufio.NewWriter(os.Stdout)
	for _, a := range admits {
		fmt.Fprintf(w, "admit %s %d\n", a.member, a.at)
	}
	fmt.Fprintf(w, "calls %d admitted %d fallbacks %d\n", calls, len(admits), fallbacks)
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestLimiter_Allow_multiProcess runs stressProcs processes of stressGoroutines goroutines
// each, calling Allow (ClockLocal: each call's own time.Now) in a tight loop on one key
// limited to stressEvents per stressWindow, for stressRun. From the instants (Decision.At,
// in ms) of every admission the children report, it checks:
//
//   - exactness: no window (t-W, t] holds more than stressEvents admissions. The windows
//     ending at an admitted instant are the ones to check: any other window holds no more
//     than the one ending at the latest admission inside it.
//   - the log: every entry seen in the key's sorted set, sampled while the children run
//     and after, is an admission a child reported, at the instant it reported.
//   - throughput: with first and last the first and last admitted instants, let
//     m = floor((last - first + 1ms) / W), the number of whole windows that fit in
//     [first, last], and S = [first, first + m*W - 1ms]: m runs of W consecutive
//     milliseconds, each inside one window (t-W, t] (t its last millisecond). So no
//     record that keeps the limit admits more than possible = stressEvents*m instants in
//     S, and admitting stressEvents at first, first+W, ... reaches it: it is exact. At
//     least 95% of it must have been admitted in S. (Over all of [first, last] the bound
//     is stressEvents*ceil((last-first+1ms)/W), checked too; it is not used for the ratio
//     because the run's end can cut the last window's burst short.)
func TestLimiter_Allow_multiProcess(t *testing.T) {
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	key := throttle.Key{TaskType: "stress:{call}", Tenant: "tenant a"}
	logKey := l.RedisKey(key, throttle.ScopeTenant)
	start := time.Now().Add(stressStartAfter)
	deadline := start.Add(stressRun)

	// Children that overrun are killed 5s after the deadline (their own calls give up 2s
	// after it), so the test takes at most stressStartAfter + stressRun + 5s.
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(5*time.Second))
	defer cancel()
	type child struct {
		cmd            *exec.Cmd
		stdout, stderr bytes.Buffer
	}
	children := make([]*child, stressProcs)
	for i := range children {
		cfg, err := json.Marshal(stressConfig{Addr: srv.Addr, TaskType: key.TaskType, Tenant: key.Tenant, Proc: i,
			StartMS: start.UnixMilli(), DeadlineMS: deadline.UnixMilli()})
		if err != nil {
			t.Fatal(err)
		}
		c := &child{cmd: exec.CommandContext(ctx, os.Args[0], "-test.run=^TestStressChild$", "-test.count=1")}
		c.cmd.Env = append(os.Environ(), stressEnv+"="+string(cfg))
		c.cmd.Stdout, c.cmd.Stderr = &c.stdout, &c.stderr
		if err := c.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		children[i] = c
	}

	// Sample the log while the children run (and once after), to compare with what they
	// report. The test removes no TTL here: a sample may find the key gone.
	logged := map[string]int64{} // member -> score
	sample := func() {
		z, err := rdb.ZRangeWithScores(context.Background(), logKey, 0, -1).Result()
		if err != nil {
			t.Errorf("sample the log: %v", err)
			return
		}
		for _, e := range z {
			logged[e.Member.(string)] = int64(e.Score)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		for _, c := range children {
			wg.Go(func() { _ = c.cmd.Wait() })
		}
		wg.Wait()
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
wait:
	for {
		select {
		case <-done:
			break wait
		case <-tick.C:
			sample()
		}
	}
	sample()

	admitted := map[string]int64{} // member -> At (ms)
	var at []int64
	calls, fallbacks := 0, 0
	for i, c := range children {
		if c.cmd.ProcessState == nil || !c.cmd.ProcessState.Success() {
			t.Fatalf("child %d: %v (killed if it overran)\nstdout:\n%s\nstderr:\n%s", i, c.cmd.ProcessState, tail(c.stdout.String()), c.stderr.String())
		}
		sawSummary := false
		for _, line := range strings.Split(c.stdout.String(), "\n") {
			f := strings.Fields(line)
			switch {
			case len(f) == 3 && f[0] == "admit":
				ms, err := strconv.ParseInt(f[2], 10, 64)
				if err != nil {
					t.Fatalf("child %d: %q: %v", i, line, err)
				}
				if _, dup := admitted[f[1]]; dup {
					t.Errorf("member %s admitted twice", f[1])
				}
				admitted[f[1]] = ms
				at = append(at, ms)
			case len(f) == 6 && f[0] == "calls":
				n, err1 := strconv.Atoi(f[1])
				s, err2 := strconv.Atoi(f[5])
				if err1 != nil || err2 != nil {
					t.Fatalf("child %d: %q", i, line)
				}
				calls, fallbacks, sawSummary = calls+n, fallbacks+s, true
			}
		}
		if !sawSummary {
			t.Fatalf("child %d printed no summary:\n%s", i, tail(c.stdout.String()))
		}
	}
	if len(at) == 0 {
		t.Fatalf("no admission in %d calls", calls)
	}
	slices.Sort(at)

	// Exactness.
	w := stressWindow.Milliseconds()
	most, mostAt := 0, int64(0)
	for i, t := range at {
		if i+1 < len(at) && at[i+1] == t {
			continue // the window ending at t: from its last admission at t
		}
		first, _ := slices.BinarySearch(at, t-w+1) // the first admission > t-W
		if n := i + 1 - first; n > most {
			most, mostAt = n, t
		}
	}
	if most > stressEvents {
		lo, _ := slices.BinarySearch(at, mostAt-w+1)
		var in []string
		for m, a := range admitted {
			if a > mostAt-w && a <= mostAt {
				in = append(in, fmt.Sprintf("%d %s", a, m))
			}
		}
		slices.Sort(in)
		t.Errorf("%d admissions in the window (%d, %d] (instants %v), want at most %d:\n%s",
			most, mostAt-w, mostAt, at[lo:lo+most], stressEvents, strings.Join(in, "\n"))
	}

	// The log against the reports.
	for m, score := range logged {
		member, ok := strings.CutPrefix(m, "1:")
		if a, reported := admitted[member]; !ok || !reported || a != score {
			t.Errorf("the log held %q at %d; reported admission at %d (%v)", m, score, a, reported)
		}
	}

	// Throughput.
	first, last := at[0], at[len(at)-1]
	windows := (last - first + 1) / w
	inSpan, _ := slices.BinarySearch(at, first+windows*w) // admissions in [first, first+m*W-1]
	possible := stressEvents * int(windows)
	bound := stressEvents * int((last-first+1+w-1)/w)
	t.Logf("%d processes x %d goroutines, %d calls, %d admitted at %d..%d ms (%d ms); %d skew fallbacks; "+
		"most in one %d ms window: %d (at %d); %d whole windows: %d admitted of %d possible (%.1f%%); "+
		"all: %d of at most %d; %d log entries sampled",
		stressProcs, stressGoroutines, calls, len(at), first, last, last-first, fallbacks, w, most, mostAt,
		windows, inSpan, possible, 100*float64(inSpan)/float64(max(possible, 1)), len(at), bound, len(logged))
	if windows < int64(stressRun/stressWindow)-2 {
		t.Errorf("admissions span %d ms: fewer than %d whole windows of a %v run", last-first, int64(stressRun/stressWindow)-2, stressRun)
	}
	if len(at) > bound || inSpan > possible {
		t.Errorf("%d admissions in %d ms (bound %d), %d in its first %d windows (bound %d)", len(at), last-first, bound, inSpan, windows, possible)
	}
	if 100*inSpan < 95*possible {
		t.Errorf("%d admissions in %d whole windows, want at least 95%% of %d", inSpan, windows, possible)
	}
}

// tail returns the last lines of s, for a failure message.
func tail(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(len(lines)-20, 0):], "\n")
}

// TestLimiter_AllowAt_callerBehindAfterTrim is what TestLimiter_Allow_multiProcess finds,
// with explicit instants: callers read their clocks before their calls reach Redis, so a
// call stamped 1199 can run after one stamped 1200. The entries at 1000 still count at
// 1199 (rule 1: 1000 > 1199 - 200), so with 2 per 200ms the call at 1199 must be denied
// for 1ms, whatever the call at 1200 trimmed; admitting it puts 3 admissions in the
// window (999, 1199].
func TestLimiter_AllowAt_callerBehindAfterTrim(t *testing.T) {
	t.Parallel()
	q := throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 2, Window: stressWindow}}
	l, err := throttle.New(redistest.Start(t), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	for _, step := range []struct {
		at   int64
		want modelDecision
	}{
		{1000, modelDecision{Allowed: true, Quota: q, Count: 1, Remaining: 1, ResetAfter: msDuration(200), At: 1000}},
		{1000, modelDecision{Allowed: true, Quota: q, Count: 2, Remaining: 0, ResetAfter: msDuration(200), At: 1000}},
		{1200, modelDecision{Allowed: true, Quota: q, Count: 1, Remaining: 1, ResetAfter: msDuration(200), At: 1200}},
		// Counted: 1000, 1000, 1200: k = 3 + 1 - 2 = 2, the 2nd oldest is 1000.
		{1199, modelDecision{Quota: q, Count: 3, Remaining: 0, RetryAfter: msDuration(1), ResetAfter: msDuration(201), At: 1199}},
	} {
		d, err := l.AllowAt(context.Background(), req, time.UnixMilli(step.at))
		if err != nil {
			t.Fatal(err)
		}
		if got := modelDecisionOf(d); got != step.want {
			t.Errorf("t=%d:\n got %s\nwant %s", step.at, got, step.want)
		}
	}
}
