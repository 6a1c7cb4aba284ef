package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Priority (Request.Priority): a reserving event of higher priority takes the earliest slot
// after now that a pending reservation of lower priority holds on the same logs; the one
// it displaces moves to its own earliest instant. Every step below runs on the script and
// the reference model (checkSequence: same decisions, sets and TTLs), and the decisions
// that matter are written out.

// prioPending returns the instants of the reservations pending on the log of tenant (or
// the type's, for ""), by P member, as the model holds them after a checkSequence (which
// has compared them with the script's after every step).
func prioPending(m *model, tenant string) map[string]int64 {
	id := modelLog{taskType: "api:call", scope: throttle.ScopeType}
	if tenant != "" {
		id = modelLog{taskType: "api:call", scope: throttle.ScopeTenant, tenant: tenant}
	}
	return maps.Clone(m.logs[id].pending)
}

// prioLowBacklog is the backlog under tenant=1/1s: ten tasks L0-L9 of priority
// prio at t=0, L0 admitted, Lk reserved at k seconds.
func prioLowBacklog(q throttle.Quota, prio int) []modelStep {
	qs := []throttle.Quota{q}
	steps := []modelStep{{at: 0, tenant: "acme", quotas: qs, token: "L0", prio: prio,
		want: &modelDecision{Allowed: true, Quota: q, Count: 1}}}
	for k := int64(1); k <= 9; k++ {
		steps = append(steps, modelStep{at: 0, tenant: "acme", quotas: qs, token: fmt.Sprintf("L%d", k), prio: prio,
			want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(1000 * k)}})
	}
	return steps
}

// TestLimiter_AllowAt_priorityTakesLowerSlot is issue 9's scenario at explicit instants:
// tenant=1/1s, L0-L9 (priority 0) at t=0, then C (priority 1) at t=500. C reserves L1's slot
// at 1000 (RetryAfter 500ms, not 9500ms behind L9), L1 moves to 10000, its own earliest
// instant. L1, back at 1000 for its old instant, is denied until 10000 (once more); C runs
// at 1000, L2-L9 at their instants, L1 at 10000: 11 starts, 1s apart.
func TestLimiter_AllowAt_priorityTakesLowerSlot(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeTenant, 1, 1000)
	qs := []throttle.Quota{q}
	critical := modelStep{at: 500, tenant: "acme", quotas: qs, token: "C", prio: 1,
		want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(500), At: 500}}
	t.Run("Displaced", func(t *testing.T) {
		t.Parallel()
		m := checkSequence(t, append(prioLowBacklog(q, 0), critical))
		want := map[string]int64{"1:C": 1000, "1:L1": 10_000}
		for k := int64(2); k <= 9; k++ {
			want[fmt.Sprintf("1:L%d", k)] = 1000 * k
		}
		if got := prioPending(m, "acme"); !maps.Equal(got, want) {
			t.Errorf("pending after C: %v\nwant %v", got, want)
		}
		lease := m.leases["api:call"]
		if lease["C"].priority != 1 || lease["L1"].priority != 0 {
			t.Errorf("leases %v: want C's of priority 1, L1's of 0", lease)
		}
	})
	t.Run("AllRun", func(t *testing.T) {
		t.Parallel()
		steps := append(prioLowBacklog(q, 0), critical,
			// L1 back for 1000 (woken for its old instant): held at 10000 now.
			modelStep{at: 1000, tenant: "acme", quotas: qs, token: "L1",
				want: &modelDecision{Reserved: true, Held: true, Quota: q, Count: 1, RetryAfter: msd(9000), At: 1000}},
			modelStep{at: 1000, tenant: "acme", quotas: qs, token: "C", prio: 1,
				want: &modelDecision{Allowed: true, Held: true, Quota: q, Count: 1, At: 1000}})
		for k := int64(2); k <= 9; k++ {
			steps = append(steps, modelStep{at: 1000 * k, tenant: "acme", quotas: qs, token: fmt.Sprintf("L%d", k),
				want: &modelDecision{Allowed: true, Held: true, Quota: q, Count: 1, At: 1000 * k}})
		}
		steps = append(steps, modelStep{at: 10_000, tenant: "acme", quotas: qs, token: "L1",
			want: &modelDecision{Allowed: true, Held: true, Quota: q, Count: 1, At: 10_000}})
		m := checkSequence(t, steps)
		var starts []time.Time // the admissions' instants, as each step's decision (checked) says
		for _, s := range steps {
			if s.want != nil && s.want.Allowed {
				starts = append(starts, ms(s.want.At))
			}
		}
		if len(starts) != 11 || throttle.MaxInWindow(starts, time.Second) != 1 {
			t.Errorf("admissions at %v: want 11, at most 1 in any 1s window", starts)
		}
		// The log keeps its last window, (9000, 10000]: L1's admission.
		if got := m.logs[modelLog{taskType: "api:call", scope: throttle.ScopeTenant, tenant: "acme"}].entries; len(got) != 1 || got[0].score != 10_000 {
			t.Errorf("log holds %d entries, want L1's admission at 10000 alone", len(got))
		}
		if p := prioPending(m, "acme"); len(p) != 0 {
			t.Errorf("pending after all ran: %v, want none", p)
		}
	})
}

// TestLimiter_AllowAt_priorityNotOverEqualOrHigher: C of priority 1 at t=500 displaces no
// reservation of priority 1 or 2: it reserves its own earliest instant, 10000 (RetryAfter
// 9500ms), and L1 keeps 1000. With L1 of priority 2 and L2 of 0, C takes L2's 2000
// (RetryAfter 1500ms), the first of lower priority, and L2 moves to 10000.
func TestLimiter_AllowAt_priorityNotOverEqualOrHigher(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeTenant, 1, 1000)
	qs := []throttle.Quota{q}
	for _, prio := range []int{1, 2} {
		t.Run(fmt.Sprintf("backlog=%d", prio), func(t *testing.T) {
			t.Parallel()
			m := checkSequence(t, append(prioLowBacklog(q, prio), modelStep{at: 500, tenant: "acme", quotas: qs, token: "C", prio: 1,
				want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(9500), At: 500}}))
			if p := prioPending(m, "acme"); p["1:L1"] != 1000 || p["1:C"] != 10_000 {
				t.Errorf("pending %v: want L1 still at 1000, C at 10000", p)
			}
		})
	}
	t.Run("SkipsHigher", func(t *testing.T) {
		t.Parallel()
		steps := prioLowBacklog(q, 0)
		steps[1].prio = 2 // L1
		m := checkSequence(t, append(steps, modelStep{at: 500, tenant: "acme", quotas: qs, token: "C", prio: 1,
			want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(1500), At: 500}}))
		if p := prioPending(m, "acme"); p["1:L1"] != 1000 || p["1:C"] != 2000 || p["1:L2"] != 10_000 {
			t.Errorf("pending %v: want L1 still at 1000, C at 2000, L2 moved to 10000", p)
		}
	})
}

// TestLimiter_AllowAt_priorityAdmittedWithinWait: C of priority 1 at t=500 with MaxWait
// 500ms is admitted for L1's slot at 1000 (Delay 500ms): the slot is within its wait. L1
// moves to 10000. Without a token C displaces nothing: denied, RetryAfter 9500ms.
func TestLimiter_AllowAt_priorityAdmittedWithinWait(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeTenant, 1, 1000)
	qs := []throttle.Quota{q}
	m := checkSequence(t, append(prioLowBacklog(q, 0),
		modelStep{at: 500, tenant: "acme", quotas: qs, prio: 1,
			want: &modelDecision{Quota: q, Count: 1, RetryAfter: msd(9500), At: 500}},
		modelStep{at: 500, tenant: "acme", quotas: qs, token: "C", prio: 1, wait: 500,
			want: &modelDecision{Allowed: true, Quota: q, Count: 1, Delay: msd(500), At: 1000}}))
	if p := prioPending(m, "acme"); p["1:L1"] != 10_000 || len(p) != 9 {
		t.Errorf("pending %v: want L1 moved to 10000, L2-L9 where they were", p)
	}
	if _, ok := m.leases["api:call"]["C"]; ok {
		t.Errorf("C holds a lease after its admission: %v", m.leases["api:call"])
	}
}

// TestLimiter_AllowAt_priorityOverFairShare: under type=1/1s, tenant A's A0-A4 at t=0 (A0
// admitted, A1-A4 reserved at 1000-4000), then B's task at t=100. With no priorities B's
// fair rank gives it A2's slot at 2000 (A2 moves to 5000). With A's tasks at priority 1,
// B's fair share (priority 0) displaces none of them: B reserves 5000. With B at priority
// 2, B takes the earliest lower one, A1's 1000 (RetryAfter 900ms), and A1 moves to 5000.
func TestLimiter_AllowAt_priorityOverFairShare(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeType, 1, 1000)
	qs := []throttle.Quota{q}
	for _, c := range []struct {
		name         string
		aPrio, bPrio int
		bAt          int64
		moved        string // the A reservation moved to 5000, if any
	}{
		{"FairShare", 0, 0, 2000, "A2"},
		{"FairShareSkipsHigher", 1, 0, 5000, ""},
		{"PriorityFirst", 1, 2, 1000, "A1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			steps := []modelStep{{at: 0, tenant: "A", quotas: qs, token: "A0", prio: c.aPrio,
				want: &modelDecision{Allowed: true, Quota: q, Count: 1}}}
			for k := int64(1); k <= 4; k++ {
				steps = append(steps, modelStep{at: 0, tenant: "A", quotas: qs, token: fmt.Sprintf("A%d", k), prio: c.aPrio,
					want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(1000 * k)}})
			}
			steps = append(steps, modelStep{at: 100, tenant: "B", quotas: qs, token: "B", prio: c.bPrio,
				want: &modelDecision{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(c.bAt - 100), At: 100}})
			m := checkSequence(t, steps)
			want := map[string]int64{"1:B": c.bAt}
			for k := int64(1); k <= 4; k++ {
				want[fmt.Sprintf("1:A%d", k)] = 1000 * k
			}
			if c.moved != "" {
				want["1:"+c.moved] = 5000
			}
			if got := prioPending(m, ""); !maps.Equal(got, want) {
				t.Errorf("type log pending %v\nwant %v", got, want)
			}
		})
	}
}

// TestLimiter_AllowAt_priorityOtherTenantNeedsRoom: under tenant=1/1s and type=2/1s, A0
// runs at 0 and A1, A2 reserve 1000 and 2000; B0 runs at 100. B1 (priority 1) at 200
// could take A1's type slot at 1000, but B's own tenant quota is full there (B0 at 100):
// it reserves its own earliest, 1100, displacing nobody. C (priority 1, an idle tenant)
// at 200 takes A1's 1000 (RetryAfter 800ms); A1 moves to 3000, the first instant both of
// its quotas have room (A's tenant log holds A2 at 2000, the type's C at 1000).
func TestLimiter_AllowAt_priorityOtherTenantNeedsRoom(t *testing.T) {
	t.Parallel()
	ten, typ := msQuota(throttle.ScopeTenant, 1, 1000), msQuota(throttle.ScopeType, 2, 1000)
	qs := []throttle.Quota{ten, typ}
	steps := []modelStep{
		{at: 0, tenant: "A", quotas: qs, token: "A0", want: &modelDecision{Allowed: true, Quota: ten, Count: 1}},
		{at: 0, tenant: "A", quotas: qs, token: "A1", want: &modelDecision{Reserved: true, Quota: ten, Count: 1, RetryAfter: msd(1000)}},
		{at: 0, tenant: "A", quotas: qs, token: "A2", want: &modelDecision{Reserved: true, Quota: ten, Count: 1, RetryAfter: msd(2000)}},
		{at: 100, tenant: "B", quotas: qs, token: "B0", want: &modelDecision{Allowed: true, Quota: ten, Count: 1, At: 100}},
	}
	t.Run("NoRoom", func(t *testing.T) {
		t.Parallel()
		m := checkSequence(t, append(slices.Clone(steps), modelStep{at: 200, tenant: "B", quotas: qs, token: "B1", prio: 1,
			want: &modelDecision{Reserved: true, Quota: ten, Count: 1, RetryAfter: msd(900), At: 200}}))
		if p, want := prioPending(m, ""), map[string]int64{"1:A1": 1000, "1:A2": 2000, "1:B1": 1100}; !maps.Equal(p, want) {
			t.Errorf("type log pending %v, want %v", p, want)
		}
	})
	t.Run("Room", func(t *testing.T) {
		t.Parallel()
		m := checkSequence(t, append(slices.Clone(steps), modelStep{at: 200, tenant: "C", quotas: qs, token: "C", prio: 1,
			want: &modelDecision{Reserved: true, Quota: typ, Count: 2, RetryAfter: msd(800), At: 200}}))
		if p, want := prioPending(m, ""), map[string]int64{"1:A1": 3000, "1:A2": 2000, "1:C": 1000}; !maps.Equal(p, want) {
			t.Errorf("type log pending %v, want %v", p, want)
		}
		if p, want := prioPending(m, "A"), map[string]int64{"1:A1": 3000, "1:A2": 2000}; !maps.Equal(p, want) {
			t.Errorf("A's tenant log pending %v, want %v", p, want)
		}
	})
}

// TestLimiter_AllowAt_priorityValidated: a priority outside [0, MaxPriority] is ErrInvalid,
// before any Redis call; Reservations lists a reservation's priority.
func TestLimiter_AllowAt_priorityValidated(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	q := []throttle.Quota{tenantQuota(1, time.Second)}
	for _, p := range []int{-1, throttle.MaxPriority + 1} {
		_, err := l.AllowAt(context.Background(), throttle.Request{Key: throttle.Key{TaskType: "api:call"}, Quotas: q, Priority: p}, ms(0))
		if !errors.Is(err, throttle.ErrInvalid) {
			t.Errorf("Priority %d: err %v, want ErrInvalid", p, err)
		}
	}
	for i, p := range []int{0, throttle.MaxPriority} {
		req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: q, Priority: p,
			Reservation: fmt.Sprintf("R%d", i)}
		if d := allowAt(t, l, req, 0); d.Allowed != (i == 0) {
			t.Fatalf("Priority %d at t=0: %s", p, outcomeOf(d))
		}
	}
	if d := allowAt(t, l, throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: q,
		Reservation: "R2", Priority: 7}, 0); !d.Reserved || d.RetryAfter != 2*time.Second {
		t.Fatalf("R2: %s, want reserved at 2000, behind R1 (priority MaxPriority keeps its 1000)", outcomeOf(d))
	}
	got := map[string]int{}
	if err := l.Reservations(context.Background(), "api:call", func(r throttle.Reservation) bool {
		got[r.Token] = r.Priority
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if want := map[string]int{"R1": throttle.MaxPriority, "R2": 7}; !maps.Equal(got, want) {
		t.Errorf("Reservations: priorities %v, want %v", got, want)
	}
}
