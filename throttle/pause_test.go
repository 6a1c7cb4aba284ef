package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_PauseAt: a paused log denies every event until the pause's end, whatever
// the path (no token, a token, several quotas), writes nothing meanwhile, never shortens
// a pause in force, and counts as before once the pause is over or lifted. Rule
// tenant=2/10s (and type=5/10s for the multi-quota calls); A runs at 0; the tenant's log
// is paused at 100 until 5000.
func TestLimiter_PauseAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	tenantQ := msQuota(throttle.ScopeTenant, 2, 10_000)
	typeQ := msQuota(throttle.ScopeType, 5, 10_000)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	one := []throttle.Quota{tenantQ}
	both := []throttle.Quota{typeQ, tenantQ}
	at := func(ms int64) time.Time { return time.UnixMilli(ms) }
	decide := func(req throttle.Request, now int64) outcome {
		t.Helper()
		d, err := l.AllowAt(ctx, req, at(now))
		if err != nil {
			t.Fatalf("AllowAt at %d: %v", now, err)
		}
		return outcomeOf(d)
	}
	want := func(got, want outcome) {
		t.Helper()
		if got != want {
			t.Errorf("got  %v\nwant %v", got, want)
		}
	}

	want(decide(throttle.Request{Key: key, Quotas: one}, 0), outcome{Allowed: true, Quota: tenantQ, Count: 1, Remaining: 1})
	if err := l.PauseAt(ctx, key, throttle.ScopeTenant, at(5_000), at(100)); err != nil {
		t.Fatal(err)
	}
	// An earlier end does not shorten it.
	if err := l.PauseAt(ctx, key, throttle.ScopeTenant, at(2_000), at(150)); err != nil {
		t.Fatal(err)
	}
	if until, ok, err := l.PausedUntil(ctx, key, throttle.ScopeTenant); err != nil || !ok || until.UnixMilli() != 5_000 {
		t.Fatalf("PausedUntil = %v, %v, %v; want 5000, true", until.UnixMilli(), ok, err)
	}
	if ttl := rdb.PTTL(ctx, l.RedisKey(key, throttle.ScopeTenant)).Val(); ttl < 4_800*time.Millisecond || ttl > 10_000*time.Millisecond {
		t.Errorf("log TTL %v; want it to outlast the pause (4.85 s) and A (10 s)", ttl)
	}
	before := rdb.ZRangeWithScores(ctx, l.RedisKey(key, throttle.ScopeTenant), 0, -1).Val()

	paused := outcome{Paused: true, Quota: tenantQ, Count: 1, Remaining: 1, RetryAfter: 4 * time.Second, At: 1_000}
	want(decide(throttle.Request{Key: key, Quotas: one}, 1_000), paused)
	want(decide(throttle.Request{Key: key, Quotas: one, Reservation: "T1"}, 1_000), paused)
	want(decide(throttle.Request{Key: key, Quotas: one, Cost: 2, Reservation: "T2"}, 1_000), paused)
	// With the type quota first, the paused tenant quota binds; the type log is untouched.
	want(decide(throttle.Request{Key: key, Quotas: both}, 1_000), outcome{Paused: true, Quota: tenantQ, Count: 1, Remaining: 1,
		RetryAfter: 4 * time.Second, At: 1_000})
	if after := rdb.ZRangeWithScores(ctx, l.RedisKey(key, throttle.ScopeTenant), 0, -1).Val(); len(after) != len(before) {
		t.Errorf("the paused log changed: %v, was %v", after, before)
	}
	if n := rdb.Exists(ctx, l.RedisKey(key, throttle.ScopeType)).Val(); n != 0 {
		t.Errorf("a denial on a paused log wrote the type log")
	}
	// Another tenant is not paused.
	other := throttle.Key{TaskType: "api:call", Tenant: "globex"}
	want(decide(throttle.Request{Key: other, Quotas: one, Reservation: "G1"}, 1_000), outcome{Allowed: true, Quota: tenantQ, Count: 1,
		Remaining: 1, At: 1_000})

	// Over at 5000: B runs (its log still holds the past pause), C is denied by the window.
	want(decide(throttle.Request{Key: key, Quotas: one}, 5_000), outcome{Allowed: true, Quota: tenantQ, Count: 2, At: 5_000})
	want(decide(throttle.Request{Key: key, Quotas: one}, 5_001), outcome{Quota: tenantQ, Count: 2, RetryAfter: 4_999 * time.Millisecond,
		At: 5_001})
	want(decide(throttle.Request{Key: key, Quotas: one, Reservation: "T3"}, 5_002), outcome{Reserved: true, Quota: tenantQ, Count: 2,
		RetryAfter: 4_998 * time.Millisecond, At: 5_002})

	// Paused again, then lifted: decided as if never paused.
	if err := l.PauseAt(ctx, key, throttle.ScopeTenant, at(60_000), at(5_003)); err != nil {
		t.Fatal(err)
	}
	want(decide(throttle.Request{Key: key, Quotas: one, Reservation: "T3"}, 6_000), outcome{Paused: true, Quota: tenantQ, Count: 2,
		RetryAfter: 54 * time.Second, At: 6_000})
	for _, wantLifted := range []bool{true, false} {
		if lifted, err := l.Resume(ctx, key, throttle.ScopeTenant); err != nil || lifted != wantLifted {
			t.Fatalf("Resume = %v, %v; want %v", lifted, err, wantLifted)
		}
	}
	want(decide(throttle.Request{Key: key, Quotas: one, Reservation: "T3"}, 6_000), outcome{Reserved: true, Held: true, Quota: tenantQ,
		Count: 2, RetryAfter: 4 * time.Second, At: 6_000})
	if _, ok, err := l.PausedUntil(ctx, key, throttle.ScopeTenant); err != nil || ok {
		t.Fatalf("PausedUntil after Resume: %v, %v; want no pause", ok, err)
	}
}

// TestLimiter_AllowAt_pastPauseCountsAsSentinel: a pause that is over stays in the log
// among the sentinels; reading an entry by rank skips it. Rule tenant=3/10s: A1-A3 run at
// 0, 1, 2; the log is paused at 3 until 100. At 200, under a limit lowered to 1, N must
// wait for the third entry of the window, A3, to leave: 10002.
func TestLimiter_AllowAt_pastPauseCountsAsSentinel(t *testing.T) {
	t.Parallel()
	three := []throttle.Quota{msQuota(throttle.ScopeTenant, 3, 10_000)}
	one := msQuota(throttle.ScopeTenant, 1, 10_000)
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: three, token: "A1"},
		{at: 1, tenant: "A", quotas: three, token: "A2"},
		{at: 2, tenant: "A", quotas: three, token: "A3"},
		{at: 3, tenant: "A", quotas: three, pause: 100},
		{at: 50, tenant: "A", quotas: three, token: "P", want: &modelDecision{Paused: true, Quota: three[0], Count: 3, Remaining: 0,
			RetryAfter: msDuration(50), At: 50}},
		{at: 200, tenant: "A", quotas: []throttle.Quota{one}, token: "N", want: &modelDecision{Reserved: true, Quota: one, Count: 3,
			Remaining: 0, RetryAfter: msDuration(9_802), At: 200}},
	})
}

// TestLimiter_PauseAt_outOfRange: a pause ending at or after MaxTime, or before the epoch,
// is ErrInvalid before any Redis command (the client has no server), its instant given in
// ms as the log would hold it.
func TestLimiter_PauseAt_outOfRange(t *testing.T) {
	t.Parallel()
	l, err := throttle.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	for _, c := range []struct {
		until time.Time
		scope throttle.Scope
		want  string
	}{
		{throttle.MaxTime.Add(123456 * time.Nanosecond), throttle.ScopeTenant,
			`throttle: invalid request: pause of api:call for tenant "acme" until 2109-05-15T07:35:11.104Z: outside 1970-2109`},
		{time.UnixMilli(-1), throttle.ScopeType,
			"throttle: invalid request: pause of api:call (the type's log) until 1969-12-31T23:59:59.999Z: outside 1970-2109"},
	} {
		err := l.PauseAt(context.Background(), key, c.scope, c.until, time.UnixMilli(0))
		if !errors.Is(err, throttle.ErrInvalid) || err.Error() != c.want {
			t.Errorf("PauseAt(until %s) = %v; want %q (ErrInvalid)", c.until, err, c.want)
		}
	}
}
