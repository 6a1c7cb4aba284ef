package throttle_test

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// endSlotHint is the score of the end-slot hint "#e" for a quota (lua/sliding_window.lua,
// END SLOT HINT): -2^52 + limit * 2^32 + window in ms.
func endSlotHint(limit int, window time.Duration) float64 {
	return float64(-(1 << 52) + int64(limit)<<32 + window.Milliseconds())
}

// hintOf returns the score of the log's "#e" and whether it has one.
func hintOf(t *testing.T, rdb redis.Cmdable, log string) (float64, bool) {
	t.Helper()
	s, err := rdb.ZScore(context.Background(), log, "#e").Result()
	if err == redis.Nil {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return s, true
}

// TestLimiter_AllowAt_endSlotHint: a reservation made at the earliest instant, at or after
// the log's latest, leaves the log a hint ("#e") that no instant before that latest one
// has room, so the next reservation goes to the end slot without looking for one. A
// claim on time keeps it (it changes no count); a release, which can free a slot before
// the end, drops it, and the next reservation takes the freed slot. Rule tenant=1/1s: A
// admitted at 0, then B, C, D reserve 1000, 2000, 3000.
func TestLimiter_AllowAt_endSlotHint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log := l.RedisKey(key, throttle.ScopeTenant)
	req := func(token string) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: token}
	}
	wantHint := func(when string, want bool) {
		t.Helper()
		s, ok := hintOf(t, rdb, log)
		if ok != want || ok && s != endSlotHint(1, time.Second) {
			t.Fatalf("%s: the log's \"#e\" is %v (present %v); want present %v, at %v", when, s, ok, want, endSlotHint(1, time.Second))
		}
	}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 0)
	wantHint("after an admission", false)
	resvWantReserved(t, l, req("B"), 100, 1000) // nothing ahead: the window's entry leaving it
	wantHint("after B", true)
	resvWantReserved(t, l, req("C"), 200, 2000) // by the hint: B's window is full
	resvWantReserved(t, l, req("D"), 300, 3000)
	wantHint("after D", true)
	if held, err := l.Release(ctx, "api:call", "C"); err != nil || !held {
		t.Fatalf("Release C: %v, %v; want held", held, err)
	}
	wantHint("after C's release", false)
	// C's slot at 2000 is free; without the release dropping "#e", E would get 4000.
	resvWantReserved(t, l, req("E"), 400, 2000)
	wantHint("after E, before the log's end", false) // not the end slot: no claim about (2000, 3000)
	resvWantReserved(t, l, req("F"), 500, 4000)      // a search that saw every candidate: the hint again
	wantHint("after F", true)
	resvWantAdmitted(t, l, req("B"), 1000) // a claim on time changes no count
	wantHint("after B's claim", true)
	resvWantReserved(t, l, req("G"), 1001, 5000)
	got := entriesOf(t, rdb, log)
	for m, at := range got { // B's admission, under the member Allow drew for it
		if m[0] != '@' && at == 1000 {
			delete(got, m)
			got["B's admission"] = at
		}
	}
	if want := map[string]int64{"B's admission": 1000, "@1:D": 3000, "@1:E": 2000, "@1:F": 4000, "@1:G": 5000}; !maps.Equal(got, want) {
		t.Errorf("the log holds %v; want %v", got, want)
	}
}

// TestLimiter_AllowAt_endSlotHintOtherQuota: a call under another quota on the same log (a
// rule whose window changed) trims by its own window, and may drop entries the hint's
// quota still counts: its write drops the hint, so the next call under the hint's quota
// searches again (the trial that found it: a hint kept there sent a call with room at now
// to the end slot, or failed on the lease it had not read). Quotas 2/1s (the hint's) and
// 2/10ms: two admissions at 1000 fill 2/1s, and y1 reserves 2000 (the hint).
func TestLimiter_AllowAt_endSlotHintOtherQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	long, short := tenantQuota(2, time.Second), tenantQuota(2, 10*time.Millisecond)
	// Each subtest's reservation token is its own (the token is a task id: one lease per
	// token on a task type, whichever tenant holds it).
	setup := func(t *testing.T, y1 string) (throttle.Key, string) {
		key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{long}}, 1000)
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{long}}, 1000)
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{long}, Reservation: y1}, 1000, 2000)
		log := l.RedisKey(key, throttle.ScopeTenant)
		if _, ok := hintOf(t, rdb, log); !ok {
			t.Fatal("after y1: no \"#e\"; want the hint")
		}
		return key, log
	}
	t.Run("ClaimUnderAShorterWindow", func(t *testing.T) {
		t.Parallel()
		key, log := setup(t, "y1")
		// y1 claims 5ms ahead under 2/10ms: its trim (<= 1985) drops both admissions at 1000.
		d := allowAt(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{short}, Reservation: "y1", ClaimWait: 10 * time.Millisecond}, 1995)
		if want := (outcome{Allowed: true, Held: true, Quota: short, Count: 1, Remaining: 1, Delay: msd(5), At: 2000}); outcomeOf(d) != want {
			t.Fatalf("y1's claim at 1995: got %s; want %s", outcomeOf(d), want)
		}
		if _, ok := hintOf(t, rdb, log); ok {
			t.Fatal("after a claim under another quota: \"#e\" is there; want it dropped")
		}
		// Under 2/1s the log holds y1's admission at 2000 alone: room at 1996.
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{long}, Reservation: "z"}, 1996)
	})
	t.Run("AdmissionUnderAShorterWindow", func(t *testing.T) {
		t.Parallel()
		key, log := setup(t, "y2")
		// Admitted at 1500 under 2/10ms, trimming both entries at 1000.
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{short}, Reservation: "w"}, 1500)
		if _, ok := hintOf(t, rdb, log); ok {
			t.Fatal("after an admission under another quota: \"#e\" is there; want it dropped")
		}
		// Under 2/1s: 1500 and @2000; room at 1501 in its own window, not in the one
		// ending at 2000, so z reserves 2500 (when 1500 leaves).
		resvWantReserved(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{long}, Reservation: "z"}, 1501, 2500)
	})
}
