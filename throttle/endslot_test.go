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
