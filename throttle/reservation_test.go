package throttle_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// This file tests reservations (Request.Reservation, Decision.Reserved) against the
// contract in lua/sliding_window.lua's header, at explicit instants. A reservation of
// cost c for token T is the entry "@c:T" at its instant in each of its logs, the member
// "c:T" of each log's pending set, and a record in the task type's leases hash.

// resvWantReserved decides req at at and fails the test unless it is denied holding a
// reservation at the instant reservedAt exactly, made by this call (not held before).
func resvWantReserved(t *testing.T, l *throttle.Limiter, req throttle.Request, at, reservedAt int64) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if d.Allowed || !d.Reserved || d.Held || d.RetryAfter != msd(reservedAt-at) || !d.RetryAt().Equal(ms(reservedAt)) {
		t.Fatalf("t=%d reservation %q: got %s, RetryAt %d; want a new reservation at %d (RetryAfter %dms)",
			at, req.Reservation, outcomeOf(d), d.RetryAt().UnixMilli(), reservedAt, reservedAt-at)
	}
	return d
}

// resvWantHeld decides req at at and fails the test unless it is denied, not yet due,
// still holding its reservation at reservedAt.
func resvWantHeld(t *testing.T, l *throttle.Limiter, req throttle.Request, at, reservedAt int64) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if d.Allowed || !d.Reserved || !d.Held || d.RetryAfter != msd(reservedAt-at) {
		t.Fatalf("t=%d reservation %q: got %s; want it held at %d (RetryAfter %dms)", at, req.Reservation, outcomeOf(d), reservedAt, reservedAt-at)
	}
	return d
}

// resvWantAdmitted decides req at at and fails the test unless it is a fresh admission
// at at that claimed the reservation it held.
func resvWantAdmitted(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d := mustAdmit(t, l, req, at)
	if d.Reserved || !d.Held {
		t.Fatalf("t=%d reservation %q: got %s, want a claim of its reservation", at, req.Reservation, outcomeOf(d))
	}
	return d
}

// resvSnapshot is what the server holds in some keys, and how many writes it has made.
type resvSnapshot struct {
	writes int64
	sets   [][]redis.Z
	ttls   []time.Duration
}

func resvTakeSnapshot(t *testing.T, rdb *redis.Client, keys []string) resvSnapshot {
	t.Helper()
	s := resvSnapshot{writes: dirty(t, rdb)}
	for _, k := range keys {
		s.sets = append(s.sets, zsetOf(t, rdb, k))
		s.ttls = append(s.ttls, pttl(t, rdb, k))
	}
	return s
}

// resvWantUnchanged fails the test if the server made a write since s, or a key's set
// changed, or its TTL went up.
func resvWantUnchanged(t *testing.T, rdb *redis.Client, keys []string, s resvSnapshot, what string) {
	t.Helper()
	if got := dirty(t, rdb); got != s.writes {
		t.Errorf("%s: rdb_changes_since_last_save went from %d to %d; want no write", what, s.writes, got)
	}
	for i, k := range keys {
		if got := zsetOf(t, rdb, k); !slices.Equal(got, s.sets[i]) {
			t.Errorf("%s: %s changed:\n got %v\nwant %v", what, k, got, s.sets[i])
		}
		if got := pttl(t, rdb, k); got > s.ttls[i] {
			t.Errorf("%s: PTTL %s went up from %v to %v", what, k, s.ttls[i], got)
		}
	}
}

// resvWantSet fails the test unless key holds exactly the members scored as want says
// (a window log's sentinels aside).
func resvWantSet(t *testing.T, rdb *redis.Client, key string, want map[string]int64) {
	t.Helper()
	if got := entriesOf(t, rdb, key); fmt.Sprint(got) != fmt.Sprint(want) {
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

// resvWantGone fails the test unless key does not exist (an emptied set is deleted).
func resvWantGone(t *testing.T, rdb *redis.Client, what, key string) {
	t.Helper()
	if n, err := rdb.Exists(context.Background(), key).Result(); err != nil || n != 0 {
		t.Errorf("%s: %s exists (%d, %v), want it gone: %v", what, key, n, err, zsetOf(t, rdb, key))
	}
}

// resvLeases returns the tokens in the task type's leases hash.
func resvLeases(t *testing.T, l *throttle.Limiter, rdb *redis.Client, taskType string) []string {
	t.Helper()
	keys, err := rdb.HKeys(context.Background(), resvTypeKey(t, l, taskType, "leases")).Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	return keys
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
		// Count is the window ending at the decision: the five admissions at 1000. (v1
		// counted every reservation ahead as if it were now: 5+i-1.)
		if d.Quota != q || d.Count != 5 || d.Remaining != 0 || d.At.UnixMilli() != arrive(i) {
			t.Errorf("task-%d: %s; want Quota %v, Count 5, Remaining 0, At %d", i, outcomeOf(d), q, arrive(i))
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
			// A task type of its own: reservation tokens are per task type.
			key := throttle.Key{TaskType: t.Name(), Tenant: "acme"}
			log, pending := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
			leases := resvTypeKey(t, l, key.TaskType, "leases")
			resvFill50(t, l, key, q, arrive)

			wantP, wantL := map[string]int64{}, map[string]int64{}
			for i := 1; i <= 50; i++ {
				at := 2000 + 1000*int64((i-1)/5)
				wantP[fmt.Sprintf("1:task-%d", i)] = at
				wantL[fmt.Sprintf("@1:task-%d", i)] = at
			}
			resvWantSet(t, rdb, pending, wantP)
			if n := zcard(t, rdb, log); n != 55 {
				t.Errorf("log holds %d entries, want 5 admissions + 50 reservations", n)
			}
			for m, at := range entriesOf(t, rdb, log) {
				if want, ok := wantL[m]; ok && want != at {
					t.Errorf("log: %s at %d, want %d", m, at, want)
				}
			}
			if n := len(resvLeases(t, l, rdb, key.TaskType)); n != 50 {
				t.Errorf("leases hold %d tokens, want 50", n)
			}
			resvWantExpires(t, rdb, "after the reservations", log, pending, leases)
			resvWantGone(t, rdb, "no type quota, no fair tags", resvTypeKey(t, l, key.TaskType, "fair"))

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
				// The admission is made once: its reply lost, the call is a replay, at its instant.
				if d := allowAt(t, l, req, at+1); !d.Allowed || !d.Replay || d.At.UnixMilli() != at {
					t.Errorf("task-%d at %d called again with its Member: %s, want a replay at %d", i, at+1, outcomeOf(d), at)
				}
				resvWantExpires(t, rdb, fmt.Sprintf("task-%d", i), log)
			}
			if got := resvMostIn(admitted, 1000); got != 5 {
				t.Errorf("most admissions in a 1s window = %d, want 5: %v", got, admitted)
			}
			resvWantGone(t, rdb, "after all were claimed", pending)
			resvWantGone(t, rdb, "after all were claimed", leases)
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
		// (v1 also probed 11000; in v2 the reservations of 2000..6000 are past their claim
		// timeout of 5s by then: see below.)
		for _, at := range []int64{1050, 2000, 5500, 6999} {
			for _, member := range []string{"", "new-event"} {
				s := resvTakeSnapshot(t, rdb, keys)
				d := allowAt(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: member}, at)
				if want := (outcome{Quota: q, Count: 5, RetryAfter: msd(12000 - at), At: at}); outcomeOf(d) != want {
					t.Errorf("t=%d new event: %s, want %s", at, outcomeOf(d), want)
				}
				resvWantUnchanged(t, rdb, keys, s, fmt.Sprintf("t=%d new event denied", at))
			}
		}
		// At 11000 the 25 reservations of 2000..6000 were never claimed and have lapsed:
		// each call removes at most 8 of a log's lapsed reservations, oldest first (a
		// write), and the slots still promised (7000..11000) keep the new event out
		// until 12000.
		for i, wantLeft := range []int64{42, 34, 26, 25, 25} {
			d := allowAt(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 11000)
			if want := (outcome{Quota: q, Count: 5, RetryAfter: msd(1000), At: 11000}); outcomeOf(d) != want {
				t.Errorf("call %d at 11000: %s, want %s", i, outcomeOf(d), want)
			}
			if n := zcard(t, rdb, keys[1]); n != wantLeft {
				t.Errorf("call %d at 11000: %d reservations pending, want %d", i, n, wantLeft)
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
		wantOutcome(t, l, plain("n1"), 1100, outcome{Quota: q, Count: 5, RetryAfter: msd(3000 - 1100), At: 1100})
		resvWantUnchanged(t, rdb, keys, s, "new event denied at 1100")
		// At 2000 the five reservations due are not called yet: a new event does not take
		// them. The window ending at 2000 holds them: Count 5.
		s = resvTakeSnapshot(t, rdb, keys)
		wantOutcome(t, l, plain("n2"), 2000, outcome{Quota: q, Count: 5, RetryAfter: msd(1000), At: 2000})
		resvWantUnchanged(t, rdb, keys, s, "new event denied at 2000")
		for i := 1; i <= 5; i++ {
			resvWantAdmitted(t, l, reserving(fmt.Sprintf("r%d", i)), 2000)
		}
		// At 3000: three new events fill the free slots, the fourth is denied, and the two
		// reservations of 3000 still get theirs.
		for i, m := range []string{"n1", "n2", "n3"} {
			wantOutcome(t, l, plain(m), 3000, outcome{Allowed: true, Quota: q, Count: 3 + i, Remaining: 2 - i, At: 3000})
		}
		s = resvTakeSnapshot(t, rdb, keys)
		wantOutcome(t, l, plain("n4"), 3000, outcome{Quota: q, Count: 5, RetryAfter: msd(1000), At: 3000})
		resvWantUnchanged(t, rdb, keys, s, "fourth new event denied at 3000")
		for _, id := range []string{"r6", "r7"} {
			if d := resvWantAdmitted(t, l, reserving(id), 3000); d.Count != 5 || d.Remaining != 0 {
				t.Errorf("%s at 3000: Count %d Remaining %d, want 5 and 0", id, d.Count, d.Remaining)
			}
		}
		resvWantGone(t, rdb, "all claimed", keys[1])
	})
}

// TestLimiter_AllowAt_dueReservationNotBlockedBehind: limit 1/1s, A admitted at 0, B
// reserves 1000 and C 2000. B is admitted on time whatever C holds behind it, and so is
// C. v1 also admitted B when it came late (1500), and C then waited for room after B's
// actual admission: that broke C's promised slot for a task that was late. In v2 a late
// task is decided afresh without its own reservation, and an admission never breaks a
// promised slot: B at 1500 would put two events in C's window (1000, 2000] ... (1500,
// 2500], so it reserves again, at 3000, and C runs at 2000 as promised. A late task with
// room is admitted at its real instant (the log says when it ran); after its claim
// timeout it is a new event.
func TestLimiter_AllowAt_dueReservationNotBlockedBehind(t *testing.T) {
	t.Parallel()
	// One server, subtests in turn: EarlyWithinClaimWait checks that the server made no
	// write at all (rdb_changes_since_last_save), which a parallel subtest would break.
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	setup := func(t *testing.T, withC bool) (b, c throttle.Request) {
		key := throttle.Key{TaskType: t.Name(), Tenant: "acme"} // tokens are per task type
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}}, 0)
		b = throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "B"}
		c = throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "C"}
		resvWantReserved(t, l, b, 100, 1000)
		if withC {
			resvWantReserved(t, l, c, 200, 2000)
		}
		return b, c
	}
	t.Run("OnTime", func(t *testing.T) {
		b, c := setup(t, true)
		resvWantAdmitted(t, l, b, 1000)
		resvWantAdmitted(t, l, c, 2000)
	})
	t.Run("LateBehindAPromise", func(t *testing.T) {
		b, c := setup(t, true)
		pending := resvSetKey(t, l, b.Key, throttle.ScopeTenant)
		wantOutcome(t, l, b, 1500, outcome{Reserved: true, Held: true, Quota: q, Count: 0, Remaining: 1, RetryAfter: msd(1500), At: 1500})
		resvWantSet(t, rdb, pending, map[string]int64{"1:B": 3000, "1:C": 2000})
		resvWantSet(t, rdb, l.RedisKey(b.Key, throttle.ScopeTenant), map[string]int64{"@1:B": 3000, "@1:C": 2000})
		resvWantAdmitted(t, l, c, 2000)
		resvWantAdmitted(t, l, b, 3000)
		resvWantGone(t, rdb, "B and C claimed", pending)
	})
	t.Run("LateWithRoom", func(t *testing.T) {
		b, _ := setup(t, false)
		b.Member = "b-run"
		log := l.RedisKey(b.Key, throttle.ScopeTenant)
		wantOutcome(t, l, b, 1500, outcome{Allowed: true, Held: true, Quota: q, Count: 1, At: 1500})
		resvWantSet(t, rdb, log, map[string]int64{"b-run": 1500}) // not at 1000: when it ran
		resvWantGone(t, rdb, "B claimed late", resvSetKey(t, l, b.Key, throttle.ScopeTenant))
		wantOutcome(t, l, throttle.Request{Key: b.Key, Quotas: b.Quotas}, 1600, outcome{Quota: q, Count: 1, RetryAfter: msd(900), At: 1600})
	})
	t.Run("LateAfterClaimTimeout", func(t *testing.T) {
		b, _ := setup(t, false)
		// Pending at 1000, it lapses at 1000 + 5s: at 6000 it is a new event.
		wantOutcome(t, l, b, 6000, outcome{Allowed: true, Quota: q, Count: 1, At: 6000})
		resvWantGone(t, rdb, "lapsed", resvSetKey(t, l, b.Key, throttle.ScopeTenant))
		resvWantGone(t, rdb, "lapsed", resvTypeKey(t, l, b.Key.TaskType, "leases"))
	})
	t.Run("EarlyWithinClaimWait", func(t *testing.T) {
		b, _ := setup(t, false)
		b.ClaimWait = 300 * time.Millisecond
		keys := []string{l.RedisKey(b.Key, throttle.ScopeTenant), resvSetKey(t, l, b.Key, throttle.ScopeTenant)}
		s := resvTakeSnapshot(t, rdb, keys)
		resvWantHeld(t, l, b, 699, 1000) // 301ms early: not due yet, nothing written
		resvWantUnchanged(t, rdb, keys, s, "B 301ms early")
		// 300ms early: admitted for its instant, to start 300ms later.
		wantOutcome(t, l, b, 700, outcome{Allowed: true, Held: true, Quota: q, Count: 1, Delay: msd(300), At: 1000})
		resvWantGone(t, rdb, "B claimed", keys[1])
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
	resvWantSet(t, rdb, keys[1], map[string]int64{"1:task-b": 1000})
	for _, call := range []struct {
		member string
		at     int64
	}{{"m1", 500}, {"m2", 500}, {"m1", 700}, {"m3", 999}} {
		s := resvTakeSnapshot(t, rdb, keys)
		r := b
		r.Member = call.member
		// Held, not due: Count is the first quota's window ending at the call: the
		// admission at 0.
		d := resvWantHeld(t, l, r, call.at, 1000)
		if want := (outcome{Reserved: true, Held: true, Quota: q, Count: 1, RetryAfter: msd(1000 - call.at), At: call.at}); outcomeOf(d) != want {
			t.Errorf("again with member %s at %d: %s, want %s", call.member, call.at, outcomeOf(d), want)
		}
		resvWantUnchanged(t, rdb, keys, s, fmt.Sprintf("again with member %s at %d", call.member, call.at))
	}
	resvWantAdmitted(t, l, b, 1000)
	// Its reply lost, the claim is replayed by its Member, at 1000.
	wantOutcome(t, l, b, 1001, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, At: 1000})
}

// TestLimiter_AllowAt_unusedReservationExpires: limit 1/1s, A admitted at 0, B reserves
// 1000 and never comes. A new event C is denied up to 1999 and admitted at 2000, B's
// instant + the window: an unclaimed reservation counts like an entry at its instant.
// v1 let it lapse one window after its instant; v2 keeps it claimable for the claim
// timeout (5s) after its instant, and trims its entry from the log like any other. No
// key is ever left without a TTL.
func TestLimiter_AllowAt_unusedReservationExpires(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, pending := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
	leases := resvTypeKey(t, l, key.TaskType, "leases")
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "A"}, 0)
	resvWantExpires(t, rdb, "A admitted", log)
	b := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "B"}
	resvWantReserved(t, l, b, 1, 1000)
	resvWantExpires(t, rdb, "B reserved", log, pending, leases)

	c := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "C"}
	for _, at := range []int64{1000, 1001, 1500, 1999} {
		s := resvTakeSnapshot(t, rdb, []string{log, pending})
		wantOutcome(t, l, c, at, outcome{Quota: q, Count: 1, RetryAfter: msd(2000 - at), At: at})
		resvWantUnchanged(t, rdb, []string{log, pending}, s, fmt.Sprintf("C denied at %d", at))
		resvWantExpires(t, rdb, fmt.Sprintf("C denied at %d", at), log, pending)
	}
	mustAdmit(t, l, c, 2000)
	// A and B's entry are trimmed (at or before 2000 - 1s); B is still pending, and
	// claimable until 6000.
	resvWantSet(t, rdb, log, map[string]int64{"C": 2000})
	resvWantSet(t, rdb, pending, map[string]int64{"1:B": 1000})
	resvWantExpires(t, rdb, "C admitted", log, pending, leases)

	// B, back late but within its claim timeout, is decided afresh: C holds (1000, 2000],
	// so it reserves again, at 3000.
	wantOutcome(t, l, b, 2000, outcome{Reserved: true, Held: true, Quota: q, Count: 1, RetryAfter: msd(1000), At: 2000})
	resvWantSet(t, rdb, log, map[string]int64{"C": 2000, "@1:B": 3000})
	resvWantSet(t, rdb, pending, map[string]int64{"1:B": 3000})
	resvWantExpires(t, rdb, "B reserved again", log, pending, leases)
	resvWantAdmitted(t, l, b, 3000)
	resvWantExpires(t, rdb, "B admitted", log)
	resvWantGone(t, rdb, "B admitted", pending)
	if got := resvLeases(t, l, rdb, key.TaskType); len(got) != 0 {
		t.Errorf("leases after B's admission: %v, want none", got)
	}

	// D reserves 4000 and never comes. C (trimmed long ago: a new event) is admitted at
	// 8999, when D's window has passed, and trims D's entry; D is still pending. At 9000
	// (4000 + 5s) D lapses: its pending entry and lease go, and D, back then, is a new
	// waiting event (not Held) that reserves again, after C.
	d := throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Reservation: "D"}
	resvWantReserved(t, l, d, 3500, 4000)
	wantOutcome(t, l, c, 8999, outcome{Allowed: true, Quota: q, Count: 1, At: 8999})
	resvWantSet(t, rdb, log, map[string]int64{"C": 8999})
	resvWantSet(t, rdb, pending, map[string]int64{"1:D": 4000})
	resvWantReserved(t, l, d, 9000, 9999)
	resvWantSet(t, rdb, pending, map[string]int64{"1:D": 9999})
	if got := resvLeases(t, l, rdb, key.TaskType); !slices.Equal(got, []string{"D"}) {
		t.Errorf("leases after D reserved again: %v, want D", got)
	}
}

// TestLimiter_AllowAt_reservationCost: an event of cost 2 under 5/1s reserves 2 slots at
// the first instant with room for 2: one entry "@2:<token>" in the log, one member
// "2:<token>" in the pending set, and its cost in the cost set.
func TestLimiter_AllowAt_reservationCost(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(5, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, pending, costs := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant), resvCostsKey(t, l, key, throttle.ScopeTenant)
	cost2 := func(id string) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Reservation: id}
	}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Member: "a"}, 1000)
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Member: "b"}, 1000)
	// 4 of 5 slots used: two cost-2 events fit in each later second.
	ids := []string{"R1", "R2", "R3", "R4", "R5"}
	instants := map[string]int64{"R1": 2000, "R2": 2000, "R3": 3000, "R4": 3000, "R5": 4000}
	wantP, wantL := map[string]int64{}, map[string]int64{"*2:a": 1000, "*2:b": 1000}
	for _, id := range ids {
		resvWantReserved(t, l, cost2(id), 1000, instants[id])
		wantP["2:"+id], wantL["@2:"+id] = instants[id], instants[id]
	}
	resvWantSet(t, rdb, pending, wantP)
	resvWantSet(t, rdb, log, wantL)
	if n := zcard(t, rdb, costs); n != 7 {
		t.Errorf("cost set holds %d entries, want 7 (one per weighted entry): %v", n, zsetOf(t, rdb, costs))
	}

	keys := []string{log, pending, costs}
	s := resvTakeSnapshot(t, rdb, keys)
	r := cost2("R3")
	r.Member = "another"
	resvWantHeld(t, l, r, 1500, 3000)
	resvWantUnchanged(t, rdb, keys, s, "R3 again")
	// A cost-1 event without a reservation fits at 1000 beside the two cost-2 events: the
	// reservations are ahead, at their own instants, and no window holds more than 5 with
	// it (v1 counted every reservation as if it were now and denied it until 4000).
	wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "c"}, 1000,
		outcome{Allowed: true, Quota: q, Count: 5, At: 1000})

	for _, id := range ids {
		req := cost2(id)
		req.Member = "run-" + id
		d := resvWantAdmitted(t, l, req, instants[id])
		wantCount := 4
		if id == "R5" {
			wantCount = 2
		}
		if d.Count != wantCount || d.Remaining != 5-wantCount {
			t.Errorf("%s at %d: Count %d Remaining %d, want %d and %d", id, instants[id], d.Count, d.Remaining, wantCount, 5-wantCount)
		}
		delete(wantP, "2:"+id)
		if len(wantP) > 0 {
			resvWantSet(t, rdb, pending, wantP)
		} else {
			resvWantGone(t, rdb, "all claimed", pending)
		}
		// The claimed reservation is the admission, in place, under the new Member.
		if got, err := rdb.ZScore(context.Background(), log, "*2:run-"+id).Result(); err != nil || int64(got) != instants[id] {
			t.Errorf("%s: *2:run-%s scored %v (%v), want %d", id, id, got, err, instants[id])
		}
	}
	// At 4000 the log keeps (3000, 4000]: R5 only, and R3, R4 trimmed with their costs.
	resvWantSet(t, rdb, log, map[string]int64{"*2:run-R5": 4000})
	if got := zsetOf(t, rdb, costs); len(got) != 1 || !strings.HasSuffix(got[0].Member.(string), "|*2:run-R5") || got[0].Score != 4000 {
		t.Errorf("cost set %v, want only R5's running sum at 4000", got)
	}
}

// TestLimiter_AllowAt_reservationMultiQuota: tenant 2/1s and type 3/1s. A reservation is
// the earliest instant that every quota has room at, it lands in both logs and both
// pending sets, and its admission removes it from both.
func TestLimiter_AllowAt_reservationMultiQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
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

	// The quota a reservation names is the one that holds it back until its instant: the
	// first with no room a millisecond before it.
	steps := []struct {
		key        throttle.Key
		id         string
		reservedAt int64
		binding    throttle.Quota
		count      int
	}{
		{a, "r1", 2000, tq, 2}, // tenant a: 1000 + 1s; type: 1000 + 1s; the first listed
		{b, "r2", 2050, yq, 3}, // tenant b has room; type: 1050 + 1s
		{a, "r3", 2200, yq, 3}, // tenant a: 1050 + 1s = 2050; type: 1200 + 1s = 2200, the later
	}
	for _, s := range steps {
		d := resvWantReserved(t, l, req(s.key, s.id), 1300, s.reservedAt)
		if d.Quota != s.binding || d.Count != s.count {
			t.Errorf("%s: Quota %v Count %d, want %v and %d", s.id, d.Quota, d.Count, s.binding, s.count)
		}
	}
	score := func(key, member string) int64 {
		t.Helper()
		f, err := rdb.ZScore(ctx, key, member).Result()
		if err != nil {
			t.Errorf("ZSCORE %s %s: %v", key, member, err)
		}
		return int64(f)
	}
	for _, k := range []string{tenantA, typ} {
		if got := score(k, "@1:r3"); got != 2200 {
			t.Errorf("%s: r3 scored %d, want 2200", k, got)
		}
	}
	resvWantSet(t, rdb, resA, map[string]int64{"1:r1": 2000, "1:r3": 2200})
	resvWantSet(t, rdb, resB, map[string]int64{"1:r2": 2050})
	resvWantSet(t, rdb, resT, map[string]int64{"1:r1": 2000, "1:r2": 2050, "1:r3": 2200})
	leases, fair, fairstate := resvTypeKey(t, l, a.TaskType, "leases"), resvTypeKey(t, l, a.TaskType, "fair"), resvTypeKey(t, l, a.TaskType, "fairstate")
	resvWantExpires(t, rdb, "reservations made", tenantA, tenantB, typ, resA, resB, resT, leases, fair, fairstate)
	if got := resvLeases(t, l, rdb, a.TaskType); !slices.Equal(got, []string{"r1", "r2", "r3"}) {
		t.Errorf("leases %v, want r1 r2 r3", got)
	}

	keys := []string{tenantA, tenantB, typ, resA, resB, resT, fair}
	s := resvTakeSnapshot(t, rdb, keys)
	resvWantHeld(t, l, req(a, "r3"), 1400, 2200)
	resvWantUnchanged(t, rdb, keys, s, "r3 again")

	resvWantAdmitted(t, l, req(a, "r1"), 2000)
	resvWantAdmitted(t, l, req(b, "r2"), 2050)
	resvWantAdmitted(t, l, req(a, "r3"), 2200)
	for _, k := range []string{resA, resB, resT, fair} {
		resvWantGone(t, rdb, "all claimed", k)
	}
	if got := resvLeases(t, l, rdb, a.TaskType); len(got) != 0 {
		t.Errorf("leases after the claims: %v, want none", got)
	}
	scores := func(key string) []int64 {
		var s []int64
		for _, z := range zsetOf(t, rdb, key) {
			if !isSentinel(z.Member.(string)) {
				s = append(s, int64(z.Score))
			}
		}
		return s
	}
	// The logs keep their last window: each claim trimmed what its log held at or before
	// its instant - 1s (v1 kept everything for its 2s trim grace).
	if got := scores(tenantA); !slices.Equal(got, []int64{2000, 2200}) {
		t.Errorf("tenant a's log: %v, want admissions at 2000 2200", got)
	}
	if got := scores(typ); !slices.Equal(got, []int64{2000, 2050, 2200}) {
		t.Errorf("type log: %v, want admissions at 2000 2050 2200", got)
	}
	if got := scores(tenantB); !slices.Equal(got, []int64{1200, 2050}) {
		t.Errorf("tenant b's log: %v, want admissions at 1200 2050", got)
	}
	if got := resvMostIn([]int64{1000, 1050, 2000, 2200}, 1000); got != 2 {
		t.Errorf("tenant a: %d admissions in a 1s window, want 2", got)
	}
	if got := resvMostIn([]int64{1000, 1050, 1200, 2000, 2050, 2200}, 1000); got != 3 {
		t.Errorf("type: %d admissions in a 1s window, want 3", got)
	}
}

// TestLimiter_AllowAt_reservationIDsAreData: reservation ids that contain ':' or '@', or
// look like another id's entries ("2:x" beside "x", whose cost-2 entries are "@2:x" and
// "2:x"), keep reservations of their own, and each is released by its own id.
func TestLimiter_AllowAt_reservationIDsAreData(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(4, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log, pending := l.RedisKey(key, throttle.ScopeTenant), resvSetKey(t, l, key, throttle.ScopeTenant)
	req := func(id string) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2, Reservation: id}
	}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2}, 1000)
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Cost: 2}, 1000)
	ids := []string{"x", "2:x", "@2:x", ":x", "x@1000", "1:2:x"}
	instants := map[string]int64{"x": 2000, "2:x": 2000, "@2:x": 3000, ":x": 3000, "x@1000": 4000, "1:2:x": 4000}
	want := map[string]int64{}
	for _, id := range ids {
		resvWantReserved(t, l, req(id), 1000, instants[id])
		want["2:"+id] = instants[id]
	}
	resvWantSet(t, rdb, pending, want)
	if n := zcard(t, rdb, log); n != 8 {
		t.Errorf("log holds %d entries, want 8 (2 admissions and one entry for each of 6 ids)", n)
	}
	keys := []string{log, pending}
	for _, id := range ids {
		s := resvTakeSnapshot(t, rdb, keys)
		r := req(id)
		r.Member = "again-" + id
		resvWantHeld(t, l, r, 1500, instants[id])
		resvWantUnchanged(t, rdb, keys, s, "again "+id)
	}
	// ":x" is released, "1:2:x" cancelled; the others are used on their own, the ones
	// whose entries look like another's first.
	if ok, err := l.Release(context.Background(), key.TaskType, ":x"); err != nil || !ok {
		t.Errorf("Release(:x) = %v, %v; want true", ok, err)
	}
	delete(want, "2::x")
	resvWantSet(t, rdb, pending, want)
	if err := l.Cancel(context.Background(), req("1:2:x")); err != nil {
		t.Error(err)
	}
	delete(want, "2:1:2:x")
	resvWantSet(t, rdb, pending, want)
	for _, id := range []string{"2:x", "x", "@2:x", "x@1000"} {
		resvWantAdmitted(t, l, req(id), instants[id])
		delete(want, "2:"+id)
		if len(want) > 0 {
			resvWantSet(t, rdb, pending, want)
		}
	}
	resvWantGone(t, rdb, "all used", pending)
}

// TestLimiter_AllowAt_memberIsNotAReservation: an admission's Member and a reservation id
// live in different namespaces ("<member>" and "@<cost>:<token>", and a Member may not
// start with '@'), so a Member equal to a pending reservation id is not taken for a replay
// of an admission: it is counted and denied like any event.
func TestLimiter_AllowAt_memberIsNotAReservation(t *testing.T) {
	t.Parallel()
	l, _ := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Second)
	k := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	mustAdmit(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}}, 0)
	resvWantReserved(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}, Reservation: "job-7"}, 100, 1000)
	// Denied until job-7's slot (1000, 2000] has passed; the window ending at 200 holds the
	// admission at 0 (v1 counted the reservation too: Count 2).
	for _, m := range []string{"job-7", "1:job-7"} {
		wantOutcome(t, l, throttle.Request{Key: k, Quotas: []throttle.Quota{q}, Member: m}, 200,
			outcome{Quota: q, Count: 1, RetryAfter: msd(1800), At: 200})
	}
}

// TestLimiter_Cancel: a cancelled reservation frees its slot at once: limit 1/1000ms on
// the tenant and 5/1000ms on the type, A admitted at 0, B reserves 1000 and cancels; its
// entries leave both logs, both pending sets, the leases hash and the fair tags, and C,
// arriving at 500, reserves B's old slot 1000 instead of the one after it.
func TestLimiter_Cancel(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
	quotas := []throttle.Quota{tenantQuota(1, time.Second), typeQuota(5, time.Second)}
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	req := func(id string) throttle.Request { return throttle.Request{Key: key, Quotas: quotas, Reservation: id} }
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: quotas}, 0)
	resvWantReserved(t, l, req("B"), 100, 1000)
	fair := resvTypeKey(t, l, key.TaskType, "fair")
	if _, err := rdb.ZScore(ctx, fair, "B").Result(); err != nil {
		t.Fatalf("B has no fair tag (%v): the check below cannot fail", err)
	}
	if err := l.Cancel(ctx, req("B")); err != nil {
		t.Fatal(err)
	}
	for _, scope := range []throttle.Scope{throttle.ScopeTenant, throttle.ScopeType} {
		if _, err := rdb.ZScore(ctx, l.RedisKey(key, scope), "@1:B").Result(); err != redis.Nil {
			t.Errorf("%s still holds B's reservation (err %v)", l.RedisKey(key, scope), err)
		}
		resvWantGone(t, rdb, "B cancelled", resvSetKey(t, l, key, scope))
	}
	if got := resvLeases(t, l, rdb, key.TaskType); len(got) != 0 {
		t.Errorf("leases after B cancelled: %v, want none", got)
	}
	resvWantGone(t, rdb, "B cancelled", fair)
	if ok, err := l.Release(ctx, key.TaskType, "B"); err != nil || ok {
		t.Errorf("Release of the cancelled B = %v, %v; want false: it holds nothing", ok, err)
	}
	resvWantReserved(t, l, req("C"), 500, 1000) // B's old slot
	if err := l.Cancel(ctx, throttle.Request{Key: key, Quotas: quotas}); err != nil {
		t.Errorf("Cancel without a reservation: %v, want a no-op", err)
	}
	// Release by token alone, whatever the tenant and quotas: C's slot at 1000 goes to
	// the next event there.
	if ok, err := l.Release(ctx, key.TaskType, "C"); err != nil || !ok {
		t.Errorf("Release(C) = %v, %v; want true", ok, err)
	}
	wantOutcome(t, l, throttle.Request{Key: key, Quotas: quotas}, 1000, outcome{Allowed: true, Quota: quotas[0], Count: 1, At: 1000})
}

// TestLimiter_Reservations_listsHeld: Limiter.Reservations lists every reservation held on
// a task type's logs, from the leases hash: token, key, cost, holder and the server's TIME
// when it was made; a claimed or released one is no longer listed.
func TestLimiter_Reservations_listsHeld(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
	q := []throttle.Quota{tenantQuota(2, time.Second)}
	before, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]throttle.Reservation{}
	for _, tenant := range []string{"acme", "{x}", "a:b"} {
		key := throttle.Key{TaskType: "list:call", Tenant: tenant}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: q, Cost: 2}, 1000)
		for i, cost := range []int{1, 2} {
			tok := fmt.Sprintf("%s-%d", tenant, i)
			resvWantReserved(t, l, throttle.Request{Key: key, Quotas: q, Cost: cost, Reservation: tok, Holder: "q:default/" + tok}, 1000, 2000+1000*int64(i))
			want[tok] = throttle.Reservation{Token: tok, Key: key, Cost: cost, Holder: "q:default/" + tok}
		}
	}
	after, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	list := func() map[string]throttle.Reservation {
		got := map[string]throttle.Reservation{}
		if err := l.Reservations(ctx, "list:call", func(r throttle.Reservation) bool {
			if r.Created.Before(before.Truncate(time.Millisecond)) || r.Created.After(after) {
				t.Errorf("%s: Created %v, want the server's TIME between %v and %v", r.Token, r.Created, before, after)
			}
			r.Created = time.Time{}
			got[r.Token] = r
			return true
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := list(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Reservations:\n got %v\nwant %v", got, want)
	}
	resvWantAdmitted(t, l, throttle.Request{Key: want["acme-0"].Key, Quotas: q, Reservation: "acme-0"}, 2000)
	delete(want, "acme-0")
	if ok, err := l.Release(ctx, "list:call", "{x}-1"); err != nil || !ok {
		t.Errorf("Release = %v, %v", ok, err)
	}
	delete(want, "{x}-1")
	if got := list(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Reservations after a claim and a release:\n got %v\nwant %v", got, want)
	}
	n := 0
	if err := l.Reservations(ctx, "list:call", func(throttle.Reservation) bool { n++; return false }); err != nil || n != 1 {
		t.Errorf("Reservations stopped by fn after %d calls (%v), want 1", n, err)
	}
	if err := l.Reservations(ctx, "", func(throttle.Reservation) bool { return true }); err == nil {
		t.Error("Reservations of an empty task type: no error")
	}
}

// TestLimiter_AllowAt_claimUnderLoweredLimit: a rule lowered after tasks reserved (a tier
// or an override cut tenant=10/1s to tenant=2/1s) must not let them all run at their old
// instants. At t=0 ten events are admitted and T1..T10 reserve 1000 under 10/1s. At 1000
// they come back, in order, under 2/1s: the window ending at 1000 holds their 10
// reservations, so T1..T8 are decided afresh, each taking the next slot of 2/1s (2000,
// 2000, 3000, 3000, 4000, 4000, 5000, 5000) and giving up its old one; T9 and T10 then
// find 2 in that window and claim it in place. No window of 1s holds more than 2 of the
// events admitted from 1000 on.
func TestLimiter_AllowAt_claimUnderLoweredLimit(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	before := []throttle.Quota{tenantQuota(10, time.Second)}
	after := []throttle.Quota{tenantQuota(2, time.Second)}
	for i := range 10 {
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: before, Member: fmt.Sprintf("a%d", i)}, 0)
	}
	req := func(i int, quotas []throttle.Quota) throttle.Request {
		return throttle.Request{Key: key, Quotas: quotas, Member: fmt.Sprintf("m%d", i), Reservation: fmt.Sprintf("T%d", i)}
	}
	for i := 1; i <= 10; i++ {
		resvWantReserved(t, l, req(i, before), 0, 1000)
	}
	var admitted []time.Time
	for i, at := range []int64{2000, 2000, 3000, 3000, 4000, 4000, 5000, 5000} {
		back := req(i+1, after)
		back.Member += "-back"
		d := allowAt(t, l, back, 1000)
		// Held: it came with a reservation; Count: the window at 1000 without it.
		if d.Allowed || !d.Reserved || !d.Held || !d.RetryAt().Equal(ms(at)) || d.Count != 9-i {
			t.Fatalf("T%d back at 1000 under 2/1s: got %s, RetryAt %d; want its old slot given up and a new reservation at %d, count %d",
				i+1, outcomeOf(d), d.RetryAt().UnixMilli(), at, 9-i)
		}
	}
	for i := 9; i <= 10; i++ {
		back := req(i, after)
		back.Member += "-back"
		d := resvWantAdmitted(t, l, back, 1000)
		if d.Count != 2 || !d.At.Equal(ms(1000)) {
			t.Fatalf("T%d claim at 1000: count %d at %d, want 2 at 1000", i, d.Count, d.At.UnixMilli())
		}
		admitted = append(admitted, d.At)
	}
	for i, at := range []int64{2000, 2000, 3000, 3000, 4000, 4000, 5000, 5000} {
		back := req(i+1, after)
		back.Member += "-again"
		admitted = append(admitted, resvWantAdmitted(t, l, back, at).At)
	}
	if got := throttle.MaxInWindow(admitted, time.Second); got != 2 {
		t.Errorf("the 10 claims from 1000 on: %d within 1s, want 2 (the lowered limit)", got)
	}
}
