package throttle_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestMaxInWindow(t *testing.T) {
	t.Parallel()
	at := func(ms ...int64) []time.Time {
		ts := make([]time.Time, len(ms))
		for i, m := range ms {
			ts[i] = time.UnixMilli(m)
		}
		return ts
	}
	tests := []struct {
		name string
		ts   []time.Time
		w    time.Duration
		want int
	}{
		{"None", nil, time.Second, 0},
		{"One", at(5), time.Second, 1},
		{"BoundaryInstantInOneWindowOnly", at(1000, 2000), time.Second, 1}, // (1000, 2000] excludes 1000
		{"OneMsInside", at(1000, 1999), time.Second, 2},
		{"Unsorted", at(3000, 1000, 2999, 2000, 1001), time.Second, 2},
		{"SameInstant", at(7, 7, 7), time.Millisecond, 3},
		{"Burst", at(0, 1, 2, 500, 998, 999, 1000, 1001), time.Second, 6}, // (0, 1000] or (1, 1001]
		{"WiderWindowReachesBack", at(0, 100, 999, 1000, 1999, 2000, 2000), 1001 * time.Millisecond, 4},
		{"TinyWindow", at(0, 1, 2), time.Millisecond, 1},
	}
	for _, tc := range tests {
		if got := throttle.MaxInWindow(tc.ts, tc.w); got != tc.want {
			t.Errorf("%s: MaxInWindow = %d, want %d", tc.name, got, tc.want)
		}
	}
}

func ExampleMaxInWindow() {
	starts := []time.Time{time.UnixMilli(0), time.UnixMilli(400), time.UnixMilli(1000), time.UnixMilli(1300)}
	fmt.Println(throttle.MaxInWindow(starts, time.Second))
	// Output: 3
}
