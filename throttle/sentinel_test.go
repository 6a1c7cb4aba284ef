package throttle_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// This file runs the limiter through a Sentinel failover client (redistest.StartSentinel:
// a primary, a replica and 3 sentinels) beside a single node: the same calls must get
// exactly the same decisions, write the same keys, and the primary's keys must reach the
// replica, TTLs and all, which is what a promoted replica decides from.

// topologyStep is one call of a scenario: tenant's event of cost cost (0: 1) at instant at
// (ms), with Member member ("": a fresh one) and holding the reservation resv ("": none),
// and the exact decision it must get.
type topologyStep struct {
	at     int64
	tenant string
	cost   int
	member string
	resv   string
	want   outcome
}

// topologyRun plays steps for taskType under quotas on every limiter in ls (named by their
// keys), and fails the test for each decision that is not exactly its step's want.
func topologyRun(t *testing.T, ls map[string]*throttle.Limiter, taskType string, quotas []throttle.Quota, steps []topologyStep) {
	t.Helper()
	for _, name := range slices.Sorted(maps.Keys(ls)) {
		for i, s := range steps {
			req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: s.tenant}, Quotas: quotas,
				Cost: s.cost, Member: s.member, Reservation: s.resv}
			d := allowAt(t, ls[name], req, s.at)
			if got := outcomeOf(d); got != s.want {
				t.Errorf("%s: %s step %d (t=%d tenant %q cost %d member %q reservation %q):\n got %s\nwant %s",
					name, taskType, i, s.at, s.tenant, s.cost, s.member, s.resv, got, s.want)
			}
		}
	}
}

// TestLimiter_AllowAtSentinel decides through a Sentinel failover client and on a single
// node: quotas at both scopes, weighted events and replays, weighted reservations claimed
// at their instants. Both must give exactly the decisions written down (each taken from
// the single-node test of the same rule, named below). Then the keys: the primary holds
// exactly the keys the single node holds, the replica has every one of them byte for byte
// (DUMP) once WAIT says it caught up, each with a TTL there too.
func TestLimiter_AllowAtSentinel(t *testing.T) {
	t.Parallel()
	sentinel := redistest.StartSentinel(t)
	single := redistest.StartServer(t)
	both := map[string]*throttle.Limiter{
		"sentinel":    clusterNew(t, sentinel.Client(), throttle.Config{}),
		"single node": clusterNew(t, single.Client(), throttle.Config{}),
	}

	// Type 3/1s and tenant 2/1s, as on a cluster.
	topologyRun(t, both, "api:call", tenantAndTypeQuotas, tenantAndTypeScenario())

	// Tenant 3/1s, events of cost 1 and 2 and their replays, as in TestLimiter_AllowAt_replay:
	// a replay reports the admission it replays and takes no slot; a denial replayed is a
	// denial; a denied member is admitted later as a new event.
	q3 := tenantQuota(3, time.Second)
	topologyRun(t, both, "replay:call", []throttle.Quota{q3}, []topologyStep{
		{at: 1000, tenant: "acme", member: "evt-1", want: outcome{Allowed: true, Quota: q3, Count: 1, Remaining: 2, At: 1000}},
		{at: 1500, tenant: "acme", member: "evt-1", want: outcome{Allowed: true, Replay: true, Quota: q3, Count: 1, Remaining: 2, At: 1000}},
		{at: 1600, tenant: "acme", member: "evt-2", cost: 2, want: outcome{Allowed: true, Quota: q3, Count: 3, Remaining: 0, At: 1600}},
		{at: 1650, tenant: "acme", member: "evt-2", cost: 2, want: outcome{Allowed: true, Replay: true, Quota: q3, Count: 3, At: 1600}},
		{at: 1700, tenant: "acme", member: "evt-3", want: outcome{Quota: q3, Count: 3, RetryAfter: msd(300), At: 1700}},
		{at: 1800, tenant: "acme", member: "evt-3", want: outcome{Quota: q3, Count: 3, RetryAfter: msd(200), At: 1800}},
		{at: 2000, tenant: "acme", member: "evt-3", want: outcome{Allowed: true, Quota: q3, Count: 3, At: 2000}},
		{at: 2002, tenant: "acme", member: "evt-1", want: outcome{Quota: q3, Count: 3, RetryAfter: msd(1600 + 1000 - 2002), At: 2002}},
	})

	// Tenant 5/1s and cost-2 reservations, as in TestLimiter_AllowAt_reservationCost: two
	// cost-2 admissions at 1000 leave one slot, so two cost-2 events fit in each later
	// second: R1, R2 at 2000, R3, R4 at 3000, R5 at 4000. A cost-1 event without a
	// reservation still fits at 1000, beside them. Each claims its reservation at its
	// instant: its window holds 4 slots (2 for R5, alone in (3000, 4000]).
	q5 := tenantQuota(5, time.Second)
	steps := []topologyStep{
		{at: 1000, tenant: "acme", cost: 2, member: "a", want: outcome{Allowed: true, Quota: q5, Count: 2, Remaining: 3, At: 1000}},
		{at: 1000, tenant: "acme", cost: 2, member: "b", want: outcome{Allowed: true, Quota: q5, Count: 4, Remaining: 1, At: 1000}},
	}
	instants := []int64{2000, 2000, 3000, 3000, 4000}
	for i, at := range instants {
		steps = append(steps, topologyStep{at: 1000, tenant: "acme", cost: 2, resv: fmt.Sprintf("R%d", i+1),
			want: outcome{Reserved: true, Quota: q5, Count: 4, Remaining: 1, RetryAfter: msd(at - 1000), At: 1000}})
	}
	steps = append(steps, topologyStep{at: 1000, tenant: "acme", member: "c", want: outcome{Allowed: true, Quota: q5, Count: 5, At: 1000}})
	for i, at := range instants {
		count := 4
		if i == 4 {
			count = 2
		}
		steps = append(steps, topologyStep{at: at, tenant: "acme", cost: 2, member: fmt.Sprintf("run-R%d", i+1), resv: fmt.Sprintf("R%d", i+1),
			want: outcome{Allowed: true, Held: true, Quota: q5, Count: count, Remaining: 5 - count, At: at}})
	}
	topologyRun(t, both, "resv:call", []throttle.Quota{q5}, steps)

	// The keys: the same on the primary as on the single node, and on the replica as on
	// the primary.
	ctx := context.Background()
	primary, replica := sentinel.Primary.Client(), sentinel.Replica.Client()
	if n, err := sentinel.Client().Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
		t.Fatalf("WAIT 1 5000 on the primary = %d, %v; want 1 replica caught up", n, err)
	}
	keys := scanAll(t, primary)
	if want := scanAll(t, single.Client()); !slices.Equal(keys, want) {
		t.Errorf("keys on the primary:\n%q\nwant those on the single node:\n%q", keys, want)
	}
	if len(keys) < 6 {
		t.Fatalf("the primary holds %d keys %q, want at least the 6 logs, pending and cost sets written: the checks below show little", len(keys), keys)
	}
	if got := scanAll(t, replica); !slices.Equal(got, keys) {
		t.Errorf("keys on the replica:\n%q\nwant those on the primary:\n%q", got, keys)
	}
	for _, k := range keys {
		p, err := primary.Dump(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		if r, err := replica.Dump(ctx, k).Result(); err != nil || r != p {
			t.Errorf("DUMP %s differs on the replica (%v)", k, err)
		}
		if ttl := pttl(t, replica, k); ttl <= 0 {
			t.Errorf("PTTL %s on the replica = %v, want > 0", k, ttl)
		}
	}
}

// scanAll returns every key of rdb's database, sorted, by SCAN.
func scanAll(t *testing.T, rdb redis.Cmdable) []string {
	t.Helper()
	ctx := context.Background()
	var keys []string
	it := rdb.Scan(ctx, 0, "*", 100).Iterator()
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	return keys
}

// tenantAndTypeQuotas are the quotas of tenantAndTypeScenario.
var tenantAndTypeQuotas = []throttle.Quota{typeQuota(3, time.Second), tenantQuota(2, time.Second)}

// tenantAndTypeScenario is type 3/1s and tenant 2/1s: two window logs in one script call.
// A denial by one quota takes nothing from the other; an admission names the quota with the
// fewest slots left (the first on ties), a denial the first with no room a millisecond
// before the instant it waits for.
func tenantAndTypeScenario() []topologyStep {
	tq, nq := tenantAndTypeQuotas[0], tenantAndTypeQuotas[1]
	admit := func(q throttle.Quota, count int, at int64) outcome {
		return outcome{Allowed: true, Quota: q, Count: count, Remaining: q.Limit.Events - count, At: at}
	}
	deny := func(q throttle.Quota, retry, at int64) outcome {
		return outcome{Quota: q, Count: q.Limit.Events, RetryAfter: msd(retry), At: at}
	}
	return []topologyStep{
		{at: 0, tenant: "A", want: admit(nq, 1, 0)},
		{at: 1, tenant: "A", want: admit(nq, 2, 1)},
		{at: 2, tenant: "A", want: deny(nq, 998, 2)}, // A's oldest (t=0) leaves its window at 1000
		{at: 3, tenant: "B", want: admit(tq, 3, 3)},  // A's denial took no type slot
		{at: 4, tenant: "B", want: deny(tq, 996, 4)}, // the type is full until t=0 leaves
		{at: 5, tenant: "C", want: deny(tq, 995, 5)},
		{at: 1000, tenant: "A", want: admit(tq, 3, 1000)}, // at 2 + 998, as promised
		{at: 1000, tenant: "B", want: deny(tq, 1, 1000)},  // type: 1, 3, 1000; t=1 leaves at 1001
		// Stamped behind the logs' high-water (1000): decided there.
		{at: 900, tenant: "C", want: deny(tq, 1001-900, 1000)},
	}
}
