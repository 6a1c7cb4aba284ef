package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_spacing: Request.Spacing places a new reservation on a tenant log no
// earlier than Spacing x Cost after the log's latest instant, at the earliest instant from
// there on at which it fits. Rule tenant=2/1s: A and B admitted at 0 fill the window; C, D,
// E, F ask at 10..40. Unspaced they reserve 1000, 1000, 2000, 2000 (the instants A and B
// leave, twice: each window repeats the first's burst); with Spacing 500ms (W/Events),
// 1000, 1500, 2000, 2500: C's earliest is 1000, after 0 + 500; D's earliest is 1000 too,
// but the latest instant is C's 1000, so 1500, where the window (500, 1500] holds C alone.
// Each subtest runs on its own task type, the path the script takes named after it.
func TestLimiter_AllowAt_spacing(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	burst := func(t *testing.T, key throttle.Key, quotas []throttle.Quota) {
		t.Helper()
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
	}
	reserve := func(t *testing.T, key throttle.Key, quotas []throttle.Quota, spacing time.Duration, cost int, want ...int64) {
		t.Helper()
		for i, at := range want {
			req := throttle.Request{Key: key, Quotas: quotas, Reservation: string(rune('C' + i)), Spacing: spacing, Cost: cost}
			resvWantReserved(t, l, req, int64(10*(i+1)), at)
		}
	}
	tenant := []throttle.Quota{tenantQuota(2, time.Second)}
	t.Run("Unspaced", func(t *testing.T) {
		t.Parallel()
		key := throttle.Key{TaskType: "unspaced", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, 0, 1, 1000, 1000, 2000, 2000)
	})
	t.Run("OneLog", func(t *testing.T) {
		t.Parallel()
		key := throttle.Key{TaskType: "onelog", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, 500*time.Millisecond, 1, 1000, 1500, 2000, 2500)
	})
	t.Run("General", func(t *testing.T) {
		// A type quota that never binds sends the call to the general path; spacing
		// counts from the tenant log's latest instant.
		t.Parallel()
		key := throttle.Key{TaskType: "general", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(2, time.Second), typeQuota(100, time.Second)}
		burst(t, key, quotas)
		reserve(t, key, quotas, 500*time.Millisecond, 1, 1000, 1500, 2000, 2500)
	})
	t.Run("PerUnitOfCost", func(t *testing.T) {
		// Rule tenant=4/1s, events of cost 2, Spacing 250ms: 500ms apart, as above.
		t.Parallel()
		key := throttle.Key{TaskType: "weighted", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(4, time.Second)}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas, Cost: 2}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas, Cost: 2}, 0)
		reserve(t, key, quotas, 250*time.Millisecond, 2, 1000, 1500, 2000, 2500)
	})
	t.Run("TypeQuotaUnspaced", func(t *testing.T) {
		// A type quota's log is not spaced: its fair ranks interleave the tenants.
		t.Parallel()
		key := throttle.Key{TaskType: "typeonly", Tenant: "acme"}
		quotas := []throttle.Quota{typeQuota(2, time.Second)}
		burst(t, key, quotas)
		reserve(t, key, quotas, 500*time.Millisecond, 1, 1000, 1000, 2000, 2000)
	})
	t.Run("AdmissionUnspaced", func(t *testing.T) {
		// Room at now admits at now, however close the latest instant.
		t.Parallel()
		key := throttle.Key{TaskType: "admission", Tenant: "acme"}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "A", Spacing: 500 * time.Millisecond}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "B", Spacing: 500 * time.Millisecond}, 1)
	})
	t.Run("GapBeforeTheLatest", func(t *testing.T) {
		// C 1000, D 1500, E 2000, then D released: (500, 1500] holds C alone, so G's
		// earliest is 1000, before the latest instant (2000), which stays the log's latest
		// ("#f" does not move back): G reserves 2500, after it. The one-log path hands the
		// gap to general. H, unspaced, takes the gap.
		t.Parallel()
		key := throttle.Key{TaskType: "gap", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, 500*time.Millisecond, 1, 1000, 1500, 2000)
		if held, err := l.Release(context.Background(), "gap", "D"); err != nil || !held {
			t.Fatalf("Release D: %v, %v; want held", held, err)
		}
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "G", Spacing: 500 * time.Millisecond}, 40, 2500)
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "H"}, 50, 1000)
	})
}

// TestLimiter_Allow_negativeSpacing: a negative Spacing is ErrInvalid, before any call.
func TestLimiter_Allow_negativeSpacing(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	_, err := l.Allow(context.Background(), throttle.Request{Key: throttle.Key{TaskType: "api:call"},
		Quotas: []throttle.Quota{tenantQuota(2, time.Second)}, Spacing: -time.Millisecond})
	if !errors.Is(err, throttle.ErrInvalid) {
		t.Fatalf("Allow with Spacing -1ms: %v; want ErrInvalid", err)
	}
}
