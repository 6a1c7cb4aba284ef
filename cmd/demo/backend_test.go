package main

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The embedded backend must run the limiter's script (TIME, ZSCORE, ZCOUNT,
// ZRANGEBYSCORE ... LIMIT, ZREMRANGEBYSCORE, ZADD, ZRANGE WITHSCORES, PEXPIRE) exactly as
// redis-server does: same decisions, same retry-after, same TTLs, at explicit times.
func TestOpenBackend_embeddedRunsLimiterLikeRedis(t *testing.T) {
	setRedisEnv(t, "")
	be, err := openBackend()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(be.close)
	real := redistest.Start(t)

	req := throttle.Request{
		Key: throttle.Key{TaskType: taskType, Tenant: "acme"},
		Quotas: []throttle.Quota{
			{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 2, Window: 1100 * time.Millisecond}},
			{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 3, Window: 2 * time.Second}},
		},
	}
	type step struct {
		ms                 int64
		allowed            bool
		count, remaining   int
		retryMS, resetMS   int64
		tenantTTL, typeTTL time.Duration // PTTL of the logs after the step
	}
	// Times are ms after base, a recent instant, so the TTLs set by PEXPIRE are real.
	// reset is until every log is empty: the newest entry plus the longest window.
	want := []step{
		{0, true, 1, 1, 0, 2000, 1100 * time.Millisecond, 2 * time.Second},
		{10, true, 2, 0, 0, 2000, 1100 * time.Millisecond, 2 * time.Second},
		{20, false, 2, 0, 1080, 1990, 1100 * time.Millisecond, 2 * time.Second},  // tenant full until 0+1100; nothing written
		{1100, true, 2, 0, 0, 2000, 1100 * time.Millisecond, 2 * time.Second},    // (0, 1100]: the entry at 0 is out
		{1200, false, 3, 0, 800, 1900, 1100 * time.Millisecond, 2 * time.Second}, // type quota binds: 0+2000-1200
		{2010, true, 2, 0, 0, 2000, 1100 * time.Millisecond, 2 * time.Second},
	}
	base := time.Now().Truncate(time.Millisecond)
	for name, rdb := range map[string]redis.UniversalClient{"miniredis": be.rdb, "redis-server": real} {
		lim, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		for _, w := range want {
			d, err := lim.AllowAt(ctx, req, base.Add(time.Duration(w.ms)*time.Millisecond))
			if err != nil {
				t.Fatalf("%s t=%dms: %v", name, w.ms, err)
			}
			got := step{w.ms, d.Allowed, d.Count, d.Remaining, d.RetryAfter.Milliseconds(), d.ResetAfter.Milliseconds(), w.tenantTTL, w.typeTTL}
			if got != w {
				t.Errorf("%s t=%dms: got %+v, want %+v", name, w.ms, got, w)
			}
			// PEXPIRE sets the TTL relative to the server's clock: (0, window + grace +
			// lead], the grace (2 x MaxSkew) keeping entries for callers whose clock is behind.
			const grace = 2 * throttle.DefaultMaxSkew
			for _, k := range []struct {
				scope throttle.Scope
				max   time.Duration
			}{{throttle.ScopeTenant, w.tenantTTL}, {throttle.ScopeType, w.typeTTL}} {
				lead := time.Until(base.Add(time.Duration(w.ms) * time.Millisecond))
				ttl := rdb.PTTL(ctx, lim.RedisKey(req.Key, k.scope)).Val()
				if limit := k.max + grace + max(lead, 0); ttl <= 0 || ttl > limit+time.Millisecond {
					t.Errorf("%s t=%dms: %s log TTL %s, want in (0, %s]", name, w.ms, k.scope, ttl, limit)
				}
			}
		}
	}
}

// miniredis only ages TTLs when told to; the embedded backend has it follow the wall
// clock, so the limiter's logs expire as on a real Redis.
func TestOpenBackend_embeddedExpiresKeys(t *testing.T) {
	setRedisEnv(t, "")
	be, err := openBackend()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(be.close)
	lim, err := throttle.New(be.rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	key := throttle.Key{TaskType: taskType, Tenant: "acme"}
	ctx := context.Background()
	if _, err := lim.Allow(ctx, throttle.Request{Key: key, Quotas: []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: 20 * time.Millisecond}}}}); err != nil {
		t.Fatal(err)
	}
	rk := lim.RedisKey(key, throttle.ScopeTenant)
	for deadline := time.Now().Add(5 * time.Second); be.rdb.Exists(ctx, rk).Val() == 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s still exists 5s after a PEXPIRE of 20ms", rk)
		}
	}
}
