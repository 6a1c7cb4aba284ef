package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// This file runs the limiter on a 3-master Redis Cluster (redistest.StartCluster). Every
// key one decision passes (window logs, reservation sets, the owners hash) must hash to
// the task type's slot, or the script fails with CROSSSLOT; and the decisions must be
// exactly those a single node makes.

// clusterOutcome is an outcome and whether the event holds a reservation.
type clusterOutcome struct {
	outcome
	Reserved bool
}

// clusterStep is one call of a scenario: tenant's event at instant at (ms), holding the
// reservation resv ("" for none), and the exact decision it must get.
type clusterStep struct {
	at     int64
	tenant string
	resv   string
	want   clusterOutcome
}

// clusterRun plays steps for taskType under quotas on every limiter in ls (named by their
// keys), and fails the test for each decision that is not exactly its step's want.
func clusterRun(t *testing.T, ls map[string]*throttle.Limiter, taskType string, quotas []throttle.Quota, steps []clusterStep) {
	t.Helper()
	for name, l := range ls {
		for i, s := range steps {
			req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: s.tenant}, Quotas: quotas, Reservation: s.resv}
			d := allowAt(t, l, req, s.at)
			if got := (clusterOutcome{outcomeOf(d), d.Reserved}); got != s.want {
				t.Errorf("%s: step %d (t=%d tenant %q reservation %q):\n got %+v\nwant %+v", name, i, s.at, s.tenant, s.resv, got, s.want)
			}
		}
	}
}

// clusterNew returns a Limiter on rdb, failing t on error.
func clusterNew(t *testing.T, rdb redis.UniversalClient, cfg throttle.Config) *throttle.Limiter {
	t.Helper()
	l, err := throttle.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// clusterMasters returns a client of each master of rdb's cluster, by address.
func clusterMasters(t *testing.T, rdb *redis.ClusterClient) map[string]*redis.Client {
	t.Helper()
	var mu sync.Mutex
	masters := map[string]*redis.Client{}
	err := rdb.ForEachMaster(context.Background(), func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		masters[c.Options().Addr] = c
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return masters
}

// clusterSlotOwner returns the address of the master that serves each slot.
func clusterSlotOwner(t *testing.T, rdb *redis.ClusterClient) func(slot int64) string {
	t.Helper()
	ranges, err := rdb.ClusterSlots(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return func(slot int64) string {
		for _, r := range ranges {
			if int64(r.Start) <= slot && slot <= int64(r.End) {
				return r.Nodes[0].Addr
			}
		}
		t.Fatalf("slot %d is not served by any master: %v", slot, ranges)
		return ""
	}
}

// clusterTagSlot is the slot of the hash tag of taskType's keys: CLUSTER KEYSLOT of the
// escaped task type, which holds no brace, so the whole of it is hashed.
func clusterTagSlot(t *testing.T, rdb *redis.ClusterClient, taskType string) int64 {
	t.Helper()
	slot, err := rdb.ClusterKeySlot(context.Background(), url.PathEscape(taskType)).Result()
	if err != nil {
		t.Fatal(err)
	}
	return slot
}

// TestLimiter_AllowAtCluster decides on a 3-master Redis Cluster: quotas at both scopes,
// reservations with the fairness swap, hostile task types and tenants, and task types on
// every master at once. The first two run the same calls on a single node too: both must
// give exactly the decisions written down.
func TestLimiter_AllowAtCluster(t *testing.T) {
	t.Parallel()
	cluster := redistest.StartCluster(t, 3)
	rdb := cluster.Client()
	both := map[string]*throttle.Limiter{
		"cluster":     clusterNew(t, rdb, throttle.Config{}),
		"single node": clusterNew(t, redistest.Start(t), throttle.Config{}),
	}
	ctx := context.Background()

	// Type 3/1s and tenant 2/1s: two window logs and their two reservation sets in one
	// script call. A denial by one quota takes nothing from the other.
	t.Run("TenantAndTypeQuotas", func(t *testing.T) {
		t.Parallel()
		tq, nq := typeQuota(3, time.Second), tenantQuota(2, time.Second)
		admit := func(q throttle.Quota, count, reset int64) clusterOutcome {
			return clusterOutcome{outcome: outcome{Allowed: true, Quota: q, Count: int(count),
				Remaining: q.Limit.Events - int(count), ResetAfter: msd(reset)}}
		}
		deny := func(q throttle.Quota, retry, reset int64) clusterOutcome {
			return clusterOutcome{outcome: outcome{Quota: q, Count: q.Limit.Events,
				RetryAfter: msd(retry), ResetAfter: msd(reset)}}
		}
		clusterRun(t, both, "api:call", []throttle.Quota{tq, nq}, []clusterStep{
			{at: 0, tenant: "A", want: admit(nq, 1, 1000)},
			{at: 1, tenant: "A", want: admit(nq, 2, 1000)},
			{at: 2, tenant: "A", want: deny(nq, 998, 999)}, // A's oldest (t=0) leaves its window at 1000
			{at: 3, tenant: "B", want: admit(tq, 3, 1000)}, // A's denial took no type slot
			{at: 4, tenant: "B", want: deny(tq, 996, 999)}, // the type is full until t=0 leaves
			{at: 5, tenant: "C", want: deny(tq, 995, 998)},
			{at: 1000, tenant: "A", want: admit(tq, 3, 1000)}, // at 2 + 998, as promised
			{at: 1000, tenant: "B", want: deny(tq, 1, 1000)},  // type: 1, 3, 1000; t=1 leaves at 1001
		})
	})

	// Type 4/1s. Tenant A is admitted 4 times at t=0 and reserves 8 more: t=1000 x4 and
	// t=2000 x4. Tenant B reserves 2 at t=100 and, by the fairness swap, takes 2 of A's
	// slots at t=1000; A's two displaced reservations move behind its backlog, to t=3000.
	// The owners hash is a third key in the script call.
	t.Run("ReservationsFairness", func(t *testing.T) {
		t.Parallel()
		const taskType = "fair:call"
		tq := typeQuota(4, time.Second)
		var steps []clusterStep
		for i := range 4 {
			steps = append(steps, clusterStep{at: 0, tenant: "A", resv: fmt.Sprintf("A-%d", i),
				want: clusterOutcome{outcome: outcome{Allowed: true, Quota: tq, Count: i + 1, Remaining: 3 - i, ResetAfter: msd(1000)}}})
		}
		for i := 4; i < 12; i++ {
			// A-4..A-7 at t=1000, A-8..A-11 at t=2000; Count is every entry in the
			// window and ahead of it: 4 admissions and the reservations before this one.
			retry := int64(1000 * (i / 4))
			steps = append(steps, clusterStep{at: 0, tenant: "A", resv: fmt.Sprintf("A-%d", i),
				want: clusterOutcome{outcome: outcome{Quota: tq, Count: i, RetryAfter: msd(retry), ResetAfter: msd(retry + 1000)}, Reserved: true}})
		}
		for i := range 2 {
			// B's first reservation already moved one of A's to t=3000: reset at 4000.
			steps = append(steps, clusterStep{at: 100, tenant: "B", resv: fmt.Sprintf("B-%d", i),
				want: clusterOutcome{outcome: outcome{Quota: tq, Count: 12 + i, RetryAfter: msd(900), ResetAfter: msd(3900)}, Reserved: true}})
		}
		clusterRun(t, both, taskType, []throttle.Quota{tq}, steps)

		// Where each reservation is on the cluster: read the reservation set, with the
		// owners hash beside it, through the cluster client.
		tag := "throttle:{" + url.PathEscape(taskType) + "}:"
		zs, err := rdb.ZRangeWithScores(ctx, tag+"reserved:type", 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		got := map[int64][]string{} // instant -> reservation ids, sorted
		for _, z := range zs {
			_, id, _ := strings.Cut(z.Member.(string), "@")
			got[int64(z.Score)] = append(got[int64(z.Score)], id)
		}
		count := func(ids []string, tenant string) int {
			return len(slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return !strings.HasPrefix(id, tenant+"-") }))
		}
		for _, w := range []struct{ at, a, b int64 }{{1000, 2, 2}, {2000, 4, 0}, {3000, 2, 0}} {
			if a, b := count(got[w.at], "A"), count(got[w.at], "B"); int64(a) != w.a || int64(b) != w.b || len(got[w.at]) != int(w.a+w.b) {
				t.Errorf("reservations at t=%d: %v; want %d of A and %d of B", w.at, got[w.at], w.a, w.b)
			}
		}
		if len(zs) != 10 {
			t.Errorf("%d reservations, want 10 (8 of A, 2 of B): %v", len(zs), got)
		}
		if n, err := rdb.HLen(ctx, tag+"owners").Result(); err != nil || n != 10 {
			t.Errorf("HLEN %sowners = %d, %v; want 10, one owner per reservation", tag, n, err)
		}

		// At t=1000 the holders of that instant's 4 slots are admitted, and an event
		// without a reservation is denied until t=2000's reservations are used or expire.
		l := both["cluster"]
		for _, id := range got[1000] {
			tenant, _, _ := strings.Cut(id, "-")
			req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: tenant}, Quotas: []throttle.Quota{tq}, Reservation: id}
			if d := allowAt(t, l, req, 1000); !d.Allowed || d.Replay {
				t.Errorf("%s at t=1000: %+v, want admitted", id, outcomeOf(d))
			}
		}
		req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: "C"}, Quotas: []throttle.Quota{tq}}
		if d := allowAt(t, l, req, 1000); d.Allowed {
			t.Errorf("an unreserved event at t=1000 was admitted into a window of 4 reservations: %+v", outcomeOf(d))
		}
	})

	// Task types and tenants that try to move or break the hash tag. For each pair, an
	// admission and then a denial that reserves write all five keys a decision can touch
	// (two logs, two reservation sets, the owners hash); each is found by SCAN on the
	// master that serves the slot of the escaped task type, and CLUSTER KEYSLOT of each is
	// that slot. Cancel (a MULTI over the same keys) works too. An empty task type is
	// refused before any Redis call.
	t.Run("HostileKeysOneSlot", func(t *testing.T) {
		t.Parallel()
		types := []string{"{a}", "}", "{", "{}", "a}{b", "a:b", "}:tenant:{", "%7B", "日本語", "a b\n"}
		tenants := []string{"{a}", "}", "{", "a:b", "", "}:type", "日本語"}
		masters := clusterMasters(t, rdb)
		owner := clusterSlotOwner(t, rdb)
		quotas := []throttle.Quota{tenantQuota(1, time.Minute), typeQuota(100, time.Minute)}
		onMaster := map[string]int{}
		n := 0
		for _, tt := range types {
			for _, tenant := range tenants {
				n++
				prefix := fmt.Sprintf("hostile%d", n)
				l := clusterNew(t, rdb, throttle.Config{Prefix: prefix})
				req := throttle.Request{Key: throttle.Key{TaskType: tt, Tenant: tenant}, Quotas: quotas, Reservation: "task-" + prefix}
				name := fmt.Sprintf("type %q tenant %q", tt, tenant)
				if d, err := l.AllowAt(ctx, req, ms(0)); err != nil || !d.Allowed {
					t.Fatalf("%s at t=0: %+v, %v; want admitted", name, outcomeOf(d), err)
				}
				if d, err := l.AllowAt(ctx, req, ms(1)); err != nil || d.Allowed || !d.Reserved || d.RetryAfter != msd(59999) {
					t.Fatalf("%s at t=1: %+v reserved=%v, %v; want a reservation at t=60000", name, outcomeOf(d), d.Reserved, err)
				}

				want := clusterTagSlot(t, rdb, tt)
				home := owner(want)
				onMaster[home]++
				var found []string
				for addr, m := range masters {
					var keys []string
					it := m.Scan(ctx, 0, prefix+":*", 100).Iterator()
					for it.Next(ctx) {
						keys = append(keys, it.Val())
					}
					if err := it.Err(); err != nil {
						t.Fatal(err)
					}
					if len(keys) > 0 && addr != home {
						t.Errorf("%s: keys %q on %s, want them all on %s, which serves slot %d", name, keys, addr, home, want)
					}
					found = append(found, keys...)
				}
				for _, k := range found {
					if slot, err := rdb.ClusterKeySlot(ctx, k).Result(); err != nil || slot != want {
						t.Errorf("%s: CLUSTER KEYSLOT %q = %d, %v; want %d", name, k, slot, err, want)
					}
				}
				for _, k := range []string{l.RedisKey(req.Key, throttle.ScopeTenant), l.RedisKey(req.Key, throttle.ScopeType)} {
					if !slices.Contains(found, k) {
						t.Errorf("%s: window log %q not found; found %q", name, k, found)
					}
				}
				if len(found) != 5 {
					t.Errorf("%s: found %d keys %q, want 5: 2 logs, 2 reservation sets, the owners hash", name, len(found), found)
				}
				if err := l.Cancel(ctx, req); err != nil {
					t.Errorf("%s: Cancel: %v", name, err)
				}
			}
		}
		if len(onMaster) < 2 {
			t.Errorf("the hostile task types all hash to one master (%v): the test shows less than it should", onMaster)
		}
		_, err := both["cluster"].AllowAt(ctx, throttle.Request{Key: throttle.Key{TaskType: "", Tenant: "{a}"}, Quotas: quotas}, ms(0))
		if !errors.Is(err, throttle.ErrInvalid) {
			t.Errorf("empty task type: err = %v, want ErrInvalid", err)
		}
	})

	// Two task types on each master, decided at the same time: 10 concurrent events of
	// each type at t=0 under type=5/1s + tenant=3/1s (tenants 0..4, two events each). Each
	// type admits exactly 5, each of its tenants at most 2, and its log holds 5 entries on
	// the master that serves its slot.
	t.Run("TypesOnEveryMaster", func(t *testing.T) {
		t.Parallel()
		masters := clusterMasters(t, rdb)
		owner := clusterSlotOwner(t, rdb)
		perMaster := map[string][]string{} // addr -> task types whose slot it serves
		for i := 0; len(perMaster) < len(masters) || slices.ContainsFunc(slices.Collect(maps.Values(perMaster)), func(ts []string) bool { return len(ts) < 2 }); i++ {
			tt := fmt.Sprintf("spread:%d", i)
			if addr := owner(clusterTagSlot(t, rdb, tt)); len(perMaster[addr]) < 2 {
				perMaster[addr] = append(perMaster[addr], tt)
			}
		}
		l := both["cluster"]
		quotas := []throttle.Quota{typeQuota(5, time.Second), tenantQuota(3, time.Second)}
		type result struct {
			tt, tenant string
			d          throttle.Decision
			err        error
		}
		results := make(chan result, 6*10)
		var wg sync.WaitGroup
		for _, types := range perMaster {
			for _, tt := range types {
				for g := range 10 {
					wg.Go(func() {
						tenant := fmt.Sprint(g / 2)
						req := throttle.Request{Key: throttle.Key{TaskType: tt, Tenant: tenant}, Quotas: quotas}
						d, err := l.AllowAt(ctx, req, ms(0))
						results <- result{tt, tenant, d, err}
					})
				}
			}
		}
		wg.Wait()
		close(results)
		admitted := map[string]int{}
		for r := range results {
			switch {
			case r.err != nil:
				t.Errorf("%s/%s: %v", r.tt, r.tenant, r.err)
			case r.d.Allowed:
				admitted[r.tt]++
			case r.d.Quota != quotas[0] || r.d.RetryAfter != time.Second || r.d.Count != 5:
				t.Errorf("%s/%s denied %+v; want denied by the type quota, full, for 1s", r.tt, r.tenant, outcomeOf(r.d))
			}
		}
		for addr, types := range perMaster {
			for _, tt := range types {
				if admitted[tt] != 5 {
					t.Errorf("%s: %d of 10 admitted, want 5", tt, admitted[tt])
				}
				key := l.RedisKey(throttle.Key{TaskType: tt}, throttle.ScopeType)
				if n, err := masters[addr].ZCard(ctx, key).Result(); err != nil || n != 5 {
					t.Errorf("ZCARD %s on %s = %d, %v; want 5 entries on the master that serves its slot", key, addr, n, err)
				}
			}
		}
	})
}
