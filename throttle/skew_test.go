package throttle_test

import (
	"context"
	_ "embed"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/rs/xid"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Skew without a grace multiplier (core v2, rule 3): a log keeps its longest window's
// entries and two sentinels; a call stamped before the latest instant a write was decided
// at is decided at that instant.

//go:embed testdata/seed_sliding_window.lua
var seedScriptSrc string

// seedScript is the plain script this project grew from, a test fixture: the yardstick.
var seedScript = redis.NewScript(seedScriptSrc)

// TestLimiter_AllowAt_memoryAtLimit: a key of 100/1s at its limit (an admission every
// 10ms for 5s) holds its 100 entries, one sentinel and at most K_TRIM - 1 = 7 entries that
// have left the window (the fast path trims once 8 have), in at most 1.1 times the memory
// of the seed script's key fed the same admissions with xid members (MEMORY USAGE). The
// 499th call leaves 7 of them (the last trim was the 492nd's, i = 491), the 500th trims:
// 101 members. v1 kept 2s of grace beyond the window: 300 entries, 10.4 times the seed's
// memory.
func TestLimiter_AllowAt_memoryAtLimit(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{tenantQuota(100, time.Second)}}
	key := l.RedisKey(req.Key, throttle.ScopeTenant)
	// check compares the log's members and memory with the seed's key after a call.
	check := func(after string, members int64) {
		t.Helper()
		if n := zcardOf(t, rdb, key); n != members {
			t.Errorf("%s the log holds %d members, want %d", after, n, members)
		}
		ours, seed := memoryOf(t, rdb, key), memoryOf(t, rdb, "seed")
		t.Logf("MEMORY USAGE %s: ours %d B, the seed's %d B (%.2f x)", after, ours, seed, float64(ours)/float64(seed))
		if float64(ours) > 1.1*float64(seed) {
			t.Errorf("%s our key takes %d B, the seed's %d B: more than 1.1 x", after, ours, seed)
		}
	}
	for i := range 500 {
		if i == 499 {
			check("after 499 calls (100 entries, the sentinel and 7 that left the window)", 108)
		}
		at := int64(1_700_000_000_000 + 10*i)
		if d := allowAtV2(t, l, req, at); !d.Allowed {
			t.Fatalf("call %d at +%dms denied: %+v", i, 10*i, d)
		}
		r, err := seedScript.Run(ctx, rdb, []string{"seed"}, at, 1000, 100, xid.New().String()).Int64Slice()
		if err != nil || r[0] != 1 {
			t.Fatalf("seed call %d: %v %v", i, r, err)
		}
	}
	check("after 500 calls (its window's 100 entries and the sentinel)", 101)
}

func zcardOf(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.ZCard(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func memoryOf(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.MemoryUsage(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestLimiter_AllowAt_lateCallerDecidedAtHighWater: limit 1/1s for acme. A is admitted at
// 1000; B at 2100, whose write trims A (at or before 1100). C, stamped 1050 by a clock
// that is behind, would count the window (50, 1050], which truly held A: decided there,
// after A was trimmed, it would be a second admission in that window. It is decided at
// 2100 instead: denied until 3100, 2050ms on its own clock. Limit 2/1s for globex, same
// calls: the late one is admitted for 2100, 100ms after its own clock's now (Delay), and
// one more is denied until the entry at 2100 leaves, at 3100.
func TestLimiter_AllowAt_lateCallerDecidedAtHighWater(t *testing.T) {
	t.Parallel()
	one, two := msQuota(throttle.ScopeTenant, 1, 1_000), msQuota(throttle.ScopeTenant, 2, 1_000)
	checkSequence(t, []modelStep{
		{at: 1_000, tenant: "acme", quotas: []throttle.Quota{one}},
		{at: 2_100, tenant: "acme", quotas: []throttle.Quota{one}, want: &modelDecision{Allowed: true, Quota: one, Count: 1, Remaining: 0, At: 2_100}},
		{at: 1_050, tenant: "acme", quotas: []throttle.Quota{one}, want: &modelDecision{Quota: one, Count: 1, Remaining: 0,
			RetryAfter: msDuration(2_050), At: 2_100}},
		{at: 1_000, tenant: "globex", quotas: []throttle.Quota{two}},
		{at: 2_100, tenant: "globex", quotas: []throttle.Quota{two}},
		{at: 2_000, tenant: "globex", quotas: []throttle.Quota{two}, want: &modelDecision{Allowed: true, Quota: two, Count: 2, Remaining: 0,
			Delay: msDuration(100), At: 2_100}},
		{at: 2_050, tenant: "globex", quotas: []throttle.Quota{two}, want: &modelDecision{Quota: two, Count: 2, Remaining: 0,
			RetryAfter: msDuration(1_050), At: 2_100}},
	})
}

// TestLimiter_Allow_lateStampedCallAfterExpiry: a key's TTL outlasts its window by twice
// MaxSkew, so a call stamped up to MaxSkew before the server's clock still counts what the
// window holds. Rule tenant=1/200ms: A is admitted at c (the real clock); 300 ms later a
// call stamped c + 10 ms (290 ms behind the real clock, within MaxSkew 1 s) runs. With a
// TTL of only the window, Redis would have expired the key 100 ms before it, and B would
// be admitted with A still in its window (c + 10 - 200, c + 10].
func TestLimiter_Allow_lateStampedCallAfterExpiry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	var clock atomic.Int64
	l, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return time.UnixMilli(clock.Load()) }})
	if err != nil {
		t.Fatal(err)
	}
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quotas: []throttle.Quota{msQuota(throttle.ScopeTenant, 1, 200)}}
	c := time.Now().UnixMilli()
	clock.Store(c)
	if d, err := l.Allow(ctx, req); err != nil || !d.Allowed {
		t.Fatalf("A: %+v, %v; want admitted", d, err)
	}
	if ttl := rdb.PTTL(ctx, l.RedisKey(req.Key, throttle.ScopeTenant)).Val(); ttl <= 2*time.Second || ttl > 2200*time.Millisecond {
		t.Errorf("TTL after A: %v; want the window plus twice MaxSkew, 2.2 s", ttl)
	}
	time.Sleep(300 * time.Millisecond)
	clock.Store(c + 10)
	d, err := l.Allow(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := outcomeOf(d), (outcome{Quota: req.Quotas[0], Count: 1, RetryAfter: 190 * time.Millisecond, At: c + 10}); got != want {
		t.Errorf("B: got %v, want %v", got, want)
	}
}
