package throttle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_AllowAt_spacing: Request.Spread places a new reservation that a tenant quota
// holds back no earlier than Cost x Window/Events of that quota after its log's latest
// instant, at the earliest instant from there on at which it fits. Rule tenant=2/1s: A
// and B admitted at 0 fill the window; C, D, E, F ask at 10..40. Unspaced they reserve
// 1000, 1000, 2000, 2000 (the instants A and B leave, twice: each window repeats the
// first's burst); spread (500ms, W/Events), 1000, 1500, 2000, 2500: C's earliest is 1000,
// after 0 + 500; D's earliest is 1000 too, but the latest instant is C's 1000, so 1500,
// where the window (500, 1500] holds C alone. Each subtest runs on its own task type, the
// path the script takes named after it.
func TestLimiter_AllowAt_spacing(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	burst := func(t *testing.T, key throttle.Key, quotas []throttle.Quota) {
		t.Helper()
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
	}
	reserve := func(t *testing.T, key throttle.Key, quotas []throttle.Quota, spread bool, cost int, want ...int64) {
		t.Helper()
		for i, at := range want {
			req := throttle.Request{Key: key, Quotas: quotas, Reservation: string(rune('C' + i)), Spread: spread, Cost: cost}
			resvWantReserved(t, l, req, int64(10*(i+1)), at)
		}
	}
	tenant := []throttle.Quota{tenantQuota(2, time.Second)}
	t.Run("Unspaced", func(t *testing.T) {
		t.Parallel()
		key := throttle.Key{TaskType: "unspaced", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, false, 1, 1000, 1000, 2000, 2000)
	})
	t.Run("OneLog", func(t *testing.T) {
		t.Parallel()
		key := throttle.Key{TaskType: "onelog", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, true, 1, 1000, 1500, 2000, 2500)
	})
	t.Run("General", func(t *testing.T) {
		// A type quota that never binds sends the call to the general path; spacing
		// counts from the tenant log's latest instant.
		t.Parallel()
		key := throttle.Key{TaskType: "general", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(2, time.Second), typeQuota(100, time.Second)}
		burst(t, key, quotas)
		reserve(t, key, quotas, true, 1, 1000, 1500, 2000, 2500)
	})
	t.Run("PerUnitOfCost", func(t *testing.T) {
		// Rule tenant=4/1s, events of cost 2: 2 x 1000/4 = 500ms apart, as above.
		t.Parallel()
		key := throttle.Key{TaskType: "weighted", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(4, time.Second)}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas, Cost: 2}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas, Cost: 2}, 0)
		reserve(t, key, quotas, true, 2, 1000, 1500, 2000, 2500)
	})
	t.Run("TypeQuotaUnspaced", func(t *testing.T) {
		// A type quota's log is not spaced: its fair ranks interleave the tenants.
		t.Parallel()
		key := throttle.Key{TaskType: "typeonly", Tenant: "acme"}
		quotas := []throttle.Quota{typeQuota(2, time.Second)}
		burst(t, key, quotas)
		reserve(t, key, quotas, true, 1, 1000, 1000, 2000, 2000)
	})
	t.Run("AdmissionUnspaced", func(t *testing.T) {
		// Room at now admits at now, however close the latest instant.
		t.Parallel()
		key := throttle.Key{TaskType: "admission", Tenant: "acme"}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "A", Spread: true}, 0)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "B", Spread: true}, 1)
	})
	t.Run("GapBeforeTheLatest", func(t *testing.T) {
		// C 1000, D 1500, E 2000, then D released: (500, 1500] holds C alone, so G's
		// earliest is 1000, before the latest instant (2000), which stays the log's latest
		// ("#f" does not move back): G reserves 2500, after it. The one-log path hands the
		// gap to general. H, unspaced, takes the gap.
		t.Parallel()
		key := throttle.Key{TaskType: "gap", Tenant: "acme"}
		burst(t, key, tenant)
		reserve(t, key, tenant, true, 1, 1000, 1500, 2000)
		if held, err := l.Release(context.Background(), "gap", "D"); err != nil || !held {
			t.Fatalf("Release D: %v, %v; want held", held, err)
		}
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "G", Spread: true}, 40, 2500)
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: tenant, Reservation: "H"}, 50, 1000)
	})
	t.Run("TheBindingQuotasRate", func(t *testing.T) {
		// Rule tenant=2/1s tenant=3/1h: C (at 10) is held back by the 1s quota (1000, after
		// 0 + 500); D by the 1h one, until A leaves it at 1h (after 1000 + 1h/3); E by the 1h
		// one too: its earliest is 1h as well (B leaves), spread to 1h + 20min, where the
		// hour ending there holds D alone.
		t.Parallel()
		key := throttle.Key{TaskType: "binding", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(2, time.Second), tenantQuota(3, time.Hour)}
		burst(t, key, quotas)
		reserve(t, key, quotas, true, 1, 1000, 3_600_000, 4_800_000)
	})
	t.Run("ALongQuotaWithRoom", func(t *testing.T) {
		// The README's llm:complete rule, tenant=40000/1m tenant=1000000/24h, tasks of 4000
		// tokens: ten admitted at 0 fill the minute, ten more reserve 6 s apart (4000 x
		// 60000/40000 ms) from 60000, the minute quota's rate, not the day's (86.4 ms a
		// token: 344 s apart), which has room for them all.
		t.Parallel()
		key := throttle.Key{TaskType: "llm:complete", Tenant: "acme"}
		quotas := []throttle.Quota{tenantQuota(40000, time.Minute), tenantQuota(1000000, 24*time.Hour)}
		for range 10 {
			mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas, Cost: 4000}, 0)
		}
		for i := range 10 {
			req := throttle.Request{Key: key, Quotas: quotas, Cost: 4000, Reservation: fmt.Sprint("R", i), Spread: true}
			resvWantReserved(t, l, req, int64(10+i), 60_000+int64(i)*6_000)
		}
	})
}
