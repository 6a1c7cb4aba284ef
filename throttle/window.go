package throttle

import (
	"slices"
	"time"
)

// MaxInWindow returns the most of the instants ts that fall in any one sliding window
// (t-w, t], the window of the limiter's contract (an entry scored s counts at t iff
// s > t-w). Admissions under a Limit never exceed Limit.Events by this measure, whatever
// t: use it to check a log of admission or handler-start instants. ts may be in any
// order and is not modified; it returns 0 for no instants.
func MaxInWindow(ts []time.Time, w time.Duration) int {
	s := slices.SortedFunc(slices.Values(ts), time.Time.Compare)
	most, first := 0, 0
	for last := range s { // the maximum is reached with t at one of the instants
		for !s[first].After(s[last].Add(-w)) {
			first++
		}
		most = max(most, last-first+1)
	}
	return most
}
