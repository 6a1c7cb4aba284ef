package worker

import (
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestRetryDelay checks RetryDelayFunc's rule at explicit instants: a denial waits until
// its RetryAt rounded up to a whole second, so now+delay is a whole second (asynq stores
// the retry time as truncated whole seconds) and never before RetryAt.
func TestRetryDelay(t *testing.T) {
	t.Parallel()
	at := func(sec, ms int) time.Time {
		return time.Date(2026, 3, 4, 10, 0, sec, ms*int(time.Millisecond), time.UTC)
	}
	denied := func(retryAt time.Time) error {
		return &throttle.DeniedError{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"},
			Quota: throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)}, RetryAt: retryAt}
	}
	tests := []struct {
		name    string
		now     time.Time
		err     error
		want    time.Duration
		wantOK  bool
		landsOn time.Time // now+want, if set
	}{
		{name: "DeniedMidSecond", now: at(0, 0), err: denied(at(1, 200)), want: 2 * time.Second, wantOK: true, landsOn: at(2, 0)},
		{name: "DeniedOnWholeSecond", now: at(0, 0), err: denied(at(2, 0)), want: 2 * time.Second, wantOK: true, landsOn: at(2, 0)},
		{name: "DeniedNowMidSecond", now: at(0, 700), err: denied(at(1, 200)), want: 1300 * time.Millisecond, wantOK: true, landsOn: at(2, 0)},
		{name: "DeniedOneMsAfterSecond", now: at(0, 0), err: denied(at(2, 1)), want: 3 * time.Second, wantOK: true, landsOn: at(3, 0)},
		{name: "DeniedInThePast", now: at(5, 0), err: denied(at(1, 200)), want: 0, wantOK: true},
		{name: "DeniedAtNowWhole", now: at(5, 0), err: denied(at(5, 0)), want: 0, wantOK: true},
		{name: "DeniedSameSecondAsNow", now: at(5, 100), err: denied(at(5, 50)), want: 900 * time.Millisecond, wantOK: true, landsOn: at(6, 0)},
		{name: "DeniedWrapped", now: at(0, 0), err: fmt.Errorf("process task: %w", denied(at(1, 200))), want: 2 * time.Second, wantOK: true},
		{name: "DeniedDeferred", now: at(0, 0), err: fmt.Errorf("%w; deferred: %w", denied(at(1, 200)), asynq.RevokeTask), want: 2 * time.Second, wantOK: true},
		{name: "Backpressure", now: at(0, 300), err: fmt.Errorf("call the API: %w", &BackpressureError{StatusCode: 429, RetryAfter: 3 * time.Second,
			RetryAt: at(3, 300)}), want: 3700 * time.Millisecond, wantOK: true, landsOn: at(4, 0)},
		{name: "BackpressureOnWholeSecond", now: at(0, 0), err: &BackpressureError{StatusCode: 503, RetryAt: at(3, 0)}, want: 3 * time.Second,
			wantOK: true, landsOn: at(3, 0)},
		{name: "Unavailable", now: at(0, 0), err: fmt.Errorf("%w: %w", ErrUnavailable, io.EOF), want: UnavailableRetryDelay, wantOK: true},
		{name: "Other", now: at(0, 0), err: errors.New("boom"), want: 0, wantOK: false},
		{name: "ErrDeniedWithoutDetails", now: at(0, 0), err: throttle.ErrDenied, want: 0, wantOK: false},
		{name: "Nil", now: at(0, 0), err: nil, want: 0, wantOK: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := retryDelay(tc.now, tc.err)
			if got != tc.want || ok != tc.wantOK {
				t.Errorf("retryDelay(%s, %v) = %s, %v; want %s, %v", tc.now.Format("15:04:05.000"), tc.err, got, ok, tc.want, tc.wantOK)
			}
			if !tc.landsOn.IsZero() && !tc.now.Add(got).Equal(tc.landsOn) {
				t.Errorf("now+delay = %s, want %s", tc.now.Add(got).Format("15:04:05.000"), tc.landsOn.Format("15:04:05.000"))
			}
			if tc.landsOn.IsZero() {
				return
			}
			// The instant asynq stores (whole Unix seconds, truncated) is not before RetryAt.
			var d *throttle.DeniedError
			if errors.As(tc.err, &d) && time.Unix(tc.now.Add(got).Unix(), 0).Before(d.RetryAt) {
				t.Errorf("stored retry time %s is before RetryAt %s", time.Unix(tc.now.Add(got).Unix(), 0).UTC(), d.RetryAt)
			}
		})
	}
}
