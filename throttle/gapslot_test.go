package throttle_test

import (
	"fmt"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_gapBehindLongTenantWindow: a tenant of a long tenant window that
// reserves far ahead on a shared type log of short windows leaves the slots before its
// reservation to the others. Type quota 4/1s; tenant X (tenant=3/1m) sends X0-X5 at 0-5
// ms: X0-X2 run, X3-X5 reserve 60000-60002 (its minute), on the type log too. Tenant Y
// (the type quota alone) sends Y0-Y39 at 100-139: Y0 runs (the 4th of the type's first
// second), Y1-Y3 reserve 1000-1002 (as X0-X2 leave the window) and Y4 1100 (as Y0
// does), and every later second takes 4 more the same way, Y39 at 10002: 4 a second,
// the type's limit. From Y5 on, the 4 candidate instants (entries leaving a window) fall among Y's
// own reservations, full; before gap_slot, Y5 and every later Y reserved after X's
// minute (Y5 at 60002, RetryAfter 59897 ms) and the type sat idle until then.
func TestLimiter_AllowAt_gapBehindLongTenantWindow(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 4, 1_000)
	slow := msQuota(throttle.ScopeTenant, 3, 60_000)
	x := []throttle.Quota{typ, slow}
	y := []throttle.Quota{typ}
	var steps []modelStep
	for i := range int64(6) {
		want := &modelDecision{Allowed: true, Quota: slow, Count: int(i) + 1, Remaining: 2 - int(i), At: i}
		if i >= 3 { // the tenant's minute: 60000 + (i - 3)
			want = &modelDecision{Reserved: true, Quota: slow, Count: 3, RetryAfter: msDuration(60_000 - 3), At: i}
		}
		steps = append(steps, modelStep{at: i, tenant: "X", quotas: x, token: fmt.Sprintf("X%d", i), want: want})
	}
	for i := range int64(40) {
		at := 100 + i
		want := &modelDecision{Allowed: true, Quota: typ, Count: 4, At: at}
		if i > 0 {
			// X0-X2's instants a second on, then Y0's: 1000-1002 and 1100, and so on.
			slot := (i-1)/4*1_000 + 1_000 + []int64{0, 1, 2, 100}[(i-1)%4]
			want = &modelDecision{Reserved: true, Quota: typ, Count: 4, RetryAfter: msDuration(slot - at), At: at}
		}
		steps = append(steps, modelStep{at: at, tenant: "Y", quotas: y, token: fmt.Sprintf("Y%d", i), want: want})
	}
	checkSequence(t, steps)
}
