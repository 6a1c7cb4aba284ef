package main

import (
	"context"
	"fmt"
	"os"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
)

// backend is the Redis a run uses, and how to let go of it.
type backend struct {
	rdb  redis.UniversalClient
	name string                          // for the report
	ping func(ctx context.Context) error // checks that rdb answers, saying what is wrong if not
	// embedded is true for the in-process miniredis, which has no maxmemory-policy for
	// the worker to check (it has no CONFIG).
	embedded bool
	close    func()
}

// openBackend connects to the Redis of the REDIS_* variables (redisenv) if REDIS_ADDR is
// set and not empty, and otherwise starts an embedded miniredis on a free loopback port.
//
// miniredis only ages TTLs when told to; with ClockTTL it ages them by the wall clock on
// every command, as a real Redis does, so the limiter's PEXPIREd logs and asynq's
// expiring keys go away on time.
func openBackend() (*backend, error) {
	if os.Getenv("REDIS_ADDR") != "" {
		cfg, err := redisenv.Load()
		if err != nil {
			return nil, err
		}
		rdb := cfg.NewClient()
		name := "Redis " + cfg.Addr
		if cfg.MasterName != "" {
			name = fmt.Sprintf("Redis Sentinel master %q via %s", cfg.MasterName, cfg.Addr)
		}
		return &backend{rdb: rdb, name: name, close: func() { _ = rdb.Close() },
			ping: func(ctx context.Context) error { return cfg.Ping(ctx, rdb) }}, nil
	}
	m, err := miniredis.Run()
	if err != nil {
		return nil, fmt.Errorf("start embedded miniredis: %w", err)
	}
	m.ClockTTL(true)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	return &backend{
		rdb:      rdb,
		name:     "embedded miniredis " + m.Addr() + " (set REDIS_ADDR to use a real Redis)",
		ping:     func(ctx context.Context) error { return rdb.Ping(ctx).Err() },
		embedded: true,
		close: func() {
			_ = rdb.Close()
			m.Close()
		},
	}, nil
}
