package throttle_test

import (
	"testing"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_denialNamesTheQuotaThatHoldsItBack: a denial names the quota it
// waits for, not the first one listed that is full now. Rule type=4/1s tenant=3/1m: A
// runs at 0, 1 and 2, B at 3, so at 10 both of A's quotas are full: the type's until 1000,
// the tenant's until 60000. A's denial waits 59,990 ms and names tenant=3/1m (a trial of
// the worker logged "over type=4/1s, retry after 1m" before); B's waits 990 ms on the
// type's alone; at 1500 the type has room and A's denial still names its tenant's minute.
// With a reservation the same holds for the instant it reserves.
func TestLimiter_AllowAt_denialNamesTheQuotaThatHoldsItBack(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 4, 1_000)
	tenant := msQuota(throttle.ScopeTenant, 3, 60_000)
	q := []throttle.Quota{typ, tenant}
	denied := func(by throttle.Quota, count int, retry, at int64) *modelDecision {
		return &modelDecision{Quota: by, Count: count, Remaining: by.Limit.Events - count, RetryAfter: msDuration(retry), At: at}
	}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q},
		{at: 1, tenant: "A", quotas: q},
		{at: 2, tenant: "A", quotas: q},
		{at: 3, tenant: "B", quotas: q, want: &modelDecision{Allowed: true, Quota: typ, Count: 4, Remaining: 0, At: 3}},
		{at: 10, tenant: "A", quotas: q, want: denied(tenant, 3, 59_990, 10)},
		{at: 10, tenant: "B", quotas: q, want: denied(typ, 4, 990, 10)},
		{at: 1_500, tenant: "A", quotas: q, want: denied(tenant, 3, 58_500, 1_500)},
		{at: 1_500, tenant: "A", quotas: q, token: "R", want: &modelDecision{Reserved: true, Quota: tenant, Count: 3, Remaining: 0,
			RetryAfter: msDuration(58_500), At: 1_500}},
	})
}
