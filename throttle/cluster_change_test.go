package throttle_test

import (
	"context"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/lua"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// This file changes a Redis Cluster under the limiter while it decides (issue 9,
// "Cluster, under change"): a primary killed and its replica promoted, the slot of one
// task type moved to another primary key by key, SCRIPT FLUSH on every node. Every test
// drives the same rounds of events (changeRounds) through a plain limiter and (but for the
// move of a slot) one with Config.AutoPipeline, each under its own prefix, and checks the same
// exact outcome as a cluster that does not change: an error never comes with an
// admission, every event ends admitted or denied once it is retried with its own member,
// and every window log holds exactly the members admitted in its window.

// clusterTypes are the 10 task types of these tests and of README.md's slot layout: the
// slot of each one's hash tag (CRC16 of the escaped task type mod 16384), and which
// master of a 3-master cluster serves it (slots 0-5460, 5461-10922, 10923-16383). The
// names are chosen so that every master serves some: 3, 4 and 3 of them.
var clusterTypes = []clusterType{
	{"email:send", 3650, 0}, {"sms:send", 3424, 0}, {"llm:complete", 3658, 0},
	{"webhook:deliver", 8627, 1}, {"image:resize", 8094, 1}, {"search:index", 9559, 1}, {"export:csv", 7618, 1},
	{"pdf:render", 16005, 2}, {"payment:charge", 12592, 2}, {"video:transcode", 15271, 2},
}

// clusterType is a task type of clusterTypes.
type clusterType struct {
	name   string
	slot   int64
	master int // index in redistest.Cluster.Addrs
}

// The rounds of events every test below drives, per limiter: in each round, at one
// instant, 2 events of each of 20 tenants of each of the 10 task types, all at once,
// under tenant=3/1m and type=50/1m. The window is a minute, though the rounds' instants
// are given, because keys expire by the server's clock a window after their newest
// entry: a test's real time (under 20s) must stay well inside it.
const (
	changeTenants = 20
	changeEvents  = 2
	changeWindow  = time.Minute
	// changeDeadline bounds how long an event is retried: the slowest change, a primary
	// killed with a node timeout of 1s, is over in about 3s (README.md, Redis Cluster).
	changeDeadline = 20 * time.Second
)

var changeQuotas = []throttle.Quota{tenantQuota(3, changeWindow), typeQuota(50, changeWindow)}

// changeRounds are the rounds' instants and what each task type gets in them, whatever the
// order its events are decided in, since a denial takes nothing from either quota:
//   - t=0: every tenant gets its 2 (40 of the type's 50).
//   - t=1000: each tenant has 1 left, the type 10, so 10 of the 20 tenants get one; all
//     other events are denied until t=60000, when t=0's 40 leave the type's window (and
//     a tenant full at 3 has its first two from t=0 leave too): retry after 59000 ms.
//   - t=2000: the type is full (50): all denied, retry after 58000 ms, for the same reason.
//   - t=60000: t=0's entries have left; the type has 40 left (t=1000's 10 still count),
//     each tenant 2 or 3, so all 40 are admitted.
//
// If a change lost an admission, a later round would admit more than this; if it made
// one twice, the log would hold more.
var changeRounds = []struct {
	at         int64 // ms
	admitted   int   // per task type
	retryAfter time.Duration
}{{0, 40, 0}, {1000, 10, 59 * time.Second}, {2000, 0, 58 * time.Second}, {60000, 40, 0}}

// changeEvent is one event of a round and what became of it.
type changeEvent struct {
	lim                      string // the limiter's name, and its prefix
	taskType, tenant, member string
	round                    int

	mu       sync.Mutex
	d        throttle.Decision
	errs     []error   // of the attempts that failed, in order
	resolved bool      // an attempt returned a decision
	at       time.Time // when it returned it
}

// changeRun drives the rounds through the limiters on one cluster client.
type changeRun struct {
	t      *testing.T
	rdb    *redis.ClusterClient
	lims   map[string]*throttle.Limiter
	events [][]*changeEvent // by round
	// gate is read-held by every attempt: holding it, a test knows no call is under way.
	gate sync.RWMutex
}

// newChangeRun returns a run on rdb with a plain limiter ("plain") and, if pipelined,
// one with AutoPipeline ("pipelined").
func newChangeRun(t *testing.T, rdb *redis.ClusterClient, pipelined bool) *changeRun {
	t.Helper()
	r := &changeRun{t: t, rdb: rdb, lims: map[string]*throttle.Limiter{}}
	r.lims["plain"] = clusterNew(t, rdb, throttle.Config{Prefix: "plain"})
	if pipelined {
		r.lims["pipelined"] = clusterNew(t, rdb, throttle.Config{Prefix: "pipelined", AutoPipeline: true})
	}
	for round := range changeRounds {
		var evs []*changeEvent
		for _, lim := range slices.Sorted(maps.Keys(r.lims)) {
			for _, ct := range clusterTypes {
				for tenant := range changeTenants {
					for e := range changeEvents {
						evs = append(evs, &changeEvent{lim: lim, taskType: ct.name, tenant: fmt.Sprint("t", tenant),
							member: fmt.Sprintf("r%d-%s-%d-%d", round, ct.name, tenant, e), round: round})
					}
				}
			}
		}
		r.events = append(r.events, evs)
	}
	return r
}

// start decides every event of round at once, each in its own goroutine, retrying an
// event whose call fails (after 10 ms) with its own member until a call returns a
// decision or changeDeadline has passed. A call that returns an error with anything but
// a zero Decision fails the test: an error is never an admission.
func (r *changeRun) start(round int) *changeRound {
	cr := &changeRound{run: r, round: round, done: make(chan struct{})}
	var wg sync.WaitGroup
	at := ms(changeRounds[round].at)
	deadline := time.Now().Add(changeDeadline)
	for _, ev := range r.events[round] {
		wg.Go(func() {
			l := r.lims[ev.lim]
			for attempt := 0; time.Now().Before(deadline); attempt++ {
				req := throttle.Request{Key: throttle.Key{TaskType: ev.taskType, Tenant: ev.tenant}, Quotas: changeQuotas,
					Member: ev.member, Fresh: attempt == 0}
				r.gate.RLock()
				d, err := l.AllowAt(context.Background(), req, at)
				r.gate.RUnlock()
				ev.mu.Lock()
				if err == nil {
					ev.d, ev.resolved, ev.at = d, true, time.Now()
					ev.mu.Unlock()
					return
				}
				ev.errs = append(ev.errs, err)
				ev.mu.Unlock()
				if d.Allowed || d.Reserved || d.Count != 0 || d.RetryAfter != 0 {
					r.t.Errorf("%s %s/%s at %d: an error with a decision: %s, %v", ev.lim, ev.taskType, ev.tenant, at.UnixMilli(), outcomeOf(d), err)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	go func() { wg.Wait(); close(cr.done) }()
	return cr
}

// changeRound is a round under way.
type changeRound struct {
	run   *changeRun
	round int
	done  chan struct{} // closed when every event is resolved or out of time
}

// waitUntil polls until cond holds for every event that match selects, failing the test
// after changeDeadline with what.
func (cr *changeRound) waitUntil(what string, match func(*changeEvent) bool, cond func(*changeEvent) bool) {
	t := cr.run.t
	t.Helper()
	deadline := time.Now().Add(changeDeadline)
	for {
		missing := 0
		for _, ev := range cr.run.events[cr.round] {
			if !match(ev) {
				continue
			}
			ev.mu.Lock()
			if !cond(ev) {
				missing++
			}
			ev.mu.Unlock()
		}
		if missing == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("round %d: %d events are not yet %s after %s", cr.round, missing, what, changeDeadline)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// wait waits for every event of the round to be resolved, then checks the round.
func (cr *changeRound) wait() {
	cr.run.t.Helper()
	<-cr.done
	cr.run.check(cr.round)
}

func resolved(ev *changeEvent) bool { return ev.resolved }
func errored(ev *changeEvent) bool  { return len(ev.errs) > 0 }
func anyEvent(*changeEvent) bool    { return true }

// check checks a finished round against changeRounds: every event resolved; per limiter
// and task type, exactly the admissions written there, every denial's retry-after the
// one written there, and no tenant over 3 nor type over 50 in any window of the rounds
// so far; and each window log holds exactly the members admitted in its window ending at
// the round's instant (each once: a log is a set, and a replay is not a second entry).
func (r *changeRun) check(round int) {
	t := r.t
	t.Helper()
	want := changeRounds[round]
	admitted := map[string]int{} // lim/type -> admissions in the round
	for _, ev := range r.events[round] {
		switch {
		case !ev.resolved:
			t.Errorf("round %d: %s %s/%s (%s) unresolved after %d attempts: %v", round, ev.lim, ev.taskType, ev.tenant, ev.member, len(ev.errs), ev.errs)
		case ev.d.Allowed:
			admitted[ev.lim+"/"+ev.taskType]++
		case ev.d.RetryAfter != want.retryAfter || ev.d.Reserved:
			t.Errorf("round %d: %s %s/%s denied %s; want retry after %s", round, ev.lim, ev.taskType, ev.tenant, outcomeOf(ev.d), want.retryAfter)
		}
	}
	for lim := range r.lims {
		for _, ct := range clusterTypes {
			if got := admitted[lim+"/"+ct.name]; got != want.admitted {
				t.Errorf("round %d at t=%d: %s %s admitted %d of %d, want %d", round, want.at, lim, ct.name, got, changeTenants*changeEvents, want.admitted)
			}
		}
	}

	// The windows ending at this round's instant, from the decisions and from the logs.
	inWindow := func(ev *changeEvent) bool {
		return ev.resolved && ev.d.Allowed && changeRounds[ev.round].at > want.at-changeWindow.Milliseconds()
	}
	members := map[string][]string{} // redis key -> members admitted in the window
	for rd := 0; rd <= round; rd++ {
		for _, ev := range r.events[rd] {
			if !inWindow(ev) {
				continue
			}
			key := throttle.Key{TaskType: ev.taskType, Tenant: ev.tenant}
			for _, scope := range []throttle.Scope{throttle.ScopeTenant, throttle.ScopeType} {
				k := r.lims[ev.lim].RedisKey(key, scope)
				members[k] = append(members[k], ev.member)
			}
		}
	}
	ctx := context.Background()
	for _, lim := range slices.Sorted(maps.Keys(r.lims)) {
		for _, ct := range clusterTypes {
			for tenant := -1; tenant < changeTenants; tenant++ {
				scope, key := throttle.ScopeType, throttle.Key{TaskType: ct.name}
				limit := 50
				if tenant >= 0 {
					scope, key.Tenant, limit = throttle.ScopeTenant, fmt.Sprint("t", tenant), 3
				}
				k := r.lims[lim].RedisKey(key, scope)
				wantMembers := slices.Sorted(slices.Values(members[k]))
				if len(wantMembers) > limit {
					t.Errorf("round %d: %s admitted %d in the window ending at t=%d, over its limit %d", round, k, len(wantMembers), want.at, limit)
				}
				got, err := r.rdb.ZRangeByScore(ctx, k, &redis.ZRangeBy{Min: fmt.Sprint("(", want.at-changeWindow.Milliseconds()), Max: "+inf"}).Result()
				if err != nil {
					t.Errorf("round %d: ZRANGEBYSCORE %s: %v", round, k, err)
					continue
				}
				got = slices.DeleteFunc(got, isSentinel)
				slices.Sort(got)
				if !slices.Equal(got, wantMembers) {
					t.Errorf("round %d: %s holds\n %q\nwant the members admitted in its window ending at t=%d\n %q", round, k, got, want.at, wantMembers)
				}
			}
		}
	}
}

// errorsSeen counts, over every event of the run so far, the failed attempts whose error
// contains each of words, and the events that got at least one error.
func (r *changeRun) errorsSeen(words ...string) (map[string]int, int) {
	n, events := map[string]int{}, 0
	for _, evs := range r.events {
		for _, ev := range evs {
			ev.mu.Lock()
			if len(ev.errs) > 0 {
				events++
			}
			for _, err := range ev.errs {
				for _, w := range words {
					if strings.Contains(err.Error(), w) {
						n[w]++
					}
				}
			}
			ev.mu.Unlock()
		}
	}
	return n, events
}

// replays counts the events whose decision was a replay: a retry of a call that had been
// admitted, though its caller got an error.
func (r *changeRun) replays() int {
	n := 0
	for _, evs := range r.events {
		for _, ev := range evs {
			if ev.resolved && ev.d.Replay {
				n++
			}
		}
	}
	return n
}

// changeKeys returns both limiters' window logs of taskType: the type's, and those of
// the tenants t<lo> to t<hi-1>.
func (r *changeRun) changeKeys(taskType string, typeLog bool, lo, hi int) []string {
	var keys []string
	for _, lim := range slices.Sorted(maps.Keys(r.lims)) {
		l := r.lims[lim]
		if typeLog {
			keys = append(keys, l.RedisKey(throttle.Key{TaskType: taskType}, throttle.ScopeType))
		}
		for i := lo; i < hi; i++ {
			keys = append(keys, l.RedisKey(throttle.Key{TaskType: taskType, Tenant: fmt.Sprint("t", i)}, throttle.ScopeTenant))
		}
	}
	return keys
}

// redirect matches the errors of a slot on the move: the limiter's error ends with the
// node's reply.
var redirect = regexp.MustCompile(`: (TRYAGAIN .*|(ASK|MOVED) 3650 127\.0\.0\.1:\d+)$`)

// tenantsOf matches the events of taskType whose tenant is t<lo> to t<hi-1>.
func tenantsOf(taskType string, lo, hi int) func(*changeEvent) bool {
	return func(ev *changeEvent) bool {
		var i int
		_, err := fmt.Sscanf(ev.tenant, "t%d", &i)
		return ev.taskType == taskType && err == nil && lo <= i && i < hi
	}
}

func not(f func(*changeEvent) bool) func(*changeEvent) bool {
	return func(ev *changeEvent) bool { return !f(ev) }
}

// TestLimiter_ClusterReshard moves the slot of email:send (3650) from the first master to
// the second while the limiter decides, a step at a time, each with a round of events
// under way (changeRounds' exact outcome):
//   - Round 0 before the move.
//   - Slot open, tenants t0-t9's logs moved, the type's not: round 1 starts. A decision of
//     t0-t9 names a moved and an unmoved key, and gets TRYAGAIN from the source (go-redis
//     retries it 3 times, then the limiter returns it as an error, and the test retries).
//     The other events are decided, on the source.
//   - The type's logs moved too: t0-t9's decisions find no key on the source, which
//     redirects them (ASK) to the target, which has both: round 1 ends. Round 2 starts:
//     t0-t9 are decided on the target (ASK), t10-t19 get TRYAGAIN (their tenant logs are
//     still on the source, the type's are not).
//   - The rest moved and the slot given to the target: round 2 ends (through ASK or
//     MOVED), and round 3 is decided on the target.
//
// Each round's admissions and each log's members are exactly changeRounds'; every
// error the limiter returned is a reply of a slot on the move (TRYAGAIN, or ASK or MOVED
// when go-redis's 3 redirects ran out while the slot changed); the target holds the
// type's 21 keys (the type log and 20 tenant logs), the source none.
//
// The plain limiter only: go-redis v9.23's cluster pipeline (and so AutoPipeline) mishandles
// a moving slot. When a batch's first command gets TRYAGAIN it sends the whole batch again,
// running its other commands twice (the limiter looks every call up as a replay there, so
// that the second run finds the first's admission); and a command that also got ASK is
// then queued for both nodes and sent to both at once (a data race in go-redis, seen
// under -race). README.md, Redis Cluster, says not to move slots under AutoPipeline.
func TestLimiter_ClusterReshard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t, 3)
	r := newChangeRun(t, cluster.Client(), false)
	moved := clusterTypes[0]
	from, to := cluster.Addrs[moved.master], cluster.Addrs[1]

	r.start(0).wait()
	mig, err := cluster.StartMigration(ctx, int(moved.slot), from, to)
	if err != nil {
		t.Fatal(err)
	}
	if err := mig.Move(ctx, r.changeKeys(moved.name, false, 0, 10)...); err != nil {
		t.Fatal(err)
	}
	r1 := r.start(1)
	r1.waitUntil("decided", not(tenantsOf(moved.name, 0, 10)), resolved)
	r1.waitUntil("refused", tenantsOf(moved.name, 0, 10), errored)
	if err := mig.Move(ctx, r.changeKeys(moved.name, true, 0, 0)...); err != nil {
		t.Fatal(err)
	}
	r1.wait()
	r2 := r.start(2)
	r2.waitUntil("decided", not(tenantsOf(moved.name, 10, 20)), resolved)
	r2.waitUntil("refused", tenantsOf(moved.name, 10, 20), errored)
	if err := mig.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	r2.wait()
	r.start(3).wait()

	seen, events := r.errorsSeen("TRYAGAIN", "ASK", "MOVED")
	total := 0
	for _, evs := range r.events {
		for _, ev := range evs {
			total += len(ev.errs)
			for _, err := range ev.errs {
				// go-redis follows up to 3 redirects or retries: the last one's reply is the
				// error, while the slot's state changes under it.
				if !redirect.MatchString(err.Error()) {
					t.Errorf("%s %s/%s round %d: error %v; want only TRYAGAIN, ASK or MOVED", ev.lim, ev.taskType, ev.tenant, ev.round, err)
				}
			}
		}
	}
	t.Logf("%d events got errors, %d attempts failed (TRYAGAIN %d, ASK %d, MOVED %d), %d replays",
		events, total, seen["TRYAGAIN"], seen["ASK"], seen["MOVED"], r.replays())
	// The refused events of rounds 1 and 2 (40) each got at least one.
	if seen["TRYAGAIN"] < 40 {
		t.Errorf("the limiter got %d TRYAGAIN errors; want at least 40, one per refused event", seen["TRYAGAIN"])
	}
	for addr, want := range map[string]int64{to: 21, from: 0} {
		n := redis.NewClient(&redis.Options{Addr: addr})
		got, err := n.ClusterCountKeysInSlot(ctx, int(moved.slot)).Result()
		n.Close()
		if err != nil || got != want {
			t.Errorf("CLUSTER COUNTKEYSINSLOT %d on %s = %d, %v; want %d", moved.slot, addr, got, err, want)
		}
	}
}

// TestLimiter_ClusterPrimaryKilled kills the first master of a 3-master cluster with a
// replica each (cluster-node-timeout 1s) between rounds 1 and 2, its replica in sync
// first (WaitReplicated: without synchronous replication, an admission the master had
// acknowledged but not yet sent would be lost with it). Round 2 starts at once: the
// events of the 3 task types it served fail (connection refused, then CLUSTERDOWN on
// every master while a slot has no master) until the replica is promoted; then they are
// decided there, and since the replica holds rounds 0 and 1, exactly as changeRounds
// says. Rounds 2 and 3 are then exactly changeRounds', on every master.
func TestLimiter_ClusterPrimaryKilled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartClusterWith(t, redistest.ClusterConfig{Masters: 3, ReplicasPerMaster: 1, NodeTimeout: time.Second})
	// The slot map reloaded each second, as cmd/worker's client does: go-redis's default
	// (60s) kept this client at the dead address for 55s (redisenv.ClusterStateReloadInterval).
	r := newChangeRun(t, cluster.ClientWith(&redis.ClusterOptions{ClusterStateReloadInterval: redisenv.ClusterStateReloadInterval}), true)
	r.start(0).wait()
	r.start(1).wait()
	if err := cluster.WaitReplicated(ctx); err != nil {
		t.Fatal(err)
	}
	dead := cluster.Addrs[0]
	killed := time.Now()
	cluster.Kill(dead)
	r2 := r.start(2)
	wctx, cancel := context.WithTimeout(ctx, changeDeadline)
	defer cancel()
	promoted, err := cluster.WaitPromoted(wctx, dead)
	if err != nil {
		t.Fatal(err)
	}
	promotedAfter := time.Since(killed)
	r2.wait()
	decidedAfter := time.Since(killed)
	r.start(3).wait()
	seen, events := r.errorsSeen("connection refused", "CLUSTERDOWN", "MOVED")
	t.Logf("replica %s promoted %v after the kill; round 2 all decided %v after it; %d events got errors (%v), %d replays",
		promoted, promotedAfter.Round(time.Millisecond), decidedAfter.Round(time.Millisecond), events, seen, r.replays())
	// Round 2's first attempts come within milliseconds of the kill, and no replica can be
	// promoted before the node timeout (1s): every event of the dead master's 3 types (120
	// per limiter) failed at least once, and none was decided in that second. With
	// AutoPipeline the first may not fail: go-redis's cluster pipeline retries a command on
	// its own, and under load (a clean-clone CI run: 10 of 120) it retried until the slot
	// had a master again, so for that limiter only the second holds.
	quiet := 0
	for _, ev := range r.events[2] {
		onDead := slices.ContainsFunc(clusterTypes, func(ct clusterType) bool { return ct.name == ev.taskType && ct.master == 0 })
		if !onDead {
			continue
		}
		if ev.resolved && ev.at.Before(killed.Add(time.Second)) {
			t.Errorf("%s %s/%s round 2: decided %v after the kill, before any replica could be promoted", ev.lim, ev.taskType, ev.tenant,
				ev.at.Sub(killed).Round(time.Millisecond))
		}
		switch {
		case len(ev.errs) > 0:
		case ev.lim == "plain":
			t.Errorf("%s %s/%s round 2: decided without an error, while its master was dead", ev.lim, ev.taskType, ev.tenant)
		default:
			quiet++
		}
	}
	if quiet > 0 {
		t.Logf("%d pipelined events of the dead master's types were decided after the promotion without an error reaching them", quiet)
	}
}

// TestLimiter_ClusterScriptFlush flushes the script cache of every node (3 masters, a
// replica each) before round 1, and again and again while round 2 is decided: an
// EVALSHA then answers NOSCRIPT and go-redis's Script.Run sends the script itself
// (EVAL), so nothing reaches the caller and the rounds are exactly changeRounds'. After
// round 1 every master has the script again (SCRIPT EXISTS), loaded by that EVAL.
func TestLimiter_ClusterScriptFlush(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartClusterWith(t, redistest.ClusterConfig{Masters: 3, ReplicasPerMaster: 1})
	r := newChangeRun(t, cluster.Client(), true)
	r.start(0).wait()
	exists := func() []bool {
		t.Helper()
		var got []bool
		for _, addr := range cluster.Addrs {
			n := redis.NewClient(&redis.Options{Addr: addr})
			e, err := n.ScriptExists(ctx, lua.SlidingWindow.Hash()).Result()
			n.Close()
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, e[0])
		}
		return got
	}
	if n, err := cluster.ScriptFlush(ctx); err != nil || n != 6 {
		t.Fatalf("ScriptFlush = %d, %v; want 6 nodes", n, err)
	}
	if got := exists(); !slices.Equal(got, []bool{false, false, false}) {
		t.Fatalf("SCRIPT EXISTS on the masters after SCRIPT FLUSH: %v, want none", got)
	}
	r.start(1).wait()
	if got := exists(); !slices.Equal(got, []bool{true, true, true}) {
		t.Errorf("SCRIPT EXISTS on the masters after round 1: %v, want all: each reloaded by an EVAL", got)
	}
	// Flushes back to back from before round 2 starts until it ends.
	stop, flushed := make(chan struct{}), make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				flushed <- n
				return
			default:
			}
			if _, err := cluster.ScriptFlush(ctx); err != nil {
				t.Error(err)
			}
			n++
		}
	}()
	time.Sleep(10 * time.Millisecond)
	r2 := r.start(2)
	<-r2.done
	close(stop)
	flushes := <-flushed
	r2.wait()
	r.start(3).wait()
	_, events := r.errorsSeen()
	t.Logf("%d flushes of all 6 nodes around round 2", flushes)
	if events != 0 {
		t.Errorf("%d events got an error; want none: NOSCRIPT is go-redis's to handle", events)
	}
}

// TestLimiter_ClusterKeyLayout writes the logs of 1,000 tenants in each of the 10 task
// types of clusterTypes (one admission each at t=0 under tenant=1/1m and type=1000/1m, all
// 10,000 admitted) on a 3-master cluster, and lists where every key landed: each of the
// 10,010 keys (10 x (1,000 tenant logs + 1 type log)) has its type's slot (CLUSTER KEYSLOT),
// is found by SCAN on the master that serves that slot and on no other, and
// CLUSTER COUNTKEYSINSLOT of each type's slot on its master is 1,001. The masters hold
// 3,003, 4,004 and 3,003 keys (DBSIZE): 3, 4 and 3 task types.
func TestLimiter_ClusterKeyLayout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t, 3)
	rdb := cluster.Client()
	l := clusterNew(t, rdb, throttle.Config{})
	const tenants = 1000
	quotas := []throttle.Quota{tenantQuota(1, time.Minute), typeQuota(tenants, time.Minute)}

	work := make(chan throttle.Key)
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted := 0
	for range 32 {
		wg.Go(func() {
			for key := range work {
				d, err := l.AllowAt(ctx, throttle.Request{Key: key, Quotas: quotas}, ms(0))
				if err != nil || !d.Allowed {
					t.Errorf("%s/%s: %s, %v; want admitted", key.TaskType, key.Tenant, outcomeOf(d), err)
					continue
				}
				mu.Lock()
				admitted++
				mu.Unlock()
			}
		})
	}
	for _, ct := range clusterTypes {
		for i := range tenants {
			work <- throttle.Key{TaskType: ct.name, Tenant: fmt.Sprintf("tenant-%04d", i)}
		}
	}
	close(work)
	wg.Wait()
	if admitted != 10*tenants {
		t.Fatalf("%d admitted, want %d", admitted, 10*tenants)
	}

	wantOn := map[string][]string{} // master addr -> the keys it must hold, sorted
	slotOf := map[string]int64{}    // key -> its type's slot
	for _, ct := range clusterTypes {
		if got := clusterTagSlot(t, rdb, ct.name); got != ct.slot {
			t.Errorf("%s: hash tag slot %d, want %d", ct.name, got, ct.slot)
		}
		addr := cluster.Addrs[ct.master]
		keys := []string{l.RedisKey(throttle.Key{TaskType: ct.name}, throttle.ScopeType)}
		for i := range tenants {
			keys = append(keys, l.RedisKey(throttle.Key{TaskType: ct.name, Tenant: fmt.Sprintf("tenant-%04d", i)}, throttle.ScopeTenant))
		}
		for _, k := range keys {
			slotOf[k] = ct.slot
		}
		wantOn[addr] = append(wantOn[addr], keys...)
	}
	// CLUSTER KEYSLOT of every key, in one pipeline to one node.
	node := redis.NewClient(&redis.Options{Addr: cluster.Addrs[0]})
	t.Cleanup(func() { _ = node.Close() })
	pipe := node.Pipeline()
	cmds := map[string]*redis.IntCmd{}
	for k := range slotOf {
		cmds[k] = pipe.ClusterKeySlot(ctx, k)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for k, cmd := range cmds {
		if cmd.Val() != slotOf[k] {
			t.Errorf("CLUSTER KEYSLOT %s = %d, want %d, its type's", k, cmd.Val(), slotOf[k])
		}
	}

	masters := clusterMasters(t, rdb)
	found := clusterScan(t, masters, "throttle:*")
	for i, addr := range cluster.Addrs {
		want := slices.Sorted(slices.Values(wantOn[addr]))
		if !slices.Equal(found[addr], want) {
			t.Errorf("master %d (%s) holds %d keys, want %d: those of its task types only", i, addr, len(found[addr]), len(want))
		}
		if n, err := masters[addr].DBSize(ctx).Result(); err != nil || n != []int64{3003, 4004, 3003}[i] {
			t.Errorf("DBSIZE on master %d (%s) = %d, %v; want %d", i, addr, n, err, []int64{3003, 4004, 3003}[i])
		}
	}
	var table strings.Builder
	for _, ct := range clusterTypes {
		addr := cluster.Addrs[ct.master]
		n, err := masters[addr].ClusterCountKeysInSlot(ctx, int(ct.slot)).Result()
		if err != nil || n != tenants+1 {
			t.Errorf("CLUSTER COUNTKEYSINSLOT %d on %s = %d, %v; want %d", ct.slot, addr, n, err, tenants+1)
		}
		fmt.Fprintf(&table, "\n  %-16s slot %5d  master %d (%s)  %d keys", ct.name, ct.slot, ct.master, addr, n)
	}
	t.Logf("where the keys landed:%s", table.String())
}

// TestLimiter_ClusterSplitSlotPipelined splits the slot of email:send between two
// masters and joins it again, with both limiters, AutoPipeline included: with tenants
// t0-t9's logs moved to the target and the type's not, round 1 starts; t0-t9's decisions
// get TRYAGAIN (no ASK: the source still has the type's logs), the others are decided on
// the source; then, between two attempts (no call under way), the move is cancelled (the
// logs moved back, the slot closed) and t0-t9 are decided there too. go-redis's cluster pipeline sends a node's whole batch again
// when its first command gets TRYAGAIN, so the pipelined limiter's calls that share a
// batch with a refused one run twice: the second run must find the first's admission
// (Limiter looks every call up as a replay there), or the caller would be told "denied"
// while its admission stands, and round 1 would admit fewer than 10 by its decisions.
// Rounds and logs are exactly changeRounds'.
func TestLimiter_ClusterSplitSlotPipelined(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := redistest.StartCluster(t, 3)
	r := newChangeRun(t, cluster.Client(), true)
	split := clusterTypes[0]
	r.start(0).wait()
	mig, err := cluster.StartMigration(ctx, int(split.slot), cluster.Addrs[split.master], cluster.Addrs[1])
	if err != nil {
		t.Fatal(err)
	}
	if err := mig.Move(ctx, r.changeKeys(split.name, false, 0, 10)...); err != nil {
		t.Fatal(err)
	}
	r1 := r.start(1)
	r1.waitUntil("decided", not(tenantsOf(split.name, 0, 10)), resolved)
	r1.waitUntil("refused", tenantsOf(split.name, 0, 10), errored)
	r.gate.Lock()
	err = mig.Cancel(ctx)
	r.gate.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	r1.wait()
	r.start(2).wait()
	r.start(3).wait()
	seen, events := r.errorsSeen("TRYAGAIN")
	t.Logf("%d events got errors (%d TRYAGAIN), %d replays (calls run twice, found by the second run)", events, seen["TRYAGAIN"], r.replays())
	for _, evs := range r.events {
		for _, ev := range evs {
			for _, err := range ev.errs {
				if !strings.HasSuffix(err.Error(), "TRYAGAIN Multiple keys request during rehashing of slot") {
					t.Errorf("%s %s/%s round %d: error %v; want only TRYAGAIN", ev.lim, ev.taskType, ev.tenant, ev.round, err)
				}
			}
		}
	}
}
