package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func newLimiter(t *testing.T) *throttle.Limiter {
	t.Helper()
	l, err := throttle.New(redistest.Start(t), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func ms(n int64) time.Time { return time.UnixMilli(n) }

func TestLimiter_AllowAt_boundaryInstant(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	ctx := context.Background()
	req := throttle.Request{
		Key:    throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quotas: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Second}}},
	}
	steps := []struct {
		at        int64
		allowed   bool
		retryMS   int64
		remaining int
	}{
		{at: 1000, allowed: true, remaining: 0},
		{at: 1999, allowed: false, retryMS: 1, remaining: 0},
		{at: 2000, allowed: true, remaining: 0},
	}
	for _, s := range steps {
		d, err := l.AllowAt(ctx, req, ms(s.at))
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed != s.allowed || d.RetryAfter != time.Duration(s.retryMS)*time.Millisecond || d.Remaining != s.remaining {
			t.Errorf("t=%d: got allowed=%v retry=%v remaining=%d, want %v %vms %d", s.at, d.Allowed, d.RetryAfter, d.Remaining, s.allowed, s.retryMS, s.remaining)
		}
		if !d.At.Equal(ms(s.at)) {
			t.Errorf("t=%d: At = %v", s.at, d.At)
		}
	}
}
