package throttle_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// A rule whose window shortens while reservations wait (an override, a tier change): a
// call under the shorter window trims its logs by that window, so a reservation it still
// holds (in P) may lose its entry in L. These tests pin what follows, step by step
// against the model, whose state the script's keys must equal after every call.

// TestLimiter_Release_trimmedWeightedReservationLeavesNoGhost: releasing a weighted
// reservation whose L entry a shorter window trimmed leaves nothing counting. Rule
// tenant=40/10s: M (cost 40) runs at 0; R (cost 2, claim timeout 60s) reserves 10000,
// and T1..T60 (cost 2) 10000 (19), 20000 (20), 30000 (20) and 40000 (1). S (cost 1),
// under tenant=40/1s, runs at 11001 and trims everything at or before 10001: R's entry
// and the 19 beside it. R is then released: more than K_RENUM (32) weighted entries
// follow its instant, which for an entry still there means a "~" entry counting until it
// leaves its window; for one already gone, it must mean nothing, or the log counts 2
// slots at 10000 that no event holds.
func TestLimiter_Release_trimmedWeightedReservationLeavesNoGhost(t *testing.T) {
	t.Parallel()
	long := msQuota(throttle.ScopeTenant, 40, 10_000)
	short := msQuota(throttle.ScopeTenant, 40, 1_000)
	steps := []modelStep{
		{at: 0, tenant: "A", quotas: []throttle.Quota{long}, cost: 40, member: "M",
			want: &modelDecision{Allowed: true, Quota: long, Count: 40, Remaining: 0, At: 0}},
		{at: 1, tenant: "A", quotas: []throttle.Quota{long}, cost: 2, token: "R", timeout: 60_000,
			want: &modelDecision{Reserved: true, Quota: long, Count: 40, Remaining: 0, RetryAfter: msDuration(9_999), At: 1}},
	}
	for i := 1; i <= 60; i++ {
		at := int64(1 + i)
		slot := int64(10_000 * (1 + i/20)) // T1..T19 at 10000 beside R, then 20 a slot
		steps = append(steps, modelStep{at: at, tenant: "A", quotas: []throttle.Quota{long}, cost: 2, token: fmt.Sprintf("T%d", i),
			want: &modelDecision{Reserved: true, Quota: long, Count: 40, Remaining: 0, RetryAfter: msDuration(slot - at), At: at}})
	}
	steps = append(steps,
		modelStep{at: 11_001, tenant: "A", quotas: []throttle.Quota{short}, member: "S",
			want: &modelDecision{Allowed: true, Quota: short, Count: 1, Remaining: 39, At: 11_001}},
		modelStep{at: 11_002, tenant: "A", quotas: []throttle.Quota{long}, token: "R", release: true},
	)
	m := checkSequence(t, steps)
	st := m.logs[modelLogOf(throttle.Key{TaskType: "api:call", Tenant: "A"}, throttle.ScopeTenant)]
	var names []string
	for _, e := range st.entries {
		if strings.HasPrefix(e.name, "~") || e.score < 20_000 && e.name != "S" {
			names = append(names, fmt.Sprintf("%s@%d", e.name, e.score))
		}
	}
	if len(st.entries) != 42 || len(names) > 0 {
		t.Fatalf("the log holds %d entries, these before 20000 but S: %v; want 42 (S at 11001, and T20..T60 from 20000 on), none other", len(st.entries), names)
	}
}

// TestLimiter_AllowAt_claimAfterShorterWindowTrim: a token whose reservation lost its L
// entry to a shorter window's trim still holds it (P says so): it is a late claim, decided
// afresh without its reservation, and the reservation is gone from P, the leases and the
// fair queue at once (not left to lapse). Rule tenant=2/1s, cost 1 (the script's one-log
// path): A1, A2 run at 1000, R reserves 2000; X, under tenant=2/100ms, runs at 2300 and
// trims up to 2200, R's entry with it. R comes back at 2400: admitted, Held, or, with Y
// run at 2350 too, reserved afresh at 3300 (when X leaves), Held.
func TestLimiter_AllowAt_claimAfterShorterWindowTrim(t *testing.T) {
	t.Parallel()
	long := msQuota(throttle.ScopeTenant, 2, 1_000)
	short := msQuota(throttle.ScopeTenant, 2, 100)
	q := []throttle.Quota{long}
	setup := []modelStep{
		{at: 1_000, tenant: "A", quotas: q, token: "A1"},
		{at: 1_000, tenant: "A", quotas: q, token: "A2"},
		{at: 1_000, tenant: "A", quotas: q, token: "R",
			want: &modelDecision{Reserved: true, Quota: long, Count: 2, Remaining: 0, RetryAfter: msDuration(1_000), At: 1_000}},
		{at: 2_300, tenant: "A", quotas: []throttle.Quota{short}, token: "X",
			want: &modelDecision{Allowed: true, Quota: short, Count: 1, Remaining: 1, At: 2_300}},
	}
	noReservation := func(t *testing.T, m *model) {
		t.Helper()
		st := m.logs[modelLogOf(throttle.Key{TaskType: "api:call", Tenant: "A"}, throttle.ScopeTenant)]
		if _, ok := m.leases["api:call"]["R"]; ok || len(st.pending) > 0 {
			t.Fatalf("after R's claim: leases %v, pending %v; want R's old reservation gone", m.leases["api:call"], st.pending)
		}
	}
	t.Run("Admitted", func(t *testing.T) {
		t.Parallel()
		m := checkSequence(t, append(setup, modelStep{at: 2_400, tenant: "A", quotas: q, token: "R",
			want: &modelDecision{Allowed: true, Held: true, Quota: long, Count: 2, Remaining: 0, At: 2_400}}))
		noReservation(t, m)
	})
	t.Run("ReservedAfresh", func(t *testing.T) {
		t.Parallel()
		m := checkSequence(t, append(setup,
			modelStep{at: 2_350, tenant: "A", quotas: q, token: "Y",
				want: &modelDecision{Allowed: true, Quota: long, Count: 2, Remaining: 0, At: 2_350}},
			modelStep{at: 2_400, tenant: "A", quotas: q, token: "R",
				want: &modelDecision{Reserved: true, Held: true, Quota: long, Count: 2, Remaining: 0, RetryAfter: msDuration(900), At: 2_400}}))
		st := m.logs[modelLogOf(throttle.Key{TaskType: "api:call", Tenant: "A"}, throttle.ScopeTenant)]
		if s, ok := st.pending["1:R"]; !ok || s != 3_300 || len(st.pending) != 1 {
			t.Fatalf("pending after R's claim: %v; want R's reservation alone, at 3300", st.pending)
		}
	})
}

// TestLimiter_AllowAt_lateClaimWithoutLease: a token whose reservation is pending in P
// with no lease (another log's lapse deleted it) and whose L entry has been trimmed is
// still a late claim (P says it holds a reservation): general decides it afresh, Held,
// with its claim wait as horizon. A one-log path that asked only the lease (HSETNX)
// before reserving took it for a new one: Held false, and with a claim wait that covers
// the slot, reserved where the contract admits. It asks P too.
//
// Rule type=2/1s; A1, A2 run at 1000 and X reserves 2000 on the type log (lease "y").
// An override moves tenant A to tenant=2/1s: B1, B2 run at 1000 on A's tenant log, and X,
// back at 1001 under it, is not pending there: it reserves 2000 on the tenant log (its
// lease rewritten, "t=2/1000"), its type reservation left behind. At 3000 tenant B,
// still under type=2/1s with a claim timeout of 1s, lapses X's old type reservation,
// and with it X's lease. C1, C2 run at 3050 on A's tenant log (trimming <= 2050: X's L
// entry). X comes back at 3100 (late, within its 5s claim timeout): P holds it.
func TestLimiter_AllowAt_lateClaimWithoutLease(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 2, 1_000)
	ten := msQuota(throttle.ScopeTenant, 2, 1_000)
	Y, T := []throttle.Quota{typ}, []throttle.Quota{ten}
	setup := []modelStep{
		{at: 1_000, tenant: "A", quotas: Y, member: "A1"},
		{at: 1_000, tenant: "A", quotas: Y, member: "A2"},
		{at: 1_000, tenant: "A", quotas: Y, token: "X",
			want: &modelDecision{Reserved: true, Quota: typ, Count: 2, Remaining: 0, RetryAfter: msDuration(1_000), At: 1_000}},
		{at: 1_000, tenant: "A", quotas: T, member: "B1"},
		{at: 1_000, tenant: "A", quotas: T, member: "B2"},
		{at: 1_001, tenant: "A", quotas: T, token: "X",
			want: &modelDecision{Reserved: true, Quota: ten, Count: 2, Remaining: 0, RetryAfter: msDuration(999), At: 1_001}},
		{at: 3_000, tenant: "B", quotas: Y, member: "B", timeout: 1_000,
			want: &modelDecision{Allowed: true, Quota: typ, Count: 1, Remaining: 1, At: 3_000}},
		{at: 3_050, tenant: "A", quotas: T, member: "C1",
			want: &modelDecision{Allowed: true, Quota: ten, Count: 1, Remaining: 1, At: 3_050}},
		{at: 3_050, tenant: "A", quotas: T, member: "C2",
			want: &modelDecision{Allowed: true, Quota: ten, Count: 2, Remaining: 0, At: 3_050}},
	}
	t.Run("ReservedAfreshHeld", func(t *testing.T) {
		t.Parallel()
		checkSequence(t, append(setup[:len(setup):len(setup)], modelStep{at: 3_100, tenant: "A", quotas: T, token: "X",
			want: &modelDecision{Reserved: true, Held: true, Quota: ten, Count: 2, Remaining: 0, RetryAfter: msDuration(950), At: 3_100}}))
	})
	t.Run("AdmittedWithinClaimWait", func(t *testing.T) {
		t.Parallel()
		checkSequence(t, append(setup[:len(setup):len(setup)], modelStep{at: 3_100, tenant: "A", quotas: T, token: "X", claim: 1_000,
			want: &modelDecision{Allowed: true, Held: true, Quota: ten, Count: 1, Remaining: 1, Delay: msDuration(950), At: 4_050}}))
	})
}
