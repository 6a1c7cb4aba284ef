package throttle

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
)

// TryLock takes the lock name of taskType for ttl and reports whether it did: false while
// a lock taken earlier, by this process or another, still lasts. There is no unlock: the
// lock ends ttl (truncated to the millisecond) after it was taken, so it suits work that
// one of several processes should do at most once per ttl, such as package worker's sweep.
// The lock is the key "<prefix>:{<task type>}:lock:<name>" (SET NX PX), in the slot of
// every other key of the type. The error is ErrInvalid, before any Redis command, for an
// empty task type or name or a ttl under 1ms; else Redis's.
func (l *Limiter) TryLock(ctx context.Context, taskType, name string, ttl time.Duration) (bool, error) {
	if taskType == "" || name == "" || ttl < time.Millisecond {
		return false, fmt.Errorf("%w: lock %q of %s: needs a task type, a name and a ttl of at least 1ms, got %s",
			ErrInvalid, name, quote.Quote(taskType), ttl)
	}
	key := keyBase(l.prefix, taskType) + "lock:" + name
	err := l.rdb.Do(ctx, "SET", key, "1", "NX", "PX", ttl.Milliseconds()).Err()
	switch {
	case errors.Is(err, redis.Nil):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("throttle: lock %q of %s: %w", name, quote.Name(taskType), err)
	}
	return true, nil
}
