package throttle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_fairTypeQuota: a type-wide quota of 10 per second; tenant A's
// backlog of 1,000 tasks reserves the next 99 seconds at t=0. Tenant B's 10 tasks, denied
// at t=500, do not wait behind that backlog: each takes the earliest slot where A holds at
// least two more reservations than B in the window, so B gets half of the next two
// windows: 5 slots at t=1000 and 5 at t=2000. The 10 A reservations displaced move behind
// the backlog, and no window ever holds more than 10.
func TestLimiter_AllowAt_fairTypeQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
	quota := []throttle.Quota{typeQuota(10, time.Second)}
	req := func(tenant, id string) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: tenant}, Quotas: quota, Reservation: id}
	}
	// slots maps each reserved instant (ms) to the reservation ids held there.
	slots := map[int64][]string{}
	for i := range 1000 {
		d := allowAt(t, l, req("A", fmt.Sprintf("A-%d", i)), 0)
		switch {
		case i < 10:
			if !d.Allowed {
				t.Fatalf("A-%d denied at t=0: %+v", i, d)
			}
		case !d.Reserved:
			t.Fatalf("A-%d not reserved: %+v", i, d)
		default:
			if want := msd(int64(i/10) * 1000); d.RetryAfter != want {
				t.Fatalf("A-%d reserved %v ahead, want %v", i, d.RetryAfter, want)
			}
		}
	}
	for i := range 10 {
		id := fmt.Sprintf("B-%d", i)
		d := allowAt(t, l, req("B", id), 500)
		want := msd(500) // t=1000
		if i >= 5 {
			want = msd(1500) // t=2000
		}
		if !d.Reserved || d.RetryAfter != want {
			t.Errorf("%s: reserved=%v retry-after %v, want a reservation %v ahead", id, d.Reserved, d.RetryAfter, want)
		}
	}

	// Every reservation's instant, from the reservation set of the type-wide log.
	entries, err := rdb.ZRangeWithScores(ctx, "throttle:{api:call}:reserved:type", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	perTenant := map[int64]map[byte]int{}
	for _, z := range entries {
		at := int64(z.Score)
		if perTenant[at] == nil {
			perTenant[at] = map[byte]int{}
		}
		perTenant[at][z.Member.(string)[2]]++ // "1:A-17" -> 'A'
		slots[at] = append(slots[at], z.Member.(string))
	}
	for _, c := range []struct {
		at   int64
		a, b int
	}{{1000, 5, 5}, {2000, 5, 5}, {3000, 10, 0}, {99000, 10, 0}, {100000, 10, 0}} {
		if got := perTenant[c.at]; got['A'] != c.a || got['B'] != c.b {
			t.Errorf("slot t=%d holds A=%d B=%d, want A=%d B=%d", c.at, got['A'], got['B'], c.a, c.b)
		}
	}
	if len(entries) != 1000 {
		t.Errorf("%d reservations, want 1000 (990 of A, 10 of B)", len(entries))
	}
	for at, ids := range slots {
		if len(ids) > 10 {
			t.Errorf("t=%d holds %d reservations, more than the limit 10", at, len(ids))
		}
	}
	// B's tasks come back at their instants and run.
	for i := range 10 {
		at := int64(1000)
		if i >= 5 {
			at = 2000
		}
		if d := allowAt(t, l, req("B", fmt.Sprintf("B-%d", i)), at); !d.Allowed {
			t.Errorf("B-%d at t=%d: %+v, want admitted", i, at, d)
		}
	}
}
