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
// key one decision touches (window logs, their pending and cost sets, the type's leases,
// fair tags and fair state, and for a fairness swap another tenant's logs) must hash to
// the task type's slot, or the script fails with CROSSSLOT or a non-local key; and the
// decisions must be exactly those a single node makes.

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

// clusterScan returns the keys matching pattern on each master, by address.
func clusterScan(t *testing.T, masters map[string]*redis.Client, pattern string) map[string][]string {
	t.Helper()
	ctx := context.Background()
	found := map[string][]string{}
	for addr, m := range masters {
		it := m.Scan(ctx, 0, pattern, 100).Iterator()
		for it.Next(ctx) {
			found[addr] = append(found[addr], it.Val())
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
		slices.Sort(found[addr])
	}
	return found
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

	// Type 3/1s and tenant 2/1s: two window logs in one script call. A denial by one quota
	// takes nothing from the other. An admission names the quota with the fewest slots
	// left (the first on ties), a denial the first with no room a millisecond before the
	// instant it waits for.
	t.Run("TenantAndTypeQuotas", func(t *testing.T) {
		t.Parallel()
		topologyRun(t, both, "api:call", tenantAndTypeQuotas, tenantAndTypeScenario())
	})

	// Type 4/1s. Tenant A is admitted 4 times at t=0 and reserves 8 more: t=1000 x4 and
	// t=2000 x4, fair tags 1..8 (x 10^6). Tenant B reserves 2 at t=100 with tags 1 and 2:
	// by the fairness swap each takes, from the first reservation pending at its fair
	// rank's instant (1000), the first of another tenant with a later tag: A-5 (A-4's tag
	// 1 is not later than B-0's), then A-6, which move to t=3000, their own earliest
	// instants. So t=1000 holds 2 of A and 2 of B. Leases,
	// fair tags and fair state are three more keys in the script call, and the swap
	// touches none but the type's.
	t.Run("ReservationsFairness", func(t *testing.T) {
		t.Parallel()
		const taskType = "fair:call"
		tq := typeQuota(4, time.Second)
		var steps []topologyStep
		for i := range 4 {
			steps = append(steps, topologyStep{at: 0, tenant: "A", resv: fmt.Sprintf("A-%d", i),
				want: outcome{Allowed: true, Quota: tq, Count: i + 1, Remaining: 3 - i, At: 0}})
		}
		for i := 4; i < 12; i++ {
			// A-4..A-7 at t=1000, A-8..A-11 at t=2000; Count is the window ending at the
			// decision: the 4 admissions.
			steps = append(steps, topologyStep{at: 0, tenant: "A", resv: fmt.Sprintf("A-%d", i),
				want: outcome{Reserved: true, Quota: tq, Count: 4, RetryAfter: msd(1000 * int64(i/4)), At: 0}})
		}
		for i := range 2 {
			steps = append(steps, topologyStep{at: 100, tenant: "B", resv: fmt.Sprintf("B-%d", i),
				want: outcome{Reserved: true, Quota: tq, Count: 4, RetryAfter: msd(900), At: 100}})
		}
		topologyRun(t, both, taskType, []throttle.Quota{tq}, steps)

		// Where each reservation is on the cluster: read the pending set, with the leases
		// and fair tags beside it, through the cluster client.
		tag := "throttle:{" + url.PathEscape(taskType) + "}:"
		zs, err := rdb.ZRangeWithScores(ctx, tag+"pending:type", 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		got := map[int64][]string{} // instant -> reservation ids, sorted
		for _, z := range zs {
			_, id, _ := strings.Cut(z.Member.(string), ":")
			got[int64(z.Score)] = append(got[int64(z.Score)], id)
		}
		want := map[int64][]string{1000: {"A-4", "A-7", "B-0", "B-1"}, 2000: {"A-10", "A-11", "A-8", "A-9"}, 3000: {"A-5", "A-6"}}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("reservations by instant:\n got %v\nwant %v", got, want)
		}
		if n, err := rdb.HLen(ctx, tag+"leases").Result(); err != nil || n != 10 {
			t.Errorf("HLEN %sleases = %d, %v; want 10, one lease per reservation", tag, n, err)
		}
		if n, err := rdb.ZCard(ctx, tag+"fair").Result(); err != nil || n != 10 {
			t.Errorf("ZCARD %sfair = %d, %v; want 10, one fair tag per reservation", tag, n, err)
		}

		// At t=1000 the holders of that instant's 4 slots are admitted, and an event
		// without a reservation is denied until 3000, the first instant after them with
		// room (2000 is full of reservations, 3000 has two).
		l := both["cluster"]
		for _, id := range got[1000] {
			tenant, _, _ := strings.Cut(id, "-")
			req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: tenant}, Quotas: []throttle.Quota{tq}, Reservation: id}
			resvWantAdmitted(t, l, req, 1000)
		}
		req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: "C"}, Quotas: []throttle.Quota{tq}}
		wantOutcome(t, l, req, 1000, outcome{Quota: tq, Count: 4, RetryAfter: msd(2000), At: 1000})
	})

	// Task types and tenants that try to move or break the hash tag. For each pair, a
	// cost-2 admission and then a denial that reserves write all nine keys a decision can
	// touch (two logs, their pending and cost sets, the type's leases, fair tags and fair
	// state); each is found by SCAN on the master that serves the slot of the escaped task
	// type, and CLUSTER KEYSLOT of each is that slot. Cancel then gives up the
	// reservation there too (the script finds its logs from the lease). An empty task type
	// is refused before any Redis call.
	t.Run("HostileKeysOneSlot", func(t *testing.T) {
		t.Parallel()
		types := []string{"{a}", "}", "{", "{}", "a}{b", "a:b", "}:tenant:{", "%7B", "日本語", "a b\n", "x}:pending:type"}
		tenants := []string{"{a}", "}", "{", "a:b", "", "}:type", "日本語", "pending:x", "leases"}
		masters := clusterMasters(t, rdb)
		owner := clusterSlotOwner(t, rdb)
		tq := tenantQuota(2, time.Minute)
		quotas := []throttle.Quota{tq, typeQuota(100, time.Minute)}
		onMaster := map[string]int{}
		n := 0
		for _, tt := range types {
			for _, tenant := range tenants {
				n++
				prefix := fmt.Sprintf("hostile%d", n)
				l := clusterNew(t, rdb, throttle.Config{Prefix: prefix})
				key := throttle.Key{TaskType: tt, Tenant: tenant}
				name := fmt.Sprintf("type %q tenant %q", tt, tenant)
				if d, err := l.AllowAt(ctx, throttle.Request{Key: key, Quotas: quotas, Cost: 2}, ms(0)); err != nil || !d.Allowed {
					t.Fatalf("%s at t=0: %s, %v; want admitted", name, outcomeOf(d), err)
				}
				req := throttle.Request{Key: key, Quotas: quotas, Reservation: "task-" + prefix}
				want := outcome{Reserved: true, Quota: tq, Count: 2, RetryAfter: msd(59999), At: 1}
				if d, err := l.AllowAt(ctx, req, ms(1)); err != nil || outcomeOf(d) != want {
					t.Fatalf("%s at t=1: %s, %v; want %s", name, outcomeOf(d), err, want)
				}

				slot := clusterTagSlot(t, rdb, tt)
				home := owner(slot)
				onMaster[home]++
				check := func(when string, wantKeys []string) {
					t.Helper()
					var found []string
					for addr, keys := range clusterScan(t, masters, prefix+":*") {
						if len(keys) > 0 && addr != home {
							t.Errorf("%s, %s: keys %q on %s, want them all on %s, which serves slot %d", name, when, keys, addr, home, slot)
						}
						found = append(found, keys...)
					}
					for _, k := range found {
						if s, err := rdb.ClusterKeySlot(ctx, k).Result(); err != nil || s != slot {
							t.Errorf("%s, %s: CLUSTER KEYSLOT %q = %d, %v; want %d", name, when, k, s, err, slot)
						}
					}
					slices.Sort(found)
					slices.Sort(wantKeys)
					if !slices.Equal(found, wantKeys) {
						t.Errorf("%s, %s: keys\n got %q\nwant %q", name, when, found, wantKeys)
					}
				}
				logs := []string{l.RedisKey(key, throttle.ScopeTenant), l.RedisKey(key, throttle.ScopeType)}
				costs := []string{resvCostsKey(t, l, key, throttle.ScopeTenant), resvCostsKey(t, l, key, throttle.ScopeType)}
				pending := []string{resvSetKey(t, l, key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeType)}
				perType := []string{resvTypeKey(t, l, tt, "leases"), resvTypeKey(t, l, tt, "fair"), resvTypeKey(t, l, tt, "fairstate")}
				check("reserved", slices.Concat(logs, costs, pending, perType))
				if err := l.Cancel(ctx, req); err != nil {
					t.Errorf("%s: Cancel: %v", name, err)
				}
				// The pending sets, the lease and the fair tag are gone; the fair state stays
				// (the tenant's latest tag) until it expires.
				check("cancelled", slices.Concat(logs, costs, perType[2:]))
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
			case outcomeOf(r.d) != (outcome{Quota: quotas[0], Count: 5, RetryAfter: time.Second, At: 0}):
				t.Errorf("%s/%s denied %s; want denied by the type quota, full, for 1s", r.tt, r.tenant, outcomeOf(r.d))
			}
		}
		for addr, types := range perMaster {
			for _, tt := range types {
				if admitted[tt] != 5 {
					t.Errorf("%s: %d of 10 admitted, want 5", tt, admitted[tt])
				}
				key := l.RedisKey(throttle.Key{TaskType: tt}, throttle.ScopeType)
				if n := zcard(t, masters[addr], key); n != 5 {
					t.Errorf("%s on %s holds %d entries; want 5 on the master that serves its slot", key, addr, n)
				}
			}
		}
	})
}
