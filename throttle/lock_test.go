package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestLimiter_TryLock: the first call takes the lock, every call until its TTL ends is
// refused, and then the lock can be taken again. The lock is one key per (task type,
// name), after the type's hash tag, and lasts exactly the TTL asked for.
func TestLimiter_TryLock(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{Prefix: "app"})
	ctx := context.Background()
	tryLock := func(taskType, name string, ttl time.Duration) bool {
		t.Helper()
		ok, err := l.TryLock(ctx, taskType, name, ttl)
		if err != nil {
			t.Fatalf("TryLock(%q, %q, %s): %v", taskType, name, ttl, err)
		}
		return ok
	}

	if !tryLock("mail send/x", "sweep", time.Hour) {
		t.Fatal("first TryLock = false, want true")
	}
	const key = "app:{mail%20send%2Fx}:lock:sweep"
	if v, err := rdb.Get(ctx, key).Result(); err != nil || v != "1" {
		t.Errorf("GET %s = %q, %v; want \"1\"", key, v, err)
	}
	if pttl, err := rdb.PTTL(ctx, key).Result(); err != nil || pttl <= 59*time.Minute || pttl > time.Hour {
		t.Errorf("PTTL %s = %s, %v; want just under 1h", key, pttl, err)
	}
	if tryLock("mail send/x", "sweep", time.Hour) {
		t.Error("second TryLock = true while the first lock lasts, want false")
	}
	if pttl, err := rdb.PTTL(ctx, key).Result(); err != nil || pttl <= 59*time.Minute {
		t.Errorf("PTTL %s after a refused TryLock = %s, %v; want the first lock's, untouched", key, pttl, err)
	}
	// Another name, another task type: other locks.
	if !tryLock("mail send/x", "other", time.Hour) || !tryLock("mail", "sweep", time.Hour) {
		t.Error("TryLock of another name or task type = false, want true")
	}

	// A short lock: refused while it lasts, taken again once its TTL has passed.
	if !tryLock("short", "sweep", 100*time.Millisecond) {
		t.Fatal("TryLock(short) = false, want true")
	}
	if pttl, err := rdb.PTTL(ctx, "app:{short}:lock:sweep").Result(); err != nil || pttl <= 0 || pttl > 100*time.Millisecond {
		t.Errorf("PTTL of the short lock = %s, %v; want in (0, 100ms]", pttl, err)
	}
	if tryLock("short", "sweep", 100*time.Millisecond) {
		t.Error("TryLock(short) again at once = true, want false")
	}
	deadline := time.Now().Add(5 * time.Second)
	for !tryLock("short", "sweep", 100*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the 100ms lock could not be taken again within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLimiter_TryLock_invalid: an empty task type or name, or a TTL under 1ms, is
// ErrInvalid, returned before any Redis command (the client here is closed: a command
// would fail with redis.ErrClosed).
func TestLimiter_TryLock_invalid(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	_ = rdb.Close()
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, taskType, lock string
		ttl                  time.Duration
	}{
		{"EmptyType", "", "sweep", time.Second},
		{"EmptyName", "api:call", "", time.Second},
		{"ZeroTTL", "api:call", "sweep", 0},
		{"NegativeTTL", "api:call", "sweep", -time.Second},
		{"SubMillisecondTTL", "api:call", "sweep", 999 * time.Microsecond},
	} {
		ok, err := l.TryLock(context.Background(), c.taskType, c.lock, c.ttl)
		if ok || !errors.Is(err, throttle.ErrInvalid) {
			t.Errorf("%s: TryLock(%q, %q, %s) = %v, %v; want false, ErrInvalid", c.name, c.taskType, c.lock, c.ttl, ok, err)
		}
	}
	// A valid call does send its command, and the error is the client's.
	ok, err := l.TryLock(context.Background(), "api:call", "sweep", time.Millisecond)
	if ok || !errors.Is(err, redis.ErrClosed) || errors.Is(err, throttle.ErrInvalid) {
		t.Errorf("TryLock on a closed client = %v, %v; want false, redis.ErrClosed", ok, err)
	}
}
