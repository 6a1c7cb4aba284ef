package worker_test

import (
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestNew_redisVersion: with a rule, New refuses a limiter whose Redis says it is 6.2.14
// (throttle.ErrRedisVersion: the script would fail on every reservation), and takes the
// test's Redis 7.0 and a Redis 6 without any rule (nothing to decide).
func TestNew_redisVersion(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	old := redis.NewClient(rdb.Options())
	t.Cleanup(func() { _ = old.Close() })
	old.AddHook(redistest.ReportVersion("6.2.14"))
	rules := mustRules(t, "api:call tenant=5/1s")
	_, err := worker.New(newLimiter(t, old), worker.Config{Rules: rules, Redis: rdb})
	const want = "worker: throttle: Redis too old for the limiter: the server runs Redis 6.2.14; the script needs 7.0 or later (ZADD GT, PEXPIRE NX and GT)"
	if !errors.Is(err, throttle.ErrRedisVersion) || err.Error() != want {
		t.Errorf("New on Redis 6.2.14: %v; want %q", err, want)
	}
	if _, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: rules, Redis: rdb}); err != nil {
		t.Errorf("New on Redis 7.0: %v", err)
	}
	if _, err := worker.New(newLimiter(t, old), worker.Config{Redis: rdb}); err != nil {
		t.Errorf("New on Redis 6.2.14 without rules: %v", err)
	}
}
