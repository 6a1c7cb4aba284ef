package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_releasedSlotIsRefilled: on one tenant quota, cost 1 (the script's
// one-log path), a reservation released ahead of its instant leaves a hole before the
// log's end slot, and the next denial reserves it rather than the end slot. Rule
// tenant=2/10s: A1, A2 run at 0; R1, R2 reserve 10000 and R3, R4 20000; R1 is released.
func TestLimiter_AllowAt_releasedSlotIsRefilled(t *testing.T) {
	t.Parallel()
	tenant := msQuota(throttle.ScopeTenant, 2, 10_000)
	q := []throttle.Quota{tenant}
	reserved := func(retry, at int64) *modelDecision {
		return &modelDecision{Reserved: true, Quota: tenant, Count: 2, Remaining: 0, RetryAfter: msDuration(retry), At: at}
	}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, token: "A1"},
		{at: 0, tenant: "A", quotas: q, token: "A2", want: &modelDecision{Allowed: true, Quota: tenant, Count: 2, Remaining: 0, At: 0}},
		{at: 1, tenant: "A", quotas: q, token: "R1", want: reserved(9_999, 1)},
		{at: 1, tenant: "A", quotas: q, token: "R2", want: reserved(9_999, 1)},
		{at: 1, tenant: "A", quotas: q, token: "R3", want: reserved(19_999, 1)},
		{at: 1, tenant: "A", quotas: q, token: "R4", want: reserved(19_999, 1)},
		{at: 2, tenant: "A", quotas: q, token: "R1", release: true},
		// (0, 10000] now holds R2 only, and no window after 10000 holds two: N takes 10000.
		{at: 5_000, tenant: "A", quotas: q, token: "N", want: reserved(5_000, 5_000)},
		// Full again up to the end slot: 30000 (20000 + 10s), RetryAfter from 5001.
		{at: 5_001, tenant: "A", quotas: q, token: "M", want: reserved(24_999, 5_001)},
		// A denial without a token writes nothing and names the second slot at 30000.
		{at: 5_002, tenant: "A", quotas: q, timeout: 3_000, want: &modelDecision{Quota: tenant, Count: 2, Remaining: 0,
			RetryAfter: msDuration(24_998), At: 5_002}},
	})
}

// TestLimiter_AllowAt_holeNeedsExactCheck: a hole whose own window has room can still be
// refused by a window after it that an entry ahead fills; the exact check decides (the
// one-log path hands it over). Tenant A's log: A1 at 0, A2 at 9000, and R at 15001,
// where a type quota of 1/15s (B's X at 1) put it. N, under the tenant quota 2/10s
// alone, finds room in (0, 10000] but (5001, 15001] would hold A2, N and R: it reserves
// the end slot, 19000 (A2 + 10s). R names the type quota: the tenant's has room from
// 10000, the type's only from 15001.
func TestLimiter_AllowAt_holeNeedsExactCheck(t *testing.T) {
	t.Parallel()
	tenant := msQuota(throttle.ScopeTenant, 2, 10_000)
	typ := msQuota(throttle.ScopeType, 1, 15_000)
	q := []throttle.Quota{tenant}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, token: "A1"},
		{at: 1, tenant: "B", quotas: []throttle.Quota{typ}, token: "X"},
		{at: 9_000, tenant: "A", quotas: q, token: "A2", want: &modelDecision{Allowed: true, Quota: tenant, Count: 2, Remaining: 0, At: 9_000}},
		{at: 9_001, tenant: "A", quotas: []throttle.Quota{tenant, typ}, token: "R", want: &modelDecision{Reserved: true, Quota: typ,
			Count: 1, Remaining: 0, RetryAfter: msDuration(6_000), At: 9_001}},
		{at: 9_002, tenant: "A", quotas: q, token: "N", want: &modelDecision{Reserved: true, Quota: tenant, Count: 2, Remaining: 0,
			RetryAfter: msDuration(9_998), At: 9_002}},
	})
}

// TestLimiter_AllowAt_fairSearchStopsAtOwnSlot: the fair search takes a reservation only
// before the event's own earliest instant. Type quota 1/1s: X admitted at 0, B's R1-R3
// reserve 1000, 2000 and 3000 (fair tags 1, 2 and 3 units), R2 is released: a hole at
// 2000. A's first task (tag 1 unit) ranks second, at B's R3 (3000), but its own earliest
// instant is the hole: it reserves 2000, and R3 stays at 3000. Taking R3's slot would
// have given A a later one and moved R3 ahead of its turn.
func TestLimiter_AllowAt_fairSearchStopsAtOwnSlot(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 1, 1_000)
	q := []throttle.Quota{typ}
	reserved := func(retry int64) *modelDecision {
		return &modelDecision{Reserved: true, Quota: typ, Count: 1, Remaining: 0, RetryAfter: msDuration(retry), At: 0}
	}
	m := checkSequence(t, []modelStep{
		{at: 0, tenant: "X", quotas: q, token: "X1", want: &modelDecision{Allowed: true, Quota: typ, Count: 1, Remaining: 0, At: 0}},
		{at: 0, tenant: "B", quotas: q, token: "R1", want: reserved(1_000)},
		{at: 0, tenant: "B", quotas: q, token: "R2", want: reserved(2_000)},
		{at: 0, tenant: "B", quotas: q, token: "R3", want: reserved(3_000)},
		{at: 0, tenant: "B", quotas: q, token: "R2", release: true},
		{at: 0, tenant: "A", quotas: q, token: "A1", want: reserved(2_000)},
	})
	st := m.logs[modelLogOf(throttle.Key{TaskType: "api:call", Tenant: "A"}, throttle.ScopeType)]
	if got := st.pending["1:R3"]; got != 3_000 {
		t.Errorf("R3 pending at %d, want 3000 (not displaced)", got)
	}
}

// TestLimiter_AllowAt_leaseTTLGrowsWithoutNewInstant: a reservation at its logs' latest
// instant (not a new one: the one-log path then reads PTTL rather than trying PEXPIRE GT,
// and the general path always reads PTTL first) still grows the per-type keys' TTLs to
// its horizon once the server's clock has run on. (The model's driver persists every key
// after each call, so only keys without a TTL reach it.) All at the callers' instant 0,
// under tenant=2/1s alone (the one-log path) and with type=100/1s beside it (two logs:
// the general path, which also writes the fair keys): A1, A2 run; R1 reserves 1000, and
// the keys are to expire 1000 + 1s + the 5 s claim timeout = 7000 ms later; 50 ms later
// on the server's clock R2 reserves 1000 too, and the keys must again expire 7000 ms
// after that call: 50 ms or more later than R1 set them.
func TestLimiter_AllowAt_leaseTTLGrowsWithoutNewInstant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tenant, typ := msQuota(throttle.ScopeTenant, 2, 1_000), msQuota(throttle.ScopeType, 100, 1_000)
	for _, tc := range []struct {
		name   string
		quotas []throttle.Quota
		keys   []string
	}{
		{"one log", []throttle.Quota{tenant}, []string{"leases"}},
		{"two logs", []throttle.Quota{tenant, typ}, []string{"leases", "fair", "fairstate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, rdb := newLimiterClient(t, throttle.Config{})
			expireAt := func(token string) (before int64, at map[string]int64) {
				t.Helper()
				before = time.Now().UnixMilli() // the server's clock is this machine's
				d, err := l.AllowAt(ctx, throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "A"}, Quotas: tc.quotas, Reservation: token}, time.UnixMilli(0))
				if err != nil || d.Allowed != (token[0] == 'A') || d.Reserved == (token[0] == 'A') {
					t.Fatalf("%s: %+v, %v", token, d, err)
				}
				at = map[string]int64{}
				for _, k := range tc.keys {
					e, err := rdb.PExpireTime(ctx, "throttle:{api:call}:"+k).Result()
					if err != nil {
						t.Fatal(err)
					}
					at[k] = e.Milliseconds()
				}
				return before, at
			}
			expireAt("A1")
			expireAt("A2")
			_, e1 := expireAt("R1")
			time.Sleep(50 * time.Millisecond)
			before, e2 := expireAt("R2")
			for _, k := range tc.keys {
				if e2[k]-before < 7_000 || e2[k]-e1[k] < 50 {
					t.Errorf("%s expires at %d after R2 (called at %d or later), %d after R1; want at least 7000 ms after R2's call, so 50 ms or more later", k, e2[k], before, e1[k])
				}
			}
		})
	}
}
