package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestDecision_RetryAt: RetryAt is At when allowed (also for an admission ahead, At being
// its slot), else the caller's clock at the call plus RetryAfter. v1 had RetryAt = At +
// RetryAfter always; v2's At can be later than the caller's clock (the logs' high-water
// instant), and RetryAfter counts from the caller's clock, so a caller behind must add it
// to its own clock, not to At.
func TestDecision_RetryAt(t *testing.T) {
	t.Parallel()
	if got := (throttle.Decision{Allowed: true, At: ms(1000)}).RetryAt(); !got.Equal(ms(1000)) {
		t.Errorf("an admission at 1000: RetryAt() = %d ms, want 1000", got.UnixMilli())
	}
	if got := (throttle.Decision{Allowed: true, At: ms(1300), Delay: msd(300)}).RetryAt(); !got.Equal(ms(1300)) {
		t.Errorf("an admission for 1300: RetryAt() = %d ms, want 1300", got.UnixMilli())
	}

	l := newLimiter(t)
	q := tenantQuota(1, time.Second)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	steps := []struct {
		name    string
		req     throttle.Request
		at      int64
		want    outcome
		retryAt int64
	}{
		{"Admitted", req, 5000, outcome{Allowed: true, Quota: q, Count: 1, At: 5000}, 5000},
		{"DeniedOnItsClock", req, 5300, outcome{Quota: q, Count: 1, RetryAfter: msd(700), At: 5300}, 6000},
		// Decided at the high-water 5000; RetryAfter counts from 1000: RetryAt is 6000,
		// not At + RetryAfter = 10000.
		{"DeniedBehindHighWater", req, 1000, outcome{Quota: q, Count: 1, RetryAfter: msd(5000), At: 5000}, 6000},
		{"AdmittedAhead", throttle.Request{Key: req.Key, Quotas: req.Quotas, MaxWait: time.Second}, 5400,
			outcome{Allowed: true, Quota: q, Count: 1, Delay: msd(600), At: 6000}, 6000},
		// Behind the high-water 5400 and the slot at 6000 taken: RetryAfter from 5100.
		{"DeniedBehindAfterAhead", req, 5100, outcome{Quota: q, Count: 1, RetryAfter: msd(7000 - 5100), At: 5400}, 7000},
	}
	for _, s := range steps {
		d := wantOutcome(t, l, s.req, s.at, s.want)
		if got := d.RetryAt().UnixMilli(); got != s.retryAt {
			t.Errorf("%s: RetryAt() = %d ms, want %d", s.name, got, s.retryAt)
		}
	}

	// With the server's clock, RetryAt counts from the server's TIME at the call.
	t.Run("ClockRedis", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		lr, err := throttle.New(rdb, throttle.Config{Clock: throttle.ClockRedis})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		first, err := lr.Allow(ctx, req)
		if err != nil || !first.Allowed {
			t.Fatalf("first: %+v, %v", first, err)
		}
		d, err := lr.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed || !d.RetryAt().Equal(d.ServerTime.Add(d.RetryAfter)) || !d.RetryAt().Equal(first.At.Add(time.Second)) {
			t.Errorf("second: %s, ServerTime %v, RetryAt %v; want a denial until %v", outcomeOf(d), d.ServerTime, d.RetryAt(), first.At.Add(time.Second))
		}
		if d.Skew() != 0 {
			t.Errorf("Skew() = %v with ClockRedis, want 0", d.Skew())
		}
	})
	// A clock too far ahead falls back to the server's: RetryAt counts from ServerTime
	// too, not from the clock that was not used.
	t.Run("SkewFallback", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		lf, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return time.Now().Add(time.Hour) }})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		first, err := lf.Allow(ctx, req)
		if err != nil || !first.Allowed || !first.SkewFallback {
			t.Fatalf("first: %+v, %v", first, err)
		}
		d, err := lf.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed || !d.SkewFallback || !d.RetryAt().Equal(first.At.Add(time.Second)) {
			t.Errorf("second: %s, SkewFallback %v, RetryAt %v; want a denial until %v", outcomeOf(d), d.SkewFallback, d.RetryAt(), first.At.Add(time.Second))
		}
	})
	// AllowAt does not read the server's TIME: ServerTime is zero, and so is Skew.
	t.Run("AllowAtNoServerTime", func(t *testing.T) {
		t.Parallel()
		la := newLimiter(t)
		d := mustAdmit(t, la, req, 1000)
		if !d.ServerTime.IsZero() || d.Skew() != 0 || d.SkewFallback {
			t.Errorf("AllowAt: ServerTime %v, Skew %v, SkewFallback %v; want zero, 0, false", d.ServerTime, d.Skew(), d.SkewFallback)
		}
	})
}

func TestDeniedError(t *testing.T) {
	t.Parallel()
	denied := &throttle.DeniedError{
		Key:        throttle.Key{TaskType: "email:send", Tenant: "acme"},
		Quota:      throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.PerMinute(100)},
		RetryAfter: 1500 * time.Millisecond,
		RetryAt:    ms(2500),
	}
	if got, want := denied.Error(), `throttle: email:send for tenant "acme" over tenant=100/1m, retry after 1.5s`; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	err := fmt.Errorf("process task: %w", denied)
	if !errors.Is(err, throttle.ErrDenied) {
		t.Errorf("errors.Is(%v, ErrDenied) = false", err)
	}
	var got *throttle.DeniedError
	if !errors.As(err, &got) || got != denied {
		t.Errorf("errors.As(%v) = %v, want the DeniedError", err, got)
	}
	for _, other := range []error{throttle.ErrInvalid, throttle.ErrCostOverLimit, errors.New("throttle: denied")} {
		if errors.Is(err, other) {
			t.Errorf("errors.Is(%v, %v) = true", err, other)
		}
		if errors.Is(other, throttle.ErrDenied) {
			t.Errorf("errors.Is(%v, ErrDenied) = true", other)
		}
	}
	// ErrCostOverLimit is also ErrInvalid, not the other way round.
	if _, err := newLimiter(t).AllowAt(context.Background(), throttle.Request{Key: denied.Key, Quotas: []throttle.Quota{tenantQuota(1, time.Second)}, Cost: 2}, ms(0)); !errors.Is(err, throttle.ErrCostOverLimit) || !errors.Is(err, throttle.ErrInvalid) || errors.Is(err, throttle.ErrDenied) {
		t.Errorf("cost over limit: %v, want ErrCostOverLimit and ErrInvalid, not ErrDenied", err)
	}
	if errors.Is(throttle.ErrInvalid, throttle.ErrCostOverLimit) {
		t.Error("errors.Is(ErrInvalid, ErrCostOverLimit) = true")
	}
}

// TestDeniedError_Error: the tenant is quoted and cut to 64 bytes, the task type cut and
// quoted only when it needs it; a paused quota is said to be paused, not full.
func TestDeniedError_Error(t *testing.T) {
	t.Parallel()
	tests := []struct {
		key    throttle.Key
		paused bool
		want   string
	}{
		{throttle.Key{TaskType: "api:call", Tenant: "acme"}, true, `throttle: api:call for tenant "acme" paused on tenant=5/1s, retry after 1.5s`},
		{throttle.Key{TaskType: "api:call", Tenant: "acme"}, false, `throttle: api:call for tenant "acme" over tenant=5/1s, retry after 1.5s`},
		{throttle.Key{TaskType: "api:call", Tenant: "evil\nline"}, false, `throttle: api:call for tenant "evil\nline" over tenant=5/1s, retry after 1.5s`},
		{throttle.Key{TaskType: "two words", Tenant: strings.Repeat("y", 5000)}, false,
			`throttle: "two words" for tenant "` + strings.Repeat("y", 64) + `"...(5000 bytes) over tenant=5/1s, retry after 1.5s`},
	}
	for _, tc := range tests {
		e := &throttle.DeniedError{Key: tc.key, Quota: tenantQuota(5, time.Second), RetryAfter: 1500 * time.Millisecond, Paused: tc.paused}
		if got := e.Error(); got != tc.want {
			t.Errorf("Error() = %s\nwant      %s", got, tc.want)
		}
	}
}
