package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The embedded backend must run the limiter's script (its fast path and its general path:
// reservations, claims, weighted entries, releases) exactly as redis-server does: same
// decisions, same retry-after, same TTLs, at explicit times.
func TestOpenBackend_embeddedRunsLimiterLikeRedis(t *testing.T) {
	setRedisEnv(t, "")
	be, err := openBackend()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(be.close)
	real := redistest.Start(t)

	quotas := []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 2, Window: 1100 * time.Millisecond}},
		{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 3, Window: 2 * time.Second}},
	}
	type step struct {
		ms                int64
		token             string // a reservation; "release:<token>" releases it
		cost              int
		claimWait         time.Duration
		allowed, reserved bool
		count, remaining  int
		retryMS, atMS     int64
		tenantTTL         time.Duration // PTTL of the tenant log after the step, at most
	}
	// Times are ms after base, a recent instant, so the TTLs set by PEXPIRE are real.
	want := []step{
		{ms: 0, allowed: true, count: 1, remaining: 1, tenantTTL: 1100 * time.Millisecond},
		{ms: 10, allowed: true, count: 2, remaining: 0, atMS: 10, tenantTTL: 1100 * time.Millisecond},
		{ms: 20, count: 2, retryMS: 1080, atMS: 20},                   // tenant full until 0+1100; nothing written
		{ms: 1100, allowed: true, count: 2, remaining: 0, atMS: 1100}, // (0, 1100]: the entry at 0 is out
		{ms: 1200, count: 3, retryMS: 800, atMS: 1200},                // the type quota binds: 0+2000-1200
		// A reservation: the first instant both quotas have room is 2000, when the entry at 0
		// leaves the type window (the tenant's holds only 1100 then); claimed 90ms ahead.
		{ms: 1210, token: "T1", count: 3, reserved: true, retryMS: 790, atMS: 1210},
		{ms: 1910, token: "T1", claimWait: 300 * time.Millisecond, allowed: true, count: 2, remaining: 0, atMS: 2000},
		// A weighted event (cost 2): both of the tenant's entries (1100, 2000) must leave: 3100.
		// Its reservation is given up; at 3210 it fits at once.
		{ms: 2110, token: "T2", cost: 2, count: 2, reserved: true, retryMS: 990, atMS: 2110},
		{ms: 2120, token: "release:T2"},
		{ms: 3210, cost: 2, allowed: true, count: 2, remaining: 0, atMS: 3210},
	}
	base := time.Now().Truncate(time.Millisecond)
	for name, rdb := range map[string]redis.UniversalClient{"miniredis": be.rdb, "redis-server": real} {
		lim, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		for _, w := range want {
			if tok, ok := strings.CutPrefix(w.token, "release:"); ok {
				if held, err := lim.Release(ctx, taskType, tok); err != nil || !held {
					t.Fatalf("%s t=%dms: Release(%s) = %v, %v", name, w.ms, tok, held, err)
				}
				continue
			}
			req := throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: "acme"}, Quotas: quotas,
				Cost: w.cost, Reservation: w.token, ClaimWait: w.claimWait}
			d, err := lim.AllowAt(ctx, req, base.Add(time.Duration(w.ms)*time.Millisecond))
			if err != nil {
				t.Fatalf("%s t=%dms: %v", name, w.ms, err)
			}
			got := step{w.ms, w.token, w.cost, w.claimWait, d.Allowed, d.Reserved, d.Count, d.Remaining,
				d.RetryAfter.Milliseconds(), d.At.Sub(base).Milliseconds(), w.tenantTTL}
			if got != w {
				t.Errorf("%s t=%dms: got %+v, want %+v", name, w.ms, got, w)
			}
			if w.tenantTTL == 0 {
				continue
			}
			// PEXPIRE sets the TTL relative to the server's clock: (0, window + lead].
			lead := time.Until(base.Add(time.Duration(w.ms) * time.Millisecond))
			ttl := rdb.PTTL(ctx, lim.RedisKey(req.Key, throttle.ScopeTenant)).Val()
			if limit := w.tenantTTL + max(lead, 0); ttl <= 0 || ttl > limit+time.Millisecond {
				t.Errorf("%s t=%dms: tenant log TTL %s, want in (0, %s]", name, w.ms, ttl, limit)
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
