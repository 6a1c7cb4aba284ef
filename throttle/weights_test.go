package throttle_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Weights are sums, not copies (core v2, rule 2): an event of cost c is one entry in each
// log, and every count is a sum of costs.

// llmQuotas is the README's rule "llm:complete tenant=40000/1m tenant=1000000/24h".
func llmQuotas() []throttle.Quota {
	return []throttle.Quota{tenantQuota(40_000, time.Minute), tenantQuota(1_000_000, 24*time.Hour)}
}

// TestLimiter_AllowAt_weightsOneEntryPerEvent runs the README's llm:complete rule at 50
// tasks a second for 20 seconds, costs 1 to 40,000 tokens, each task with a reservation,
// coming back for it on time: every event is one entry in the log (and, of cost > 1, one
// in its costs set), the tokens admitted in any minute never exceed 40,000, and a task of
// cost 40,000 or 8,000 held back by a reservation is admitted when it comes back (v1 could
// not: Lua's unpack stops at 7999 values).
func TestLimiter_AllowAt_weightsOneEntryPerEvent(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(7, 7))
	type waiting struct {
		req throttle.Request
		at  int64
	}
	var back []waiting
	var admittedAt []time.Time
	var admittedCost []int
	events := 0
	// task-0 takes 30,000 tokens; task-1 (40,000) and task-2 (8,000) must wait for it.
	big := map[string]bool{"task-1": true, "task-2": true}
	for i := range 1001 {
		now := int64(i) * 20 // 50 a second; after the last, every waiting task comes back
		if i == 1000 {
			now = 1 << 40
		}
		for len(back) > 0 && back[0].at <= now {
			w := back[0]
			back = back[1:]
			d := allowAtV2(t, l, w.req, w.at)
			if !d.Allowed || !d.Held {
				t.Fatalf("%s (cost %d) back at its instant %d: %+v, want admitted", w.req.Reservation, w.req.Cost, w.at, d)
			}
			delete(big, w.req.Reservation)
			admittedAt, admittedCost = append(admittedAt, d.At), append(admittedCost, w.req.Cost)
		}
		if i == 1000 {
			break
		}
		cost := 1 + rng.IntN(40_000)
		switch i {
		case 0:
			cost = 30_000
		case 1:
			cost = 40_000
		case 2:
			cost = 8_000
		}
		req := throttle.Request{Key: throttle.Key{TaskType: "llm:complete", Tenant: "acme"}, Quotas: llmQuotas(),
			Cost: cost, Reservation: fmt.Sprintf("task-%d", i)}
		d := allowAtV2(t, l, req, now)
		events++
		switch {
		case d.Allowed:
			admittedAt, admittedCost = append(admittedAt, d.At), append(admittedCost, cost)
		case d.Reserved:
			if i == 1 || i == 2 {
				delete(big, "now:"+req.Reservation) // reserved, as it must be
			}
			back = append(back, waiting{req, now + d.RetryAfter.Milliseconds()})
			slicesSortWaiting(back, func(w waiting) int64 { return w.at })
		default:
			t.Fatalf("task-%d: %+v, want admitted or reserved", i, d)
		}
	}
	key := l.RedisKey(throttle.Key{TaskType: "llm:complete", Tenant: "acme"}, throttle.ScopeTenant)
	entries, err := rdb.ZCount(ctx, key, "-1e15", "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	costs, err := rdb.ZCard(ctx, "throttle:{llm:complete}:costs:tenant:acme").Result()
	if err != nil {
		t.Fatal(err)
	}
	// Every event decided is admitted by now; the log keeps those of the last 24 hours
	// (before the last decision, at the newest admission).
	last := slices.MaxFunc(admittedAt, time.Time.Compare)
	inDay, weightedInDay := 0, 0
	for i, at := range admittedAt {
		if at.After(last.Add(-24 * time.Hour)) {
			inDay++
			if admittedCost[i] > 1 {
				weightedInDay++
			}
		}
	}
	if len(admittedAt) != events || entries != int64(inDay) || costs != int64(weightedInDay) {
		t.Errorf("%d of %d events admitted; the log holds %d entries and its costs set %d, want one per event of the last day: %d and %d",
			len(admittedAt), events, entries, costs, inDay, weightedInDay)
	}
	if len(big) > 0 {
		t.Errorf("tasks %v, reserved, never ran", big)
	}
	// The most tokens in any minute and in any day, by the admissions' instants.
	for _, c := range []struct {
		w     time.Duration
		limit int
	}{{time.Minute, 40_000}, {24 * time.Hour, 1_000_000}} {
		most := 0
		for i, end := range admittedAt {
			sum := 0
			for j, at := range admittedAt {
				if at.After(end.Add(-c.w)) && !at.After(end) {
					sum += admittedCost[j]
				}
			}
			if sum > c.limit {
				t.Fatalf("the %s window ending at admission %d holds %d tokens, over %d", c.w, i, sum, c.limit)
			}
			most = max(most, sum)
		}
		if c.w == time.Minute && most < 39_000 {
			t.Errorf("the fullest minute holds %d tokens: the limit 40,000 is not used", most)
		}
	}
}

// slicesSortWaiting keeps a small slice sorted by key (insertion sort: it is nearly so).
func slicesSortWaiting[T any](s []T, key func(T) int64) {
	for i := len(s) - 1; i > 0 && key(s[i]) < key(s[i-1]); i-- {
		s[i], s[i-1] = s[i-1], s[i]
	}
}

// TestLimiter_AllowAt_workDoesNotGrowWithCost: deciding events of cost 13,333 under a limit
// of 40,000 runs exactly as many Redis commands (INFO commandstats) as events of cost 2
// under a limit of 6, call for call: three admissions, a reservation, its claim. The
// script's work depends on the entries, never on a cost.
func TestLimiter_AllowAt_workDoesNotGrowWithCost(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	run := func(tenant string, limit, cost int) []int64 {
		q := []throttle.Quota{tenantQuota(limit, time.Minute)}
		var cmds []int64
		var retry int64
		for i, at := range []int64{0, 10, 20, 30} {
			req := throttle.Request{Key: throttle.Key{TaskType: "llm:complete", Tenant: tenant}, Quotas: q, Cost: cost,
				Reservation: fmt.Sprintf("%s-%d", tenant, i)}
			cmds = append(cmds, commandsOf(t, rdb, func() {
				d := allowAtV2(t, l, req, at)
				if i < 3 && !d.Allowed || i == 3 && !d.Reserved {
					t.Fatalf("%s call %d at t=%d: %+v", tenant, i, at, d)
				}
				retry = d.RetryAfter.Milliseconds()
			}))
			if i == 3 {
				cmds = append(cmds, commandsOf(t, rdb, func() {
					if d := allowAtV2(t, l, req, at+retry); !d.Allowed || !d.Held {
						t.Fatalf("%s claim at t=%d: %+v", tenant, at+retry, d)
					}
				}))
			}
		}
		return cmds
	}
	small := run("small", 6, 2)
	large := run("large", 40_000, 13_333)
	if !slices.Equal(small, large) {
		t.Errorf("commands per call: %v for cost 2, %v for cost 13,333; want the same", small, large)
	}
}

// commandsOf returns the number of Redis commands fn makes the server run, by INFO
// commandstats: script calls and INFO itself not counted, the commands scripts run are.
func commandsOf(t *testing.T, rdb *redis.Client, fn func()) int64 {
	t.Helper()
	ctx := context.Background()
	before, err := redistest.ReadStats(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	fn()
	after, err := redistest.ReadStats(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for name, c := range after.Sub(before).Commands {
		if name != "info" && name != "evalsha" && name != "eval" {
			n += c.Calls
		}
	}
	return n
}

// TestLimiter_Release_costsKeepTTL: releasing a weighted reservation rewrites the costs
// set of its log (each later entry's running sum), which can empty the set and make it
// anew; the set still expires with its log. Rule tenant=10/1s at the callers' 0: ten
// cost-1 admissions fill the window, then task-A and task-B reserve at cost 5 (both at
// 1000: 5 + 5 fit one window), and task-A is released, as the sweeper releases the
// reservation of a deleted task. The costs set then holds task-B's entry alone, its
// running sum rewritten, with its log's TTL: 1000 + 1s + the 5 s claim timeout, 7000 ms
// from the reservations.
func TestLimiter_Release_costsKeepTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, rdb := newLimiterClient(t, throttle.Config{})
	key := throttle.Key{TaskType: "llm:complete", Tenant: "hooli"}
	q := []throttle.Quota{tenantQuota(10, time.Second)}
	at := time.UnixMilli(0)
	for i := range 10 {
		if d, err := l.AllowAt(ctx, throttle.Request{Key: key, Quotas: q}, at); err != nil || !d.Allowed {
			t.Fatalf("admission %d: %+v, %v", i+1, d, err)
		}
	}
	for _, tok := range []string{"task-A", "task-B"} {
		d, err := l.AllowAt(ctx, throttle.Request{Key: key, Quotas: q, Cost: 5, Reservation: tok}, at)
		if err != nil || !d.Reserved || d.RetryAfter != time.Second {
			t.Fatalf("%s: %+v, %v; want reserved for 1s", tok, d, err)
		}
	}
	if ok, err := l.Release(ctx, "llm:complete", "task-A"); err != nil || !ok {
		t.Fatalf("Release(task-A) = %v, %v; want true", ok, err)
	}
	costs, log := "throttle:{llm:complete}:costs:tenant:hooli", "throttle:{llm:complete}:tenant:hooli"
	members, err := rdb.ZRange(ctx, costs, 0, -1).Result()
	if err != nil || len(members) != 1 || members[0] != "0000000000000004|@5:task-B" {
		t.Fatalf("costs set %v, %v; want task-B's entry alone, 0000000000000004|@5:task-B", members, err)
	}
	for _, k := range []string{costs, log} {
		if ttl := rdb.PTTL(ctx, k).Val(); ttl <= 6*time.Second || ttl > 7*time.Second {
			t.Errorf("%s: PTTL %v, want within (6s, 7s]: the log's 7000 ms", k, ttl)
		}
	}
}
