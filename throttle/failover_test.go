package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/lua"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The failover scenario of the README ("Failover and durable mode"): rule tenant=5/60s,
// admissions at t=0..4s, replication cut after the third, the primary killed at 5s and
// the (stale) replica promoted, four more tasks at 7..10s. The instants are the
// limiter's (AllowAt), so the test takes seconds, not a minute; only the Redis events
// (the cut, the kill, the promotion) take real time.

// failoverBase is the scenario's t=0, in ms since the epoch.
const failoverBase = 1_000_000_000

// failoverReplicaTimeout is the durable mode's ReplicaTimeout in the scenario.
const failoverReplicaTimeout = time.Second

// failoverQuota is the scenario's rule: tenant=5/60s.
var failoverQuota = tenantQuota(5, time.Minute)

// failoverReq is the first attempt of task n: its own member, as the middleware gives
// each task, never sent before (Fresh).
func failoverReq(n int) throttle.Request {
	return throttle.Request{Key: throttle.Key{TaskType: "failover:call", Tenant: "acme"},
		Quotas: []throttle.Quota{failoverQuota}, Member: fmt.Sprintf("task-%d", n), Fresh: true}
}

// failoverRepeat is a later attempt of task n: the same member, not Fresh.
func failoverRepeat(n int) throttle.Request {
	req := failoverReq(n)
	req.Fresh = false
	return req
}

// failoverAt is the scenario's instant sec seconds after t=0, in ms.
func failoverAt(sec int64) int64 { return failoverBase + sec*1000 }

// admitted and denied are the exact outcomes of the scenario's decisions at second sec.
func admitted(count int, sec int64) outcome {
	return outcome{Allowed: true, Quota: failoverQuota, Count: count, Remaining: 5 - count, At: failoverAt(sec)}
}

func denied(sec int64) outcome { // the log is full until its oldest entry, t=0, leaves at 60s
	return outcome{Quota: failoverQuota, Count: 5, RetryAfter: msd(failoverAt(60) - failoverAt(sec)), At: failoverAt(sec)}
}

// decideUntil asks l about req at instant at (ms) as the middleware does while Redis
// cannot answer: the same member again (req.Fresh, if set, only on the first attempt)
// every 50ms, each attempt bounded by 2s, until done(err) says the reply is the one waited
// for, or 60s pass (a failover takes 2-3s; 60s leaves room for a sentinel in TILT mode,
// 30s, on a loaded machine). It returns the last decision and error, and every distinct
// error seen before.
func decideUntil(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64, done func(error) bool) (throttle.Decision, error, []string) {
	t.Helper()
	seen := map[string]bool{}
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		d, err := l.AllowAt(ctx, req, ms(at))
		cancel()
		if done(err) {
			return d, err, slices.Sorted(maps.Keys(seen))
		}
		if err == nil && d.Allowed {
			t.Fatalf("%s at %d: admitted %+v while waiting for another reply", req.Member, at, d)
		}
		if d != (throttle.Decision{}) {
			t.Fatalf("%s at %d: error %v with a non-zero decision %+v", req.Member, at, err, d)
		}
		if err != nil {
			seen[errClass(err)] = true
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s at %d: no expected reply within 60s; last error %v (seen: %v)", req.Member, at, err, slices.Sorted(maps.Keys(seen)))
		}
		req.Fresh = false
		time.Sleep(50 * time.Millisecond)
	}
}

// errClass shortens err to what a failover produces: a refused connection, a timeout,
// READONLY, NOSCRIPT, ErrNotReplicated, or the error's first 60 bytes.
func errClass(err error) string {
	s := err.Error()
	switch {
	case errors.Is(err, throttle.ErrNotReplicated):
		return "not replicated"
	case redis.IsReadOnlyError(err):
		return "READONLY"
	case strings.Contains(s, "NOSCRIPT"):
		return "NOSCRIPT"
	case strings.Contains(s, "connection refused"):
		return "connection refused"
	case strings.Contains(s, "timeout") || errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	}
	return s[:min(len(s), 60)]
}

// notReplicated checks that err is ErrNotReplicated for an admission that acked of want
// replicas acknowledged.
func notReplicated(t *testing.T, what string, err error, acked int, replayed bool) {
	t.Helper()
	var nr *throttle.NotReplicatedError
	if !errors.Is(err, throttle.ErrNotReplicated) || !errors.As(err, &nr) {
		t.Fatalf("%s: %v, want ErrNotReplicated", what, err)
	}
	if nr.Acked != acked || nr.Want != 1 || nr.Timeout != failoverReplicaTimeout || nr.Replayed != replayed || nr.Key != failoverReq(0).Key {
		t.Errorf("%s: %+v, want %d of 1 replica acknowledged in %s, replayed %v", what, *nr, acked, failoverReplicaTimeout, replayed)
	}
}

// TestLimiter_failover plays the scenario on a Sentinel deployment (redistest.StartSentinel)
// through its failover client, by default and in durable mode (MinReplicas 1).
//
// By default: tasks 0..4 run (the window is full); the replica has only 0..2 when it is
// promoted, so 3 and 4 are lost with the primary and the promoted replica admits 7 and 8
// into their slots: 7 runs in one window against a limit of 5, and the log it keeps holds
// exactly 0, 1, 2, 7, 8.
//
// Durable: 3 and 4 are written on the primary but no replica acknowledges them, so they
// are ErrNotReplicated and do not run; after the promotion the new primary has no replica,
// so 7 and 8 are not acknowledged either (they do not run, their slots are taken: fail
// closed), and 9 and 10 are denials, returned as such. Once the old primary is back as its
// replica, 7 and 8, asked again with their members as the middleware does, are replays of
// admissions the replica now holds, and run. Tasks 3 and 4, asked again, find a full log: 5
// runs in the window, exactly the limit.
//
// Both: the promoted replica's script cache is empty (Redis does not replicate it), so the
// first decision there got NOSCRIPT and was sent again with EVAL; a limiter on the old
// primary, now a replica, gets READONLY for an admission, as an error. Neither ever reaches
// the caller as an admission. The time from the kill to the first decision is logged.
func TestLimiter_failover(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		cfg  throttle.Config
	}{
		{"default", throttle.Config{}},
		// A healthy replica acknowledges in well under 1ms (measured 0.1-1ms, 30ms on a
		// cold start under -race), and unasked once a second, so 1s is a wide margin for
		// the admissions that must be acknowledged; it is what each of the 4 that cannot
		// be (3, 4, 7, 8) waits, and it keeps the cut and the kill 2s apart, well within
		// the 5s after which the sentinels would point the cut replica back.
		{"durable", throttle.Config{MinReplicas: 1, ReplicaTimeout: failoverReplicaTimeout}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			durable := mode.cfg.MinReplicas > 0
			ctx := context.Background()
			s := redistest.StartSentinel(t)
			l := clusterNew(t, s.Client(), mode.cfg)
			primary, replica := s.Primary.Client(), s.Replica.Client()
			logKey := l.RedisKey(failoverReq(0).Key, throttle.ScopeTenant)
			want := func(n int, sec int64, w outcome) {
				t.Helper()
				wantOutcome(t, l, failoverReq(n), failoverAt(sec), w)
			}

			// t=0..2: admitted, and on the replica (durable: WAIT said so).
			for n := range 3 {
				want(n, int64(n), admitted(n+1, int64(n)))
			}
			if !durable { // as WAIT would: the replica has applied everything the primary has
				waitReplicated(t, primary, replica, logKey, 3)
			}
			if got := zcard(t, replica, logKey); got != 3 {
				t.Fatalf("the replica holds %d entries before the cut, want 3", got)
			}
			// The script is cached on the primary only.
			if got, err := replica.ScriptExists(ctx, lua.SlidingWindow.Hash()).Result(); err != nil || got[0] {
				t.Fatalf("SCRIPT EXISTS on the replica = %v, %v; want false: the NOSCRIPT path would go untested", got, err)
			}

			// The cut, then t=3, 4.
			s.CutReplication()
			for _, n := range []int{3, 4} {
				if !durable {
					want(n, int64(n), admitted(n+1, int64(n)))
					continue
				}
				d, err := l.AllowAt(ctx, failoverReq(n), ms(failoverAt(int64(n))))
				if d != (throttle.Decision{}) {
					t.Errorf("task %d: decision %+v with error %v, want the zero Decision", n, d, err)
				}
				notReplicated(t, fmt.Sprintf("task %d", n), err, 0, false)
			}
			if p, r := zcard(t, primary, logKey), zcard(t, replica, logKey); p != 5 || r != 3 {
				t.Fatalf("after the cut: %d entries on the primary, %d on the replica; want 5 and 3", p, r)
			}

			// t=5: the primary dies. Its successor decides task 7 at t=7.
			killed := time.Now()
			s.Primary.Stop()
			var seen []string
			if durable {
				var err error
				_, err, seen = decideUntil(t, l, failoverReq(7), failoverAt(7), func(err error) bool { return errors.Is(err, throttle.ErrNotReplicated) })
				notReplicated(t, "task 7 on the promoted replica", err, 0, false)
			} else {
				var d throttle.Decision
				d, _, seen = decideUntil(t, l, failoverReq(7), failoverAt(7), func(err error) bool { return err == nil })
				if got := outcomeOf(d); got != admitted(4, 7) {
					t.Errorf("task 7 on the promoted replica: %s, want %s", got, admitted(4, 7))
				}
			}
			resumed := time.Since(killed)
			t.Logf("%s: the first decision came %s after the primary was killed (errors meanwhile: %v)", mode.name, resumed.Round(time.Millisecond), seen)
			if role, err := replica.Do(ctx, "ROLE").Slice(); err != nil || role[0] != "master" {
				t.Fatalf("ROLE of the replica = %v, %v; want master", role, err)
			}
			if got, err := replica.ScriptExists(ctx, lua.SlidingWindow.Hash()).Result(); err != nil || !got[0] {
				t.Errorf("SCRIPT EXISTS on the promoted replica = %v, %v; want true: the decision's EVAL loaded it", got, err)
			}

			// t=8..10.
			if durable {
				_, err := l.AllowAt(ctx, failoverReq(8), ms(failoverAt(8)))
				notReplicated(t, "task 8", err, 0, false)
			} else {
				want(8, 8, admitted(5, 8))
			}
			want(9, 9, denied(9))
			want(10, 10, denied(10))

			// The old primary comes back, empty, as a replica of the promoted one.
			s.Rejoin()
			runs := []string{"task-0", "task-1", "task-2", "task-3", "task-4", "task-7", "task-8"}
			if durable {
				// 7 and 8, asked again: replays, acknowledged once the rejoined replica
				// answers the primary's GETACK (it may still be loading the snapshot it
				// was sent, so WAIT may time out at first: asked again, as the middleware
				// does).
				for _, n := range []int{7, 8} {
					d, _, seen := decideUntil(t, l, failoverRepeat(n), failoverAt(11), func(err error) bool { return err == nil })
					// A replay reports the admission it repeats: 7 was the 4th in the log, 8 the 5th.
					count := n - 3
					w := outcome{Allowed: true, Replay: true, Quota: failoverQuota, Count: count, Remaining: 5 - count, At: failoverAt(int64(n))}
					if got := outcomeOf(d); got != w {
						t.Errorf("task %d asked again at t=11s: %s, want %s (errors before: %v)", n, got, w, seen)
					}
				}
				// 3 and 4, asked again: lost with the primary, decided afresh in a full log.
				for _, n := range []int{3, 4} {
					wantOutcome(t, l, failoverRepeat(n), failoverAt(12), denied(12))
				}
				runs = []string{"task-0", "task-1", "task-2", "task-7", "task-8"}
			}
			t.Logf("%s: %d runs in the window (0s, 60s] against a limit of 5: %v", mode.name, len(runs), runs)
			if wantRuns := map[bool]int{false: 7, true: 5}[durable]; len(runs) != wantRuns {
				t.Errorf("%d runs, want %d", len(runs), wantRuns)
			}
			// The promoted primary's log: 0, 1, 2, 7, 8 (3 and 4 were lost).
			wantLog := map[string]int64{}
			for _, n := range []int64{0, 1, 2, 7, 8} {
				wantLog[fmt.Sprintf("task-%d", n)] = failoverAt(n)
			}
			if got := entriesOf(t, replica, logKey); !maps.Equal(got, wantLog) {
				t.Errorf("the promoted primary's log = %v, want %v", got, wantLog)
			}

			// A limiter on the old primary, now a replica: READONLY, never an admission.
			old := clusterNew(t, s.Primary.Client(), mode.cfg)
			req := failoverReq(100)
			req.Key.Tenant = "initech" // an empty log: the script must write to admit
			d, err := old.AllowAt(ctx, req, ms(failoverAt(13)))
			if !redis.IsReadOnlyError(err) || d != (throttle.Decision{}) {
				t.Errorf("an admission on the demoted primary: %+v, %v; want the zero Decision and READONLY", d, err)
			}
		})
	}
}

// waitReplicated polls until the replica's log key holds n entries, as the primary's
// does (at most 5s).
func waitReplicated(t *testing.T, primary, replica *redis.Client, key string, n int64) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if zcard(t, primary, key) == n && zcard(t, replica, key) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the replica's %s holds %d entries after 5s, the primary's %d; want %d", key, zcard(t, replica, key), zcard(t, primary, key), n)
		}
	}
}

// TestLimiter_sentinelFailoverCommand decides without pause through a Sentinel failover
// client while the sentinels run a failover of a primary that stays up (SENTINEL
// FAILOVER): they promote the replica, then make the old primary its replica, and the
// client's open connections to the old primary may meet READONLY. A default and a durable
// limiter (MinReplicas 1) share the client, each deciding fresh events of its own task type
// (limit 10^6/1h: every decision that comes is an admission) every 10ms.
//
// Durable: every admission it reported is in the promoted primary's log at the end (an
// admission that a replica acknowledged is on the replica with the largest offset, the
// one promoted); what the old primary took after the promotion was never acknowledged,
// so it came back as an error. Both limiters admit again, without a restart, once the old
// primary is a replica in sync. The default limiter's admissions the failover lost, and
// the errors seen, are logged: how many depends on timing.
func TestLimiter_sentinelFailoverCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := redistest.StartSentinel(t)
	rdb := s.Client()
	lims := map[string]*throttle.Limiter{
		"default": clusterNew(t, rdb, throttle.Config{}),
		"durable": clusterNew(t, rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: failoverReplicaTimeout}),
	}
	q := tenantQuota(1_000_000, time.Hour)
	req := func(name string, i int) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "fo:" + name, Tenant: "acme"}, Quotas: []throttle.Quota{q},
			Member: fmt.Sprintf("%s-%d", name, i), Fresh: true}
	}
	reported := map[string]map[string]bool{"default": {}, "durable": {}} // members reported admitted
	errs := map[string]map[string]int{"default": {}, "durable": {}}      // error class -> count
	i := 0
	decide := func() {
		for _, name := range []string{"default", "durable"} {
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			d, err := lims[name].AllowAt(cctx, req(name, i), ms(failoverAt(0)+int64(i)))
			cancel()
			switch {
			case err != nil && d != (throttle.Decision{}):
				t.Errorf("%s %d: error %v with a non-zero decision %+v", name, i, err, d)
			case err != nil:
				errs[name][errClass(err)]++
			case !d.Allowed:
				t.Errorf("%s %d: %s, want an admission (limit 10^6)", name, i, outcomeOf(d))
			default:
				reported[name][req(name, i).Member] = true
			}
		}
		i++
		time.Sleep(10 * time.Millisecond)
	}
	for range 20 {
		decide()
	}
	if len(reported["durable"]) != 20 || len(reported["default"]) != 20 {
		t.Fatalf("before the failover: %d and %d admissions of 20 (errors %v), want all", len(reported["default"]), len(reported["durable"]), errs)
	}

	sc := redis.NewSentinelClient(&redis.Options{Addr: s.Addrs[0]})
	t.Cleanup(func() { _ = sc.Close() })
	if err := sc.Failover(ctx, s.MasterName).Err(); err != nil {
		t.Fatalf("SENTINEL FAILOVER: %v", err)
	}
	started := time.Now()
	oldPrimary := s.Primary.Client()
	// Until the old primary is a replica of the promoted one, in sync.
	for deadline := started.Add(60 * time.Second); ; {
		decide()
		if role, err := oldPrimary.Do(ctx, "ROLE").Slice(); err == nil && role[0] == "slave" && role[3] == "connected" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("60s after SENTINEL FAILOVER the old primary is not a connected replica")
		}
	}
	switched := time.Since(started)
	// Both admit again: each decides until an admission (a durable one needs the old
	// primary's acknowledgement, once its sync is done).
	for name, l := range lims {
		d, _, seen := decideUntil(t, l, req(name, 1_000_000), failoverAt(0)+1_000_000, func(err error) bool { return err == nil })
		if !d.Allowed {
			t.Errorf("%s after the failover: %s, want an admission", name, outcomeOf(d))
		}
		reported[name][req(name, 1_000_000).Member] = true
		for _, e := range seen {
			errs[name][e]++
		}
	}
	t.Logf("the old primary was a connected replica %s after SENTINEL FAILOVER; %d decision rounds", switched.Round(time.Millisecond), i)

	promoted := s.Replica.Client()
	if role, err := promoted.Do(ctx, "ROLE").Slice(); err != nil || role[0] != "master" {
		t.Fatalf("ROLE of the replica = %v, %v; want master", role, err)
	}
	for _, name := range []string{"default", "durable"} {
		logged := entriesOf(t, promoted, lims[name].RedisKey(req(name, 0).Key, throttle.ScopeTenant))
		var lost []string
		for m := range reported[name] {
			if _, ok := logged[m]; !ok {
				lost = append(lost, m)
			}
		}
		slices.Sort(lost)
		t.Logf("%s: %d admissions reported, %d of them not in the promoted primary's log %v; errors %v", name, len(reported[name]), len(lost), lost, errs[name])
		if name == "durable" && len(lost) > 0 {
			t.Errorf("durable: admissions %v were reported but the failover lost them", lost)
		}
	}
}
