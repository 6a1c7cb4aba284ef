package throttle_test

import (
	"testing"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_fairDisplacementKeepsVictimsWindow: a fair displacement moves
// another tenant's reservation on that tenant's own log under the tenant quotas its lease
// records (its tier's, which this call does not carry), and that log keeps every entry
// its own window needs. Type quota 1/10s; tenant B (a free tier, tenant=3/1h) runs B1 at
// 0 and reserves B2 at 10000 and B3 at 20000; tenant A (a pro tier, tenant=10/1s) at 5000
// ranks before B3 and takes its slot, and B3 moves to 30000, where B's hour still has
// room. B1 still counts in B's windows until 3600000: B's next task reserves 3600000, not
// 40000, the type's next slot, and names B's hour, which holds it back. Before the fix, B3 moved under A's quota and B's log was
// trimmed at A's 1s window: B1 was dropped, and B got 4 runs within an hour.
func TestLimiter_AllowAt_fairDisplacementKeepsVictimsWindow(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 1, 10_000)
	free := msQuota(throttle.ScopeTenant, 3, 3_600_000)
	pro := msQuota(throttle.ScopeTenant, 10, 1_000)
	b := []throttle.Quota{typ, free}
	a := []throttle.Quota{typ, pro}
	reserved := func(q throttle.Quota, count int, retry, at int64) *modelDecision {
		return &modelDecision{Reserved: true, Quota: q, Count: count, Remaining: q.Limit.Events - count, RetryAfter: msDuration(retry), At: at}
	}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "B", quotas: b, token: "B1", want: &modelDecision{Allowed: true, Quota: typ, Count: 1, Remaining: 0, At: 0}},
		{at: 0, tenant: "B", quotas: b, token: "B2", want: reserved(typ, 1, 10_000, 0)},
		{at: 0, tenant: "B", quotas: b, token: "B3", want: reserved(typ, 1, 20_000, 0)},
		// A's tag (1 unit) ranks it second, at B3's slot, before its own earliest (30000).
		{at: 5_000, tenant: "A", quotas: a, token: "A1", want: reserved(typ, 1, 15_000, 5_000)},
		{at: 5_001, tenant: "B", quotas: b, token: "B4", want: reserved(free, 1, 3_594_999, 5_001)},
	})
}
