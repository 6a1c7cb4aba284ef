package throttle_test

import (
	"context"
	"errors"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_CheckServer: the test's Redis 7.0 passes; one that says it is 6.2.14 gets an
// error matching ErrRedisVersion that names both versions; miniredis, whose INFO has no
// server section, is not refused.
func TestLimiter_CheckServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.CheckServer(ctx); err != nil {
		t.Errorf("Redis 7.0: %v, want nil", err)
	}

	old := redis.NewClient(rdb.Options())
	t.Cleanup(func() { _ = old.Close() })
	old.AddHook(redistest.ReportVersion("6.2.14"))
	lo, err := throttle.New(old, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	err = lo.CheckServer(ctx)
	const want = "throttle: Redis too old for the limiter: the server runs Redis 6.2.14; the script needs 7.0 or later (ZADD GT, PEXPIRE NX and GT)"
	if !errors.Is(err, throttle.ErrRedisVersion) || err.Error() != want {
		t.Errorf("Redis 6.2.14: %v, want %q (ErrRedisVersion)", err, want)
	}

	mr := miniredis.RunT(t)
	mc := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = mc.Close() })
	lm, err := throttle.New(mc, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := lm.CheckServer(ctx); err != nil {
		t.Errorf("miniredis: %v, want nil (no version to check)", err)
	}
}
