package worker

import (
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestMayWait: with reservations, a task coming back for its reservation may wait in its
// handler (within MaxWait, checked by sleep), and a newcomer only up to NewcomerWait;
// without reservations any wait within MaxWait may.
func TestMayWait(t *testing.T) {
	t.Parallel()
	tests := []struct {
		reserve bool
		held    bool
		wait    time.Duration
		want    bool
	}{
		{reserve: true, held: true, wait: 2 * time.Second, want: true},
		{reserve: true, held: false, wait: NewcomerWait, want: true},
		{reserve: true, held: false, wait: NewcomerWait + time.Millisecond, want: false},
		{reserve: true, held: false, wait: time.Millisecond, want: true},
		{reserve: false, held: false, wait: 2 * time.Second, want: true},
	}
	for _, tc := range tests {
		m := &middleware{reserve: tc.reserve}
		if got := m.mayWait(throttle.Decision{Held: tc.held, RetryAfter: tc.wait}); got != tc.want {
			t.Errorf("reserve=%v held=%v wait=%v: mayWait = %v, want %v", tc.reserve, tc.held, tc.wait, got, tc.want)
		}
	}
}
