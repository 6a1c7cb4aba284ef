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
// Limiter.Allow on the real clock against two keys, and checks what they report: the
// sliding window was never exceeded, and it was used. Half the goroutines call in a tight
// loop on the first key; the other half are tasks on the second key that hold
// reservations: denied, each sleeps until its reserved instant (less ClaimWait) and comes
// back for it.

const (
	stressEnv        = "THROTTLE_STRESS_CHILD" // JSON stressConfig; set only in a child
	stressProcs      = 4
	stressGoroutines = 16
	stressEvents     = 10
	stressWindow     = 200 * time.Millisecond
	stressClaimWait  = 20 * time.Millisecond
	stressRun        = 3 * time.Second
	stressStartAfter = time.Second // for the children to start before the run begins
)

// stressConfig tells a child what to do.
type stressConfig struct {
	Addr       string // Redis
	TaskType   string
	Tenant     string // the tight loops' key
	ResvTenant string // the reserving tasks' key
	Proc       int    // the child's number, in its members
	StartMS    int64  // Unix ms: begin calling then, all together
	DeadlineMS int64  // Unix ms: stop calling then
}

func stressQuotas() []throttle.Quota {
	return []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: stressEvents, Window: stressWindow}}}
}

// TestStressChild is the child process of TestLimiter_Allow_multiProcess. Unless the
// environment says it is a child, it does nothing. A child calls Allow from
// stressGoroutines goroutines until the deadline, then prints one line per admission,
// "admit <key> <member> <At in Unix ms> <held 0|1>" (key "a" or "r"), and a line
// "calls <n> admitted <n> fallbacks <n> claims <n> reserved <n>".
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
		key, member string
		at          int64
		held        bool
	}
	var (
		mu                                     sync.Mutex
		admits                                 []admission
		calls, fallbacks, claims, reservations int
		wg                                     sync.WaitGroup
	)
	for g := range stressGoroutines {
		wg.Go(func() {
			var mine []admission
			n, skewed, claimed, reserved := 0, 0, 0, 0
			reserving := g%2 == 1
			tenant, key := cfg.Tenant, "a"
			if reserving {
				tenant, key = cfg.ResvTenant, "r"
			}
			task := 0
			for ; time.Now().Before(deadline); n++ {
				member := fmt.Sprintf("p%d-g%d-%d", cfg.Proc, g, n)
				req := throttle.Request{Key: throttle.Key{TaskType: cfg.TaskType, Tenant: tenant}, Quotas: stressQuotas(), Member: member}
				if reserving {
					req.Reservation, req.ClaimWait = fmt.Sprintf("p%d-g%d-t%d", cfg.Proc, g, task), stressClaimWait
				}
				d, err := l.Allow(ctx, req)
				if err != nil {
					t.Errorf("Allow: %v", err)
					return
				}
				if d.SkewFallback {
					skewed++
				}
				switch {
				case d.Allowed:
					mine = append(mine, admission{key, member, d.At.UnixMilli(), d.Held})
					if d.Held {
						claimed++
					}
					task++
				case reserving && d.Reserved:
					if !d.Held {
						reserved++
					}
					time.Sleep(time.Until(d.RetryAt().Add(-stressClaimWait)))
				case reserving:
					time.Sleep(d.RetryAfter)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			admits = append(admits, mine...)
			calls += n
			fallbacks += skewed
			claims += claimed
			reservations += reserved
		})
	}
	wg.Wait()
	w := bufio.NewWriter(os.Stdout)
	for _, a := range admits {
		held := 0
		if a.held {
			held = 1
		}
		fmt.Fprintf(w, "admit %s %s %d %d\n", a.key, a.member, a.at, held)
	}
	fmt.Fprintf(w, "calls %d admitted %d fallbacks %d claims %d reserved %d\n", calls, len(admits), fallbacks, claims, reservations)
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
}

// stressMost returns the most instants of the sorted at in one window (t-W, t], and the t
// of the first window that holds that many. The windows ending at an admitted instant are
// the ones to check: any other window holds no more than the one ending at the latest
// admission inside it.
func stressMost(at []int64, w int64) (most int, mostAt int64) {
	for i, t := range at {
		if i+1 < len(at) && at[i+1] == t {
			continue // the window ending at t: from its last admission at t
		}
		first, _ := slices.BinarySearch(at, t-w+1) // the first admission > t-W
		if n := i + 1 - first; n > most {
			most, mostAt = n, t
		}
	}
	return most, mostAt
}

// TestLimiter_Allow_multiProcess runs stressProcs processes of stressGoroutines goroutines
// each, calling Allow (ClockLocal: each call's own time.Now) on two keys limited to
// stressEvents per stressWindow, for stressRun: half in a tight loop on key a, half as
// tasks that reserve on key r and come back for their slots. From the instants
// (Decision.At, in ms) of every admission the children report, it checks:
//
//   - exactness, on each key: no window (t-W, t] holds more than stressEvents admissions
//     (v2 decides a call stamped behind a log's high-water instant at that instant, and
//     reports it in At: these instants are what the log holds);
//   - the log: every entry seen in a key's sorted set, sampled while the children run and
//     after, is an admission a child reported, at the instant it reported, or (on key r)
//     a reservation "@1:<token>"; the sentinels aside;
//   - the reservations were used: some tasks on key r were admitted by claiming a slot
//     they held;
//   - throughput, on key a: with first and last the first and last admitted instants, let
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
	resvKey := throttle.Key{TaskType: key.TaskType, Tenant: "tenant r"}
	logKeys := map[string]string{"a": l.RedisKey(key, throttle.ScopeTenant), "r": l.RedisKey(resvKey, throttle.ScopeTenant)}
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
		cfg, err := json.Marshal(stressConfig{Addr: srv.Addr, TaskType: key.TaskType, Tenant: key.Tenant, ResvTenant: resvKey.Tenant,
			Proc: i, StartMS: start.UnixMilli(), DeadlineMS: deadline.UnixMilli()})
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

	// Sample the logs while the children run (and once after), to compare with what they
	// report. The test removes no TTL here: a sample may find a key gone.
	logged := map[string]map[string]int64{"a": {}, "r": {}} // key -> member -> score
	sample := func() {
		for k, logKey := range logKeys {
			z, err := rdb.ZRangeWithScores(context.Background(), logKey, 0, -1).Result()
			if err != nil {
				t.Errorf("sample the log: %v", err)
				return
			}
			for _, e := range z {
				if m := e.Member.(string); !isSentinel(m) {
					logged[k][m] = int64(e.Score)
				}
			}
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

	admitted := map[string]map[string]int64{"a": {}, "r": {}} // key -> member -> At (ms)
	at := map[string][]int64{}
	calls, fallbacks, claims, reservations, heldAdmits := 0, 0, 0, 0, 0
	for i, c := range children {
		if c.cmd.ProcessState == nil || !c.cmd.ProcessState.Success() {
			t.Fatalf("child %d: %v (killed if it overran)\nstdout:\n%s\nstderr:\n%s", i, c.cmd.ProcessState, tail(c.stdout.String()), c.stderr.String())
		}
		sawSummary := false
		for _, line := range strings.Split(c.stdout.String(), "\n") {
			f := strings.Fields(line)
			switch {
			case len(f) == 5 && f[0] == "admit" && (f[1] == "a" || f[1] == "r"):
				ms, err := strconv.ParseInt(f[3], 10, 64)
				if err != nil {
					t.Fatalf("child %d: %q: %v", i, line, err)
				}
				if _, dup := admitted[f[1]][f[2]]; dup {
					t.Errorf("member %s admitted twice", f[2])
				}
				admitted[f[1]][f[2]] = ms
				at[f[1]] = append(at[f[1]], ms)
				if f[4] == "1" {
					heldAdmits++
				}
			case len(f) == 10 && f[0] == "calls":
				n, err1 := strconv.Atoi(f[1])
				s, err2 := strconv.Atoi(f[5])
				cl, err3 := strconv.Atoi(f[7])
				rs, err4 := strconv.Atoi(f[9])
				if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
					t.Fatalf("child %d: %q", i, line)
				}
				calls, fallbacks, claims, reservations, sawSummary = calls+n, fallbacks+s, claims+cl, reservations+rs, true
			}
		}
		if !sawSummary {
			t.Fatalf("child %d printed no summary:\n%s", i, tail(c.stdout.String()))
		}
	}
	w := stressWindow.Milliseconds()
	for _, k := range []string{"a", "r"} {
		if len(at[k]) == 0 {
			t.Fatalf("key %s: no admission in %d calls", k, calls)
		}
		slices.Sort(at[k])
		// Exactness.
		if most, mostAt := stressMost(at[k], w); most > stressEvents {
			var in []string
			for m, a := range admitted[k] {
				if a > mostAt-w && a <= mostAt {
					in = append(in, fmt.Sprintf("%d %s", a, m))
				}
			}
			slices.Sort(in)
			t.Errorf("key %s: %d admissions in the window (%d, %d], want at most %d:\n%s",
				k, most, mostAt-w, mostAt, stressEvents, strings.Join(in, "\n"))
		}
		// The log against the reports.
		for m, score := range logged[k] {
			if k == "r" && strings.HasPrefix(m, "@1:") {
				continue // a reservation, pending when sampled
			}
			if a, reported := admitted[k][m]; !reported || a != score {
				t.Errorf("key %s: the log held %q at %d; reported admission at %d (%v)", k, m, score, a, reported)
			}
		}
	}
	// The children count their claims, and report each admission as held or not.
	if heldAdmits == 0 || reservations == 0 || claims != heldAdmits {
		t.Errorf("%d reservations made, %d admissions claimed one (%d reported as held): want both > 0, and the same",
			reservations, claims, heldAdmits)
	}

	// Throughput, on key a.
	a := at["a"]
	first, last := a[0], a[len(a)-1]
	windows := (last - first + 1) / w
	inSpan, _ := slices.BinarySearch(a, first+windows*w) // admissions in [first, first+m*W-1]
	possible := stressEvents * int(windows)
	bound := stressEvents * int((last-first+1+w-1)/w)
	mostA, mostAtA := stressMost(a, w)
	mostR, _ := stressMost(at["r"], w)
	t.Logf("%d processes x %d goroutines, %d calls, %d skew fallbacks; key a: %d admitted at %d..%d ms (%d ms), "+
		"most in one %d ms window: %d (at %d); %d whole windows: %d admitted of %d possible (%.1f%%); all: %d of at most %d; "+
		"key r: %d admitted, %d by claiming a reservation, %d reservations made, most in one window %d; %d+%d log entries sampled",
		stressProcs, stressGoroutines, calls, fallbacks, len(a), first, last, last-first, w, mostA, mostAtA,
		windows, inSpan, possible, 100*float64(inSpan)/float64(max(possible, 1)), len(a), bound,
		len(at["r"]), heldAdmits, reservations, mostR, len(logged["a"]), len(logged["r"]))
	if windows < int64(stressRun/stressWindow)-2 {
		t.Errorf("admissions span %d ms: fewer than %d whole windows of a %v run", last-first, int64(stressRun/stressWindow)-2, stressRun)
	}
	if len(a) > bound || inSpan > possible {
		t.Errorf("%d admissions in %d ms (bound %d), %d in its first %d windows (bound %d)", len(a), last-first, bound, inSpan, windows, possible)
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
// call stamped 1199 can run after one stamped 1200, which trimmed the entries at 1000 (2
// per 200ms). In v1 (trim grace) the entries at 1000 were kept for the late call and
// counted at 1199, which was denied for 1ms; without them it would have put 3 admissions
// in (999, 1199]. v2 has no grace: the call stamped 1199 is decided at the log's
// high-water instant 1200, where the window (1000, 1200] has room for it, so it is
// admitted there (Delay 1ms on its clock) and logged at 1200: no window ever holds more
// than 2. The next late call is denied until the entries at 1200 leave.
func TestLimiter_AllowAt_callerBehindAfterTrim(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeTenant, 2, stressWindow.Milliseconds())
	quotas := []throttle.Quota{q}
	m := checkSequence(t, []modelStep{
		{at: 1000, tenant: "acme", quotas: quotas, want: &modelDecision{Allowed: true, Quota: q, Count: 1, Remaining: 1, At: 1000}},
		{at: 1000, tenant: "acme", quotas: quotas, want: &modelDecision{Allowed: true, Quota: q, Count: 2, Remaining: 0, At: 1000}},
		{at: 1200, tenant: "acme", quotas: quotas, want: &modelDecision{Allowed: true, Quota: q, Count: 1, Remaining: 1, At: 1200}},
		{at: 1199, tenant: "acme", quotas: quotas, want: &modelDecision{Allowed: true, Quota: q, Count: 2, Remaining: 0, Delay: msd(1), At: 1200}},
		{at: 1199, tenant: "acme", quotas: quotas, want: &modelDecision{Quota: q, Count: 2, RetryAfter: msd(1400 - 1199), At: 1200}},
		{at: 1400, tenant: "acme", quotas: quotas, want: &modelDecision{Allowed: true, Quota: q, Count: 1, Remaining: 1, At: 1400}},
	})
	// Every admission, at the instant it was decided at: no window of 200ms holds more
	// than 2, and the log holds them all: the fast path trims once K_TRIM (8) entries have
	// left the window, and 4 have (the script keeps the same, checkSequence compares).
	if got := resvMostIn([]int64{1000, 1000, 1200, 1200, 1400}, stressWindow.Milliseconds()); got != 2 {
		t.Errorf("most admissions in one window: %d, want 2", got)
	}
	st := m.logs[modelLogOf(throttle.Key{TaskType: "api:call", Tenant: "acme"}, throttle.ScopeTenant)]
	var scores []int64
	for _, e := range st.entries {
		scores = append(scores, e.score)
	}
	if !slices.Equal(scores, []int64{1000, 1000, 1200, 1200, 1400}) {
		t.Errorf("the log holds entries at %v, want 1000, 1000, 1200, 1200 (left the window, not yet trimmed) and 1400", scores)
	}
}
