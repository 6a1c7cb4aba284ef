package throttle_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestDecision_RetryAt(t *testing.T) {
	t.Parallel()
	tests := []struct {
		d       throttle.Decision
		retryAt time.Time
	}{
		{throttle.Decision{Allowed: true, At: ms(1000)}, ms(1000)},
		{throttle.Decision{RetryAfter: msd(700), At: ms(400)}, ms(1100)},
		{throttle.Decision{RetryAfter: msd(1), At: ms(1999)}, ms(2000)},
	}
	for _, tc := range tests {
		if got := tc.d.RetryAt(); !got.Equal(tc.retryAt) {
			t.Errorf("%+v: RetryAt() = %d ms, want %d", tc.d, got.UnixMilli(), tc.retryAt.UnixMilli())
		}
	}
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
}
