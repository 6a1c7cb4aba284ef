package throttle_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Bounded work per decision (core v2, rule 4): every path runs a bounded number of Redis
// commands, each O(log N) or reading at most K_SCAN + 1 entries, whatever the backlog and
// the limit. The bound stated in lua/sliding_window.lua and the README: maxCommands.

// maxCommands is the most Redis commands one decision may run (the script's header).
const maxCommands = 120

// TestLimiter_AllowAt_boundedWork measures, by INFO commandstats, the commands each path
// runs on a type quota of 1000/1s among 100 tenants, with 2,000 and then 10,000
// reservations waiting: admission (another task type), denial, a new reservation (the fair
// share), a claim ahead, a late claim, a release, a reservation of higher priority. Each path decides alike behind both
// backlogs, every count is within maxCommands, and none grows with the backlog.
func TestLimiter_AllowAt_boundedWork(t *testing.T) {
	t.Parallel()
	counts := map[int]map[string]int64{}
	for _, backlog := range []int{2_000, 10_000} {
		rdb := redistest.Start(t)
		l, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			t.Fatal(err)
		}
		q := []throttle.Quota{typeQuota(1000, time.Second)}
		req := func(i int) throttle.Request {
			return throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: fmt.Sprintf("t%d", i%100)}, Quotas: q,
				Reservation: fmt.Sprintf("R%d", i), ClaimWait: 2 * time.Second}
		}
		for i := range 1000 + backlog { // 1000 admitted at t=0, then the backlog reserved
			if d := allowAtV2(t, l, req(i), 0); d.Allowed != (i < 1000) {
				t.Fatalf("backlog %d: call %d at t=0: %+v", backlog, i, d)
			}
		}
		c := map[string]int64{}
		c["admission"] = commandsOf(t, rdb, func() {
			other := throttle.Request{Key: throttle.Key{TaskType: "report:build", Tenant: "t1"}, Quotas: q}
			if d := allowAtV2(t, l, other, 10); !d.Allowed {
				t.Fatalf("admission: %+v", d)
			}
		})
		c["denial"] = commandsOf(t, rdb, func() {
			if d := allowAtV2(t, l, throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "t7"}, Quotas: q}, 10); d.Allowed {
				t.Fatalf("denial: %+v", d)
			}
		})
		c["reservation"] = commandsOf(t, rdb, func() {
			if d := allowAtV2(t, l, req(1_000_000), 10); !d.Reserved {
				t.Fatalf("reservation: %+v", d)
			}
		})
		c["claim ahead"] = commandsOf(t, rdb, func() {
			if d := allowAtV2(t, l, req(1000), 10); !d.Allowed || !d.Held { // reserved at 1000, 990ms ahead
				t.Fatalf("claim: %+v", d)
			}
		})
		c["late claim"] = commandsOf(t, rdb, func() {
			late := req(1001) // reserved at 1000, 500ms late: the window is full, it reserves again
			late.ClaimWait = 0
			if d := allowAtV2(t, l, late, 1_500); !d.Held || !d.Reserved {
				t.Fatalf("late claim: %+v", d)
			}
		})
		c["release"] = commandsOf(t, rdb, func() {
			if held, err := l.Release(context.Background(), "api:call", "R1002"); err != nil || !held {
				t.Fatalf("release: %v %v", held, err)
			}
		})
		c["priority"] = commandsOf(t, rdb, func() {
			// Of priority 1 among reservations of 0, at t=1500 (the late claim's instant): it
			// takes the first slot pending after now (at 2000) and the one there moves to the
			// end of the backlog.
			hi := req(2_000_000)
			hi.Priority = 1
			if d := allowAtV2(t, l, hi, 1_500); !d.Reserved || d.RetryAfter != 500*time.Millisecond {
				t.Fatalf("priority: %+v", d)
			}
		})
		counts[backlog] = c
	}
	for path, small := range counts[2_000] {
		large := counts[10_000][path]
		t.Logf("%-12s %3d commands behind 2,000 reservations, %3d behind 10,000", path, small, large)
		if small > maxCommands || large > maxCommands {
			t.Errorf("%s runs %d and %d commands, more than %d", path, small, large, maxCommands)
		}
		if large != small {
			t.Errorf("%s runs %d commands behind 10,000 reservations, %d behind 2,000: its work depends on the backlog", path, large, small)
		}
	}
}
