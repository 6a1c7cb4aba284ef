package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// This file tests reservations (Request.Reservation, Decision.Reserved) against the
// contract in lua/sliding_window.lua's header, at explicit instants.

// resvSetKey returns the key of the set that mirrors the reservations held in the log
// l.RedisKey(key, scope): "reserved:" right after the hash tag.
func resvSetKey(t *testing.T, l *throttle.Limiter, key throttle.Key, scope throttle.Scope) string {
	t.Helper()
	log := l.RedisKey(key, scope)
	i := strings.Index(log, "}:")
	if i < 0 {
		t.Fatalf("log key %q has no hash tag", log)
	}
	return log[:i+2] + "reserved:" + log[i+2:]
}

// resvWantReserved decides req at at and fails the test unless it is denied holding a
// reservation at the instant reservedAt exactly.
func resvWantReserved(t *testing.T, l *throttle.Limiter, req throttle.Request, at, reservedAt int64) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if d.Allowed || !d.Reserved || d.Replay || d.RetryAfter != msd(reservedAt-at) || !d.RetryAt().Equal(ms(reservedAt)) {
		t.Fatalf("t=%d reservation %q: got %+v Reserved=%v RetryAt=%d; want a denial reserved at %d (RetryAfter %dms)",
			at, req.Reservation, outcomeOf(d), d.Reserved, d.RetryAt().UnixMilli(), reservedAt, reservedAt-at)
	}
	return d
}

// resvWantAdmitted decides req at at and fails the test unless it is a fresh admission.
func resvWantAdmitted(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d := mustAdmit(t, l, req, at)
	if d.Replay || d.Reserved {
		t.Fatalf("t=%d reservation %q: got %+v Reserved=%v, want a fresh admission", at, req.Reservation, outcomeOf(d), d.Reserved)
	}
	return d
}

// resvSnapshot is what the server holds in some keys, and how many writes it has made.
type resvSnapshot struct {
	writes int64
	sets   [][]redis.Z
}

func resvTakeSnapshot(t *testing.T, rdb *redis.Client, keys []string) resvSnapshot {
	t.Helper()
	s := resvSnapshot{writes: dirty(t, rdb)}
	for _, k := range keys {
		s.sets = append(s.sets, zsetOf(t, rdb, k))
	}
	return s
}

// resvWantUnchanged fails the test if the server made a write since s, or a key's set changed.
func resvWantUnchanged(t *testing.T, rdb *redis.Client, keys []string, s resvSnapshot, what string) {
	t.Helper()
	if got := dirty(t, rdb); got != s.writes {
		t.Errorf("%s: rdb_changes_since_last_save went from %d to %d; want no write", what, s.writes, got)
	}
	for i, k := range keys {
		if got := zsetOf(t, rdb, k); !slices.Equal(got, s.sets[i]) {
			t.Errorf("%s: %s changed:\n got %v\nwant %v", what, k, got, s.sets[i])
		}
	}
}

// resvWantSet fails the test unless key holds exactly the members scored as want says.
func resvWantSet(t *testing.T, rdb *redis.Client, key string, want map[string]int64) {
	t.Helper()
	got := map[string]int64{}
	for _, z := range zsetOf(t, rdb, key) {
		got[z.Member.(string)] = int64(z.Score)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("%s:\n got %v\nwant %v", key, got, want)
	}
}

// resvWantExpires fails the test unless every key exists with a TTL (PTTL > 0, never -1).
func resvWantExpires(t *testing.T, rdb *redis.Client, what string, keys ...string) {
	t.Helper()
	for _, k := range keys {
		if ttl := pttl(t, rdb, k); ttl <= 0 {
			t.Errorf("%s: PTTL %s = %v, want > 0", what, k, ttl)
		}
	}
}

// resvMostIn returns the most instants of ats (ms) in any window (s-w, s] (w in ms).
func resvMostIn(ats []int64, w int64) int {
	ts := make([]time.Time, len(ats))
	for i, at := range ats {
		ts[i] = ms(at)
	}
	return throttle.MaxInWindow(ts, msd(w))
}

// resvFill50 admits 5 events at 1000 under 5/1s and then reserves for the 50
// events "task-1".."task-50", event i at arrive(i), checking every reserved instant:
// 2000 + 1000*floor((i-1)/5), five a second over the next ten seconds, in order.
func resvFill50(t *testing.T, l *throttle.Limiter, key throttle.Key, q throttle.Quota, arrive func(i int) int64) {
	t.Helper()
	for range 5 {
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 1000)
	}
	for i := 1; i <= 50; i++ {
		req := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: fmt.Sprintf("task-%d", i)}
		d := resvWantReserved(t, l, req, arrive(i), 2000+1000*int64((i-1)/5))
		// Every entry in the window counts, the reservations made before it too.
		if d.Quota != q || d.Count != 5+i-1 || d.Remaining != 0 {
			t.Errorf("task-%d: Quota %v Count %d Remaining %d, want %v, %d, 0", i, d.Quota, d.Count, d.Remaining, q, 5+i-1)
		}
	}
}

// TestLimiter_AllowAt_reservationsSpreadDenials is the example: 5 per 1s, five
// events admitted at 1000, then 50 more, each with a reservation. They are spread over the
// next ten seconds, five a second in the order denied, and each one called again at its
// instant is admitted at once: denied once, then run. The window never holds more than 5.
func TestLimiter_AllowAt_reservationsSpreadDenials(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(5, time.Second)
	arrivals := map[string]func(i int) int64{
		"OneMsApart":  func(i int) int64 { return 999 + int64(i) }, // 1000..1049
		"SameInstant": func(int) int64 { return 1000 },
	}
	for name, arrive := range arrivals {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
			log, reserved := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
			resvFill50(t, l, key, q, arrive)

			want := map[string]int64{}
			for i := 1; i <= 50; i++ {
				want[fmt.Sprintf("1@task-%d", i)] = 2000 + 1000*int64((i-1)/5)
			}
			resvWantSet(t, rdb, reserved, want)
			if n := zcard(t, rdb, log); n != 55 {
				t.Errorf("log holds %d entries, want 5 admissions + 50 reservations", n)
			}
			resvWantExpires(t, rdb, "after the reservations", log, reserved)

			admitted := []int64{1000, 1000, 1000, 1000, 1000}
			for i := 1; i <= 50; i++ { // i ascending is instants ascending
				at := 2000 + 1000*int64((i-1)/5)
				req := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: fmt.Sprintf("task-%d", i),
					Member: fmt.Sprintf("run-%d", i)}
				d := resvWantAdmitted(t, l, req, at)
				if d.Count != 5 || d.Remaining != 0 {
					t.Errorf("task-%d at %d: Count %d Remaining %d, want 5 and 0 (its second's five slots)", i, at, d.Count, d.Remaining)
				}
				admitted = append(admitted, at)
				// The whole window up to now, reservations and admissions, holds at most 5.
				if n, err := rdb.ZCount(context.Background(), log, fmt.Sprint("(", at-1000), fmt.Sprint(at)).Result(); err != nil || n > 5 {
					t.Errorf("task-%d at %d: ZCOUNT (%d, %d] = %d (%v), want <= 5", i, at, at-1000, at, n, err)
				}
				// The admission is made once: its reply lost, the call is a replay.
				if d := allowAt(t, l, req, at); !d.Allowed || !d.Replay {
					t.Errorf("task-%d at %d called again with its Member: %+v, want a replay", i, at, outcomeOf(d))
				}
				resvWantExpires(t, rdb, fmt.Sprintf("task-%d", i), log)
			}
			if got := resvMostIn(admitted, 1000); got != 5 {
				t.Errorf("most admissions in a 1s window = %d, want 5: %v", got, admitted)
			}
			if n := zcard(t, rdb, reserved); n != 0 {
				t.Errorf("%d reservations left after all were used: %v", n, zsetOf(t, rdb, reserved))
			}
		})
	}
}

// TestLimiter_AllowAt_newEventBehindReservations: an event without a reservation never
// takes a slot promised to one: it is told to come back after the reservations, and its
// denial writes nothing.
func TestLimiter_AllowAt_newEventBehindReservations(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(5, time.Second)

	t.Run("AfterFullSeconds", func(t *testing.T) {
		key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
		resvFill50(t, l, key, q, func(i int) int64 { return 999 + int64(i) })
		keys := []string{l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)}
		// Seconds 2000..11000 are promised, five each: the first free slot is at 12000.
		for _, at := range []int64{1050, 2000, 5500, 11000} {
			for _, member := range []string{"", "new-event"} {
				s := resvTakeSnapshot(t, rdb, keys)
				d := allowAt(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: member}, at)
				if d.Allowed || d.Reserved || d.RetryAfter != msd(12000-at) {
					t.Errorf("t=%d new event: %+v Reserved=%v, want a denial until 12000 (RetryAfter %dms), no reservation",
						at, outcomeOf(d), d.Reserved, 12000-at)
				}
				resvWantUnchanged(t, rdb, keys, s, fmt.Sprintf("t=%d new event denied", at))
			}
		}
	})

	t.Run("FreeSlotsOnly", func(t *testing.T) {
		key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
		keys := []string{l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)}
		plain := func(member string) throttle.Request {
			return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: member}
		}
		reserving := func(id string) throttle.Request {
			return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: id}
		}
		for range 5 {
			mustAdmit(t, l, plain(""), 1000)
		}
		// Seven reservations: five at 2000, two at 3000, which has three slots left.
		for i := 1; i <= 7; i++ {
			resvWantReserved(t, l, reserving(fmt.Sprintf("r%d", i)), 1000, 2000+1000*int64((i-1)/5))
		}
		s := resvTakeSnapshot(t, rdb, keys)
		if d := allowAt(t, l, plain("n1"), 1100); d.Allowed || d.Reserved || d.RetryAfter != msd(3000-1100) {
			t.Errorf("t=1100 new event: %+v Reserved=%v, want a denial until 3000", outcomeOf(d), d.Reserved)
		}
		resvWantUnchanged(t, rdb, keys, s, "new event denied at 1100")
		// At 2000 the five reservations due are not called yet: a new event does not take them.
		s = resvTakeSnapshot(t, rdb, keys)
		if d := allowAt(t, l, plain("n2"), 2000); d.Allowed || d.Reserved || d.RetryAfter != msd(1000) {
			t.Errorf("t=2000 new event: %+v Reserved=%v, want a denial until 3000", outcomeOf(d), d.Reserved)
		}
		resvWantUnchanged(t, rdb, keys, s, "new event denied at 2000")
		for i := 1; i <= 5; i++ {
			resvWantAdmitted(t, l, reserving(fmt.Sprintf("r%d", i)), 2000)
		}
		// At 3000: three new events fill the free slots, the fourth is denied, and the two
		// reservations of 3000 still get theirs.
		for _, m := range []string{"n1", "n2", "n3"} {
			resvWantAdmitted(t, l, plain(m), 3000)
		}
		s = resvTakeSnapshot(t, rdb, keys)
		if d := allowAt(t, l, plain("n4"), 3000); d.Allowed || d.RetryAfter != msd(1000) {
			t.Errorf("t=3000 fourth new event: %+v, want a denial until 4000", outcomeOf(d))
		}
		resvWantUnchanged(t, rdb, keys, s, "fourth new event denied at 3000")
		for _, id := range []string{"r6", "r7"} {
			if d := resvWantAdmitted(t, l, reserving(id), 3000); d.Count != 5 || d.Remaining != 0 {
				t.Errorf("%s at 3000: Count %d Remaining %d, want 5 and 0", id, d.Count, d.Remaining)
			}
		}
		if n := zcard(t, rdb, keys[1]); n != 0 {
			t.Errorf("reservations left: %v", zsetOf(t, rdb, keys[1]))
		}
	})
}

// TestLimiter_AllowAt_dueReservationNotBlockedBehind: limit 1/1s, A admitted at 0, B
// reserves 1000 and C 2000. B is admitted when it comes, on time or late, whatever C holds
// behind it; C then waits for room after B's actual admission.
func TestLimiter_AllowAt_dueReservationNotBlockedBehind(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	setup := func(t *testing.T) (b, c throttle.Request) {
		key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 0)
		b = throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "B"}
		c = throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "C"}
		resvWantReserved(t, l, b, 100, 1000)
		resvWantReserved(t, l, c, 200, 2000)
		return b, c
	}
	t.Run("OnTime", func(t *testing.T) {
		t.Parallel()
		b, c := setup(t)
		resvWantAdmitted(t, l, b, 1000)
		resvWantAdmitted(t, l, c, 2000)
	})
	t.Run("Late", func(t *testing.T) {
		t.Parallel()
		b, c := setup(t)
		resvWantAdmitted(t, l, b, 1500)
		// C is due but B ran at 1500: room at 2500, and C keeps its reservation.
		for _, at := range []int64{2000, 2499} {
			d := allowAt(t, l, c, at)
			if d.Allowed || !d.Reserved || d.RetryAfter != msd(2500-at) || d.Count != 1 {
				t.Errorf("C at %d: %+v Reserved=%v, want a denial with RetryAfter %dms (B's 1500 + 1000), Count 1, still reserved",
					at, outcomeOf(d), d.Reserved, 2500-at)
			}
		}
		resvWantSet(t, rdb, resvSetKey(t, l, c.Key, throttle.ScopeTenant), map[string]int64{"1@C": 2000})
		resvWantAdmitted(t, l, c, 2500)
		resvWantSet(t, rdb, resvSetKey(t, l, c.Key, throttle.ScopeTenant), map[string]int64{})
	})
}

// TestLimiter_AllowAt_reservationReplay: calling again before the reserved instant, with
// the same or a new Member, finds the reservation: the same instant, and nothing written.
func TestLimiter_AllowAt_reservationReplay(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	keys := []string{l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 0)
	b := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "task-b", Member: "m1"}
	resvWantReserved(t, l, b, 500, 1000)
	resvWantSet(t, rdb, keys[1], map[string]int64{"1@task-b": 1000})
	ttls := []time.Duration{pttl(t, rdb, keys[0]), pttl(t, rdb, keys[1])}
	for _, call := range []struct {
		member string
		at     int64
	}{{"m1", 500}, {"m2", 500}, {"m1", 700}, {"m3", 999}} {
		s := resvTakeSnapshot(t, rdb, keys)
		r := b
		r.Member = call.member
		resvWantReserved(t, l, r, call.at, 1000)
		resvWantUnchanged(t, rdb, keys, s, fmt.Sprintf("replay with member %s at %d", call.member, call.at))
		for i, k := range keys {
			if got := pttl(t, rdb, k); got <= 0 || got > ttls[i] {
				t.Errorf("replay at %d: PTTL %s = %v, want in (0, %v]: a replay sets no TTL", call.at, k, got, ttls[i])
			}
		}
	}
	resvWantAdmitted(t, l, b, 1000)
}

// TestLimiter_AllowAt_unusedReservationExpires: limit 1/1s, A admitted at 0, B reserves
// 1000 and never comes. A new event C is denied up to 1999 and admitted at 2000, B's
// instant + the window. No key is ever left without a TTL.
func TestLimiter_AllowAt_unusedReservationExpires(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, reserved := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "A"}, 0)
	resvWantExpires(t, rdb, "A admitted", log)
	b := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "B"}
	resvWantReserved(t, l, b, 1, 1000)
	resvWantExpires(t, rdb, "B reserved", log, reserved)

	c := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "C"}
	for _, at := range []int64{1000, 1001, 1500, 1999} {
		s := resvTakeSnapshot(t, rdb, []string{log, reserved})
		d := allowAt(t, l, c, at)
		if d.Allowed || d.Reserved || d.RetryAfter != msd(2000-at) {
			t.Errorf("C at %d: %+v Reserved=%v, want a denial until 2000 (B's reservation counts)", at, outcomeOf(d), d.Reserved)
		}
		resvWantUnchanged(t, rdb, []string{log, reserved}, s, fmt.Sprintf("C denied at %d", at))
		resvWantExpires(t, rdb, fmt.Sprintf("C denied at %d", at), log, reserved)
	}
	resvWantAdmitted(t, l, c, 2000)
	// A and B's lapsed reservation no longer count, but stay for the 2s trim grace.
	resvWantSet(t, rdb, log, map[string]int64{"1:A": 0, "1@B": 1000, "1:C": 2000})
	resvWantExpires(t, rdb, "C admitted", log, reserved)

	// B, back after its reservation lapsed, is a new waiting event: it reserves again.
	resvWantReserved(t, l, b, 2000, 3000)
	resvWantSet(t, rdb, log, map[string]int64{"1:A": 0, "1:C": 2000, "1@B": 3000})
	resvWantSet(t, rdb, reserved, map[string]int64{"1@B": 3000})
	resvWantExpires(t, rdb, "B reserved again", log, reserved)
	resvWantAdmitted(t, l, b, 3000)
	resvWantExpires(t, rdb, "B admitted", log)
	if n, err := rdb.Exists(context.Background(), reserved).Result(); err != nil || n == 1 && pttl(t, rdb, reserved) <= 0 {
		t.Errorf("reservation set after B's admission: exists %d (%v), PTTL %v; want gone or expiring", n, err, pttl(t, rdb, reserved))
	}
}

// TestLimiter_AllowAt_reservationCost: an event of cost 2 under 5/1s reserves 2 slots at
// the first instant with room for 2, in both the log and the reservation set.
func TestLimiter_AllowAt_reservationCost(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(5, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, reserved := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
	cost2 := func(id string) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Reservation: id}
	}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Member: "a"}, 1000)
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Member: "b"}, 1000)
	// 4 of 5 slots used: two cost-2 events fit in each later second.
	instants := map[string]int64{"R1": 2000, "R2": 2000, "R3": 3000, "R4": 3000, "R5": 4000}
	want := map[string]int64{}
	for _, id := range []string{"R1", "R2", "R3", "R4", "R5"} {
		resvWantReserved(t, l, cost2(id), 1000, instants[id])
		want["1@"+id], want["2@"+id] = instants[id], instants[id]
	}
	resvWantSet(t, rdb, reserved, want)

	keys := []string{log, reserved}
	s := resvTakeSnapshot(t, rdb, keys)
	r := cost2("R3")
	r.Member = "another"
	resvWantReserved(t, l, r, 1500, 3000)
	resvWantUnchanged(t, rdb, keys, s, "replay of R3")
	// A cost-1 event without a reservation fits beside R5 at 4000.
	if d := allowAt(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 1000); d.Allowed || d.RetryAfter != msd(3000) {
		t.Errorf("new cost-1 event at 1000: %+v, want a denial until 4000", outcomeOf(d))
	}
	resvWantUnchanged(t, rdb, keys, s, "new event denied")

	for _, id := range []string{"R1", "R2", "R3", "R4", "R5"} {
		d := resvWantAdmitted(t, l, cost2(id), instants[id])
		wantCount := 4
		if id == "R5" {
			wantCount = 2
		}
		if d.Count != wantCount || d.Remaining != 5-wantCount {
			t.Errorf("%s at %d: Count %d Remaining %d, want %d and %d", id, instants[id], d.Count, d.Remaining, wantCount, 5-wantCount)
		}
		delete(want, "1@"+id)
		delete(want, "2@"+id)
		resvWantSet(t, rdb, reserved, want)
	}
}

// TestLimiter_AllowAt_reservationMultiQuota: tenant 2/1s and type 3/1s. A reservation is
// the latest instant that every quota has room at, it lands in both logs and both
// reservation sets, and its admission removes it from both.
func TestLimiter_AllowAt_reservationMultiQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	tq, yq := tenantQuota(2, time.Second), typeQuota(3, time.Second)
	quotas := []throttle.Quota{tq, yq}
	a := throttle.Key{TaskType: "mq:call", Tenant: "a"}
	b := throttle.Key{TaskType: "mq:call", Tenant: "b"}
	req := func(key throttle.Key, id string) throttle.Request {
		return throttle.Request{Key: key, Quotas: quotas, Reservation: id}
	}
	tenantA, tenantB, typ := l.RedisKey(a, throttle.ScopeTenant), l.RedisKey(b, throttle.ScopeTenant), l.RedisKey(a, throttle.ScopeType)
	resA, resB, resT := resvSetKey(t, l, a, throttle.ScopeTenant), resvSetKey(t, l, b, throttle.ScopeTenant), resvSetKey(t, l, a, throttle.ScopeType)

	mustAdmit(t, l, throttle.Request{Key: a, Quotas: quotas}, 1000)
	mustAdmit(t, l, throttle.Request{Key: a, Quotas: quotas}, 1050)
	mustAdmit(t, l, throttle.Request{Key: b, Quotas: quotas}, 1200)

	steps := []struct {
		key        throttle.Key
		id         string
		reservedAt int64
		binding    throttle.Quota
	}{
		{a, "r1", 2000, tq}, // tenant a: 1000 + 1s; type: 1000 + 1s: a tie, the first quota
		{b, "r2", 2050, yq}, // tenant b has room; type: 1050 + 1s
		{a, "r3", 2200, yq}, // tenant a: 1050 + 1s = 2050; type: 1200 + 1s = 2200, the later
	}
	for _, s := range steps {
		d := resvWantReserved(t, l, req(s.key, s.id), 1300, s.reservedAt)
		if d.Quota != s.binding {
			t.Errorf("%s: Quota %v, want %v", s.id, d.Quota, s.binding)
		}
	}
	score := func(key, member string) int64 {
		t.Helper()
		f, err := rdb.ZScore(context.Background(), key, member).Result()
		if err != nil {
			t.Errorf("ZSCORE %s %s: %v", key, member, err)
		}
		return int64(f)
	}
	for _, k := range []string{tenantA, typ, resA, resT} {
		if got := score(k, "1@r3"); got != 2200 {
			t.Errorf("%s: r3 scored %d, want 2200", k, got)
		}
	}
	resvWantSet(t, rdb, resA, map[string]int64{"1@r1": 2000, "1@r3": 2200})
	resvWantSet(t, rdb, resB, map[string]int64{"1@r2": 2050})
	resvWantSet(t, rdb, resT, map[string]int64{"1@r1": 2000, "1@r2": 2050, "1@r3": 2200})
	resvWantExpires(t, rdb, "reservations made", tenantA, tenantB, typ, resA, resB, resT)

	keys := []string{tenantA, tenantB, typ, resA, resB, resT}
	s := resvTakeSnapshot(t, rdb, keys)
	resvWantReserved(t, l, req(a, "r3"), 1400, 2200)
	resvWantUnchanged(t, rdb, keys, s, "replay of r3")

	resvWantAdmitted(t, l, req(a, "r1"), 2000)
	resvWantAdmitted(t, l, req(b, "r2"), 2050)
	resvWantAdmitted(t, l, req(a, "r3"), 2200)
	for _, k := range []string{tenantA, typ, resA, resT} {
		if _, err := rdb.ZScore(context.Background(), k, "1@r3").Result(); !errors.Is(err, redis.Nil) {
			t.Errorf("%s still holds r3's reservation after its admission (err %v)", k, err)
		}
	}
	resvWantSet(t, rdb, resA, map[string]int64{})
	resvWantSet(t, rdb, resB, map[string]int64{})
	resvWantSet(t, rdb, resT, map[string]int64{})
	scores := func(key string) []int64 {
		var s []int64
		for _, z := range zsetOf(t, rdb, key) {
			s = append(s, int64(z.Score))
		}
		return s
	}
	// The logs hold every admission: nothing is older than window + 2s grace yet.
	if got := scores(tenantA); !slices.Equal(got, []int64{1000, 1050, 2000, 2200}) {
		t.Errorf("tenant a's log: %v, want admissions at 1000 1050 2000 2200", got)
	}
	if got := scores(typ); !slices.Equal(got, []int64{1000, 1050, 1200, 2000, 2050, 2200}) {
		t.Errorf("type log: %v, want admissions at 1000 1050 1200 2000 2050 2200", got)
	}
	if got := resvMostIn([]int64{1000, 1050, 2000, 2200}, 1000); got != 2 {
		t.Errorf("tenant a: %d admissions in a 1s window, want 2", got)
	}
	if got := resvMostIn([]int64{1000, 1050, 1200, 2000, 2050, 2200}, 1000); got != 3 {
		t.Errorf("type: %d admissions in a 1s window, want 3", got)
	}
}

// TestLimiter_AllowAt_reservationIDsAreData: reservation ids that contain ':' or look
// like another id's entries ("1@x" beside "x", whose cost-2 entries are "1@x" and "2@x")
// keep reservations of their own.
func TestLimiter_AllowAt_reservationIDsAreData(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(4, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, reserved := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
	req := func(id string) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Reservation: id}
	}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2}, 1000)
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2}, 1000)
	ids := []string{"x", "1@x", "2@x", ":x"}
	instants := map[string]int64{"x": 2000, "1@x": 2000, "2@x": 3000, ":x": 3000}
	for _, id := range ids {
		resvWantReserved(t, l, req(id), 1000, instants[id])
	}
	want := map[string]int64{}
	for _, id := range ids {
		want["1@"+id], want["2@"+id] = instants[id], instants[id]
	}
	resvWantSet(t, rdb, reserved, want)
	if n := zcard(t, rdb, reserved); n != 8 {
		t.Errorf("reservation set holds %d entries, want 8 (2 for each of 4 ids)", n)
	}
	keys := []string{log, reserved}
	for _, id := range ids {
		s := resvTakeSnapshot(t, rdb, keys)
		r := req(id)
		r.Member = "again-" + id
		resvWantReserved(t, l, r, 1500, instants[id])
		resvWantUnchanged(t, rdb, keys, s, "replay of "+id)
	}
	// Each is used on its own: the one whose entries look like another's first.
	for _, id := range []string{"1@x", "x", ":x", "2@x"} {
		resvWantAdmitted(t, l, req(id), instants[id])
		delete(want, "1@"+id)
		delete(want, "2@"+id)
		resvWantSet(t, rdb, reserved, want)
	}
}

// TestLimiter_AllowAt_memberIsNotAReservation: an admission's Member and a reservation id
// live in different namespaces, so a Member equal to a pending (or lapsed) reservation id
// is not taken for a replay of an admission: it is counted and denied like any event.
func TestLimiter_AllowAt_memberIsNotAReservation(t *testing.T) {
	t.Parallel()
	l, _ := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	k := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	mustAdmit(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}}, 0)
	d := allowAt(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}, Reservation: "job-7"}, 100)
	if !d.Reserved || d.RetryAfter != msd(900) {
		t.Fatalf("job-7 at 100: %+v, want a reservation at 1000", outcomeOf(d))
	}
	wantOutcome(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}, Member: "job-7"}, 200,
		outcome{Quota: q, Count: 2, RetryAfter: msd(1800), ResetAfter: msd(1800)})
}

// TestLimiter_Cancel: a cancelled reservation frees its slot at once: limit 1/1000ms on
// the tenant and 5/1000ms on the type, A admitted at 0, B reserves 1000 and cancels; its
// entries leave both logs, both reservation sets and the owners hash, and C, arriving at
// 500, reserves B's old slot 1000 instead of the one after it.
func TestLimiter_Cancel(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
	quotas := []throttle.Quota{tenantQuota(1, time.Second), typeQuota(5, time.Second)}
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	req := func(id string) throttle.Request { return throttle.Request{Key: key, Quotas: quotas, Reservation: id} }
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
	if d := allowAt(t, l, req("B"), 100); !d.Reserved || d.RetryAfter != msd(900) {
		t.Fatalf("B at 100: %+v, want a reservation at 1000", outcomeOf(d))
	}
	if err := l.Cancel(ctx, req("B")); err != nil {
		t.Fatal(err)
	}
	for _, scope := range []throttle.Scope{throttle.ScopeTenant, throttle.ScopeType} {
		for _, k := range []string{l.RedisKey(key, scope), resvSetKey(t, l, key, scope)} {
			if _, err := rdb.ZScore(ctx, k, "1@B").Result(); err != redis.Nil {
				t.Errorf("%s still holds B's reservation (err %v)", k, err)
			}
		}
	}
	if n, err := rdb.HExists(ctx, "throttle:{api:call}:owners", "B").Result(); err != nil || n {
		t.Errorf("owners hash still names B (%v, %v)", n, err)
	}
	if d := allowAt(t, l, req("C"), 500); !d.Reserved || d.RetryAfter != msd(500) {
		t.Errorf("C at 500: %+v, want B's old slot at 1000", outcomeOf(d))
	}
	if err := l.Cancel(ctx, throttle.Request{Key: key, Quotas: quotas}); err != nil {
		t.Errorf("Cancel without a reservation: %v, want a no-op", err)
	}
}
