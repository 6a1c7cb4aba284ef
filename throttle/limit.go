package throttle

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Limit is the most events admitted in any sliding window of length Window.
type Limit struct {
	Events int           // events admitted per window; must be >= 1
	Window time.Duration // sliding window length; a whole number of milliseconds >= 1ms
}

// PerSecond returns a Limit of n events per second.
func PerSecond(n int) Limit { return Limit{Events: n, Window: time.Second} }

// PerMinute returns a Limit of n events per minute.
func PerMinute(n int) Limit { return Limit{Events: n, Window: time.Minute} }

// PerHour returns a Limit of n events per hour.
func PerHour(n int) Limit { return Limit{Events: n, Window: time.Hour} }

// String formats l as "events/window", the form ParseLimit reads, with the window as a Go
// duration without zero units: PerMinute(100) is "100/1m", Limit{5, 2*time.Second} "5/2s".
// The zero Limit is "none".
func (l Limit) String() string {
	if l == (Limit{}) {
		return "none"
	}
	return strconv.Itoa(l.Events) + "/" + formatDuration(l.Window)
}

// formatDuration prints d as time.Duration.String does, without the zero units that it
// appends ("1m0s" becomes "1m", "1h0m0s" becomes "1h").
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// Validate returns an error unless 1 <= Events < 2^42 and Window is a whole number of
// milliseconds from 1ms to under 2^42 ms (about 139 years): the script counts in integer
// milliseconds, and keeps instants and counts exact in a Lua double, its scores below
// 2^53.
func (l Limit) Validate() error {
	if err := l.check(); err != nil {
		return fmt.Errorf("throttle: limit %s: %w", l, err)
	}
	return nil
}

func (l Limit) check() error {
	switch {
	case l.Events < 1:
		return fmt.Errorf("events must be at least 1, got %d", l.Events)
	case l.Window < time.Millisecond:
		return fmt.Errorf("window must be at least 1ms, got %s", l.Window)
	case l.Window%time.Millisecond != 0:
		return fmt.Errorf("window %s is not a whole number of milliseconds", l.Window)
	case l.Events >= maxMS:
		return fmt.Errorf("events must be less than 2^42 (%d), got %d", maxMS, l.Events)
	case l.Window.Milliseconds() >= maxMS:
		return fmt.Errorf("window must be shorter than 2^42 ms (about 139 years), got %s", l.Window)
	}
	return nil
}

// durationForm is the syntax time.ParseDuration reads (unsigned): numbers with a unit
// each. A window of that form that it refuses overflowed a time.Duration.
var durationForm = regexp.MustCompile(`^(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+$`)

// ParseLimit reads "events/window", e.g. "5/2s", "100/1h" or "10/1m30s": a positive
// integer, a slash, and a Go duration (time.ParseDuration) of at least 1ms. Surrounding
// spaces are ignored. The error quotes s and says which part is wrong.
func ParseLimit(s string) (Limit, error) {
	events, window, ok := strings.Cut(strings.TrimSpace(s), "/")
	if !ok {
		return Limit{}, fmt.Errorf("throttle: limit %q: want events/window, e.g. 5/2s", s)
	}
	n, err := strconv.Atoi(strings.TrimSpace(events))
	if errors.Is(err, strconv.ErrRange) {
		return Limit{}, fmt.Errorf("throttle: limit %q: events %q is too large (less than 2^42, %d)", s, events, maxMS)
	}
	if err != nil {
		return Limit{}, fmt.Errorf("throttle: limit %q: events %q is not an integer", s, events)
	}
	d, err := time.ParseDuration(strings.TrimSpace(window))
	if err != nil && durationForm.MatchString(strings.TrimSpace(window)) {
		// A well-formed duration that time.Duration (int64 ns, about 292 years) cannot hold.
		return Limit{}, fmt.Errorf("throttle: limit %q: window %q is too long: it must be shorter than 2^42 ms (about 139 years)", s, window)
	}
	if err != nil {
		return Limit{}, fmt.Errorf("throttle: limit %q: window %q is not a Go duration such as 2s, 1m or 1h", s, window)
	}
	l := Limit{Events: n, Window: d}
	if err := l.check(); err != nil {
		return Limit{}, fmt.Errorf("throttle: limit %q: %w", s, err)
	}
	return l, nil
}
