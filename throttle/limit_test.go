package throttle_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestLimit_String(t *testing.T) {
	t.Parallel()
	tests := []struct {
		limit throttle.Limit
		want  string
	}{
		{throttle.Limit{Events: 5, Window: 2 * time.Second}, "5/2s"},
		{throttle.PerSecond(10), "10/1s"},
		{throttle.PerMinute(100), "100/1m"},
		{throttle.PerHour(3), "3/1h"},
		{throttle.Limit{Events: 7, Window: 90 * time.Second}, "7/1m30s"},
		{throttle.Limit{Events: 4, Window: 90 * time.Minute}, "4/1h30m"},
		{throttle.Limit{Events: 1, Window: time.Hour + time.Second}, "1/1h0m1s"},
		{throttle.Limit{Events: 2, Window: 24 * time.Hour}, "2/24h"},
		{throttle.Limit{Events: 1, Window: 1500 * time.Millisecond}, "1/1.5s"},
		{throttle.Limit{Events: 2, Window: time.Millisecond}, "2/1ms"},
		{throttle.Limit{Events: 6, Window: 10 * time.Minute}, "6/10m"},
		{throttle.Limit{}, "none"},
	}
	for _, tc := range tests {
		if got := tc.limit.String(); got != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.limit, got, tc.want)
		}
	}
}

func TestPerSecondMinuteHour(t *testing.T) {
	t.Parallel()
	tests := []struct {
		got, want throttle.Limit
	}{
		{throttle.PerSecond(7), throttle.Limit{Events: 7, Window: time.Second}},
		{throttle.PerMinute(8), throttle.Limit{Events: 8, Window: time.Minute}},
		{throttle.PerHour(9), throttle.Limit{Events: 9, Window: time.Hour}},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("got %#v, want %#v", tc.got, tc.want)
		}
	}
}

func TestParseLimit(t *testing.T) {
	t.Parallel()
	good := []struct {
		in   string
		want throttle.Limit
	}{
		{"5/2s", throttle.Limit{Events: 5, Window: 2 * time.Second}},
		{"100/1h", throttle.PerHour(100)},
		{"100/1m", throttle.PerMinute(100)},
		{"10/1m30s", throttle.Limit{Events: 10, Window: 90 * time.Second}},
		{"1/1ms", throttle.Limit{Events: 1, Window: time.Millisecond}},
		{"3/1.5s", throttle.Limit{Events: 3, Window: 1500 * time.Millisecond}},
		{" 3 / 1h ", throttle.PerHour(3)},
		{"\t2/1s\n", throttle.PerSecond(2)},
	}
	for _, tc := range good {
		got, err := throttle.ParseLimit(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseLimit(%q) = %#v, %v; want %#v", tc.in, got, err, tc.want)
			continue
		}
		if back, err := throttle.ParseLimit(got.String()); err != nil || back != got {
			t.Errorf("ParseLimit(%q.String() = %q) = %#v, %v; want it back", tc.in, got.String(), back, err)
		}
	}
	bad := []struct {
		in, part string // part: what the error says is wrong
	}{
		{"", "events/window"},
		{"5", "events/window"},
		{"none", "events/window"},
		{"/2s", "events"},
		{"x/2s", "events"},
		{"5.5/2s", "events"},
		{"0/1s", "events must be at least 1"},
		{"-3/1s", "events must be at least 1"},
		{"5/", "window"},
		{"5/2", "window"},
		{"5/2x", "window"},
		{"5/1s/2", "window"},
		{"5/0", "window must be at least 1ms"},
		{"5/0s", "window must be at least 1ms"},
		{"5/-1s", "window must be at least 1ms"},
		{"5/500us", "window must be at least 1ms"},
		{"5/1500us", "not a whole number of milliseconds"},
		// The script's bounds (2^42): a fresh-user trial's tenant=9007199254740992/1s was
		// accepted here, and every task of the type was then archived by the limiter.
		{"9007199254740992/1s", "events must be less than 2^42 (4398046511104), got 9007199254740992"},
		{"4398046511104/1s", "events must be less than 2^42 (4398046511104), got 4398046511104"},
		{"99999999999999999999/1s", `events "99999999999999999999" is too large (less than 2^42, 4398046511104)`},
		{"5/1300000h", "window must be shorter than 2^42 ms (about 139 years), got 1300000h0m0s"},
		// Too long for a time.Duration (about 292 years): the bound, not "not a Go duration".
		{"5/9999999999h", `window "9999999999h" is too long: it must be shorter than 2^42 ms (about 139 years)`},
		{"5/3000000h1s", `window "3000000h1s" is too long`},
		{"5/1h2", `window "1h2" is not a Go duration`},
	}
	for _, tc := range bad {
		got, err := throttle.ParseLimit(tc.in)
		if err == nil {
			t.Errorf("ParseLimit(%q) = %#v, want an error", tc.in, got)
			continue
		}
		if got != (throttle.Limit{}) {
			t.Errorf("ParseLimit(%q) = %#v with an error, want the zero Limit", tc.in, got)
		}
		msg := err.Error()
		if !strings.HasPrefix(msg, "throttle: ") || !strings.Contains(msg, strconv.Quote(tc.in)) || !strings.Contains(msg, tc.part) {
			t.Errorf("ParseLimit(%q) error %q: want it to start with \"throttle: \", quote the input and say %q", tc.in, msg, tc.part)
		}
	}
}

func TestLimit_Validate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		limit throttle.Limit
		ok    bool
	}{
		{throttle.PerSecond(1), true},
		{throttle.Limit{Events: 1, Window: time.Millisecond}, true},
		{throttle.Limit{Events: 1 << 30, Window: 24 * time.Hour}, true},
		{throttle.Limit{}, false},
		{throttle.Limit{Events: 0, Window: time.Second}, false},
		{throttle.Limit{Events: -1, Window: time.Second}, false},
		{throttle.Limit{Events: 1, Window: 0}, false},
		{throttle.Limit{Events: 1, Window: 999 * time.Microsecond}, false},
		{throttle.Limit{Events: 1, Window: 1001 * time.Microsecond}, false},
	}
	for _, tc := range tests {
		err := tc.limit.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("%#v.Validate() = %v, want ok=%v", tc.limit, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), "throttle: limit "+tc.limit.String()) {
			t.Errorf("%#v.Validate() = %q, want it to name the limit", tc.limit, err)
		}
	}
}
