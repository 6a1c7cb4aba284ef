package throttle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Unused reservations lapse quickly (core v2, rule 6): a reservation not claimed within
// the claim timeout after its instant stops counting, and one released (its task is gone)
// stops counting at once.

// TestLimiter_AllowAt_unclaimedReservationLapses: limit 1/10s, claim timeout 2s. A runs at
// 0; B reserves 10000 and never comes back. At 11999 its reservation still counts: C is
// told 20000. At 12000 it has lapsed: C runs at once. v1 kept it a whole window, until
// 20000.
func TestLimiter_AllowAt_unclaimedReservationLapses(t *testing.T) {
	t.Parallel()
	tenant := msQuota(throttle.ScopeTenant, 1, 10_000)
	q := []throttle.Quota{tenant}
	steps := []modelStep{
		{at: 0, tenant: "acme", quotas: q},
		{at: 100, tenant: "acme", quotas: q, token: "B", want: &modelDecision{Reserved: true, Quota: tenant, Count: 1, Remaining: 0,
			RetryAfter: msDuration(9_900), At: 100}},
		{at: 11_999, tenant: "acme", quotas: q, want: &modelDecision{Quota: tenant, Count: 1, Remaining: 0, RetryAfter: msDuration(8_001), At: 11_999}},
		{at: 12_000, tenant: "acme", quotas: q, want: &modelDecision{Allowed: true, Quota: tenant, Count: 1, Remaining: 0, At: 12_000}},
		// B comes back late: its reservation is gone, and it waits like a newcomer.
		{at: 12_100, tenant: "acme", quotas: q, token: "B", want: &modelDecision{Reserved: true, Quota: tenant, Count: 1, Remaining: 0,
			RetryAfter: msDuration(9_900), At: 12_100}},
	}
	for i := range steps {
		steps[i].timeout = 2_000
	}
	checkSequence(t, steps)
}

// TestLimiter_Release_freesSlotsAtOnce is the core v2 issue's case 6. Rule tenant=10/1h: at
// t=0 tasks T1-T10 are admitted, T11-T20 reserve 1h, T21-T30 reserve 2h. The 20 waiting
// tasks are deleted and their reservations released. At t=10min a new task gets the slot
// at 1h, RetryAfter 3,000,000ms, not the one at 3h (10,200,000ms, v1).
func TestLimiter_Release_freesSlotsAtOnce(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	q := []throttle.Quota{tenantQuota(10, time.Hour)}
	req := func(i int) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: q, Reservation: fmt.Sprintf("T%d", i)}
	}
	for i := 1; i <= 30; i++ {
		d := allowAtV2(t, l, req(i), 0)
		want := time.Duration(0)
		if i > 10 {
			want = time.Duration((i-1)/10) * time.Hour
		}
		if d.Allowed != (i <= 10) || d.RetryAfter != want {
			t.Fatalf("T%d at t=0: %+v, want RetryAfter %v", i, d, want)
		}
	}
	for i := 11; i <= 30; i++ {
		if held, err := l.Release(ctx, "api:call", fmt.Sprintf("T%d", i)); err != nil || !held {
			t.Fatalf("Release(T%d) = %v, %v; want true", i, held, err)
		}
	}
	if held, err := l.Release(ctx, "api:call", "T11"); err != nil || held {
		t.Errorf("Release(T11) again = %v, %v; want false (nothing left)", held, err)
	}
	d := allowAtV2(t, l, req(31), 10*time.Minute.Milliseconds())
	if !d.Reserved || d.RetryAfter != 3_000_000*time.Millisecond {
		t.Errorf("T31 at 10min: %+v, want reserved with RetryAfter 3,000,000ms (the slot at 1h)", d)
	}
	var left []string
	if err := l.Reservations(ctx, "api:call", func(r throttle.Reservation) bool {
		left = append(left, r.Token)
		return true
	}); err != nil || len(left) != 1 || left[0] != "T31" {
		t.Errorf("Reservations = %v, %v; want [T31]", left, err)
	}
}
