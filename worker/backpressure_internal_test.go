package worker

import (
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestNewBackpressure reads Retry-After in every form at an explicit instant: whole
// seconds, an HTTP date counted from the response's Date (whatever the local clock) or
// from the local clock without one, a past date, and the default for an absent or
// unreadable header; the maximum cuts long waits; options set the scope and the bounds.
func TestNewBackpressure(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 4, 10, 0, 0, 250*int(time.Millisecond), time.UTC)
	resp := func(status int, kv ...string) *http.Response {
		h := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return &http.Response{StatusCode: status, Header: h}
	}
	tests := []struct {
		name          string
		resp          *http.Response
		opts          []BackpressureOption
		want          time.Duration
		wantScope     throttle.Scope
		wantDefaulted bool
		wantMessage   string
	}{
		{name: "Seconds", resp: resp(429, "Retry-After", "3"), want: 3 * time.Second, wantScope: throttle.ScopeTenant,
			wantMessage: "worker: upstream answered 429 Too Many Requests, retry after 3s (Retry-After: 3); pause the tenant's quota"},
		{name: "SecondsWithSpaces", resp: resp(429, "Retry-After", " 120 "), want: 2 * time.Minute, wantScope: throttle.ScopeTenant},
		{name: "Zero", resp: resp(429, "Retry-After", "0"), want: 0, wantScope: throttle.ScopeTenant},
		// The API's clock is 5 minutes behind ours: the wait is the API's 30s, not 30s - 5m.
		{name: "DateFromDateHeader", resp: resp(503, "Retry-After", "Wed, 04 Mar 2026 09:55:30 GMT", "Date", "Wed, 04 Mar 2026 09:55:00 GMT"),
			want: 30 * time.Second, wantScope: throttle.ScopeTenant,
			wantMessage: "worker: upstream answered 503 Service Unavailable, retry after 30s (Retry-After: Wed, 04 Mar 2026 09:55:30 GMT); pause the tenant's quota"},
		{name: "DateFromLocalClock", resp: resp(503, "Retry-After", "Wed, 04 Mar 2026 10:00:10 GMT"), want: 9750 * time.Millisecond, wantScope: throttle.ScopeTenant},
		{name: "DateRFC850", resp: resp(503, "Retry-After", "Wednesday, 04-Mar-26 10:01:00 GMT", "Date", "Wed, 04 Mar 2026 10:00:00 GMT"),
			want: time.Minute, wantScope: throttle.ScopeTenant},
		{name: "DateANSIC", resp: resp(503, "Retry-After", "Wed Mar  4 10:00:05 2026", "Date", "Wed, 04 Mar 2026 10:00:00 GMT"),
			want: 5 * time.Second, wantScope: throttle.ScopeTenant},
		{name: "DateInThePast", resp: resp(429, "Retry-After", "Wed, 04 Mar 2026 09:00:00 GMT"), want: 0, wantScope: throttle.ScopeTenant},
		{name: "BadDateHeaderUsesLocalClock", resp: resp(429, "Retry-After", "Wed, 04 Mar 2026 10:00:10 GMT", "Date", "yesterday"),
			want: 9750 * time.Millisecond, wantScope: throttle.ScopeTenant},
		{name: "Absent", resp: resp(429), want: DefaultBackpressureDelay, wantScope: throttle.ScopeTenant, wantDefaulted: true,
			wantMessage: "worker: upstream answered 429 Too Many Requests, retry after 10s (no Retry-After: the default); pause the tenant's quota"},
		{name: "Unreadable", resp: resp(503, "Retry-After", "soon"), want: DefaultBackpressureDelay, wantScope: throttle.ScopeTenant, wantDefaulted: true,
			wantMessage: `worker: upstream answered 503 Service Unavailable, retry after 10s (Retry-After "soon" unreadable: the default); pause the tenant's quota`},
		{name: "Fraction", resp: resp(429, "Retry-After", "1.5"), want: DefaultBackpressureDelay, wantScope: throttle.ScopeTenant, wantDefaulted: true},
		{name: "Negative", resp: resp(429, "Retry-After", "-3"), want: DefaultBackpressureDelay, wantScope: throttle.ScopeTenant, wantDefaulted: true},
		{name: "CutToMax", resp: resp(429, "Retry-After", "7200"), want: DefaultMaxBackpressureDelay, wantScope: throttle.ScopeTenant},
		{name: "HugeCutToMax", resp: resp(429, "Retry-After", "99999999999999999999999"), want: DefaultMaxBackpressureDelay, wantScope: throttle.ScopeTenant},
		{name: "DateYearsAheadCutToMax", resp: resp(429, "Retry-After", "Fri, 01 Jan 2100 00:00:00 GMT"), want: DefaultMaxBackpressureDelay,
			wantScope: throttle.ScopeTenant},
		{name: "OwnDefault", resp: resp(429), opts: []BackpressureOption{BackpressureDefault(2 * time.Second)}, want: 2 * time.Second,
			wantScope: throttle.ScopeTenant, wantDefaulted: true},
		{name: "OwnMax", resp: resp(429, "Retry-After", "60"), opts: []BackpressureOption{BackpressureMax(30 * time.Second)}, want: 30 * time.Second,
			wantScope: throttle.ScopeTenant},
		{name: "TypeScope", resp: resp(429, "Retry-After", "3"), opts: []BackpressureOption{BackpressureScope(throttle.ScopeType)}, want: 3 * time.Second,
			wantScope:   throttle.ScopeType,
			wantMessage: "worker: upstream answered 429 Too Many Requests, retry after 3s (Retry-After: 3); pause the task type's quota"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := newBackpressure(tc.resp, now, tc.opts)
			var bp *BackpressureError
			if !errors.As(fmt.Errorf("call the API: %w", err), &bp) || !errors.Is(err, ErrBackpressure) {
				t.Fatalf("newBackpressure = %v (%T), want a *BackpressureError matching ErrBackpressure", err, err)
			}
			if bp.RetryAfter != tc.want || !bp.RetryAt.Equal(now.Add(tc.want)) || bp.Scope != tc.wantScope || bp.Defaulted != tc.wantDefaulted ||
				bp.StatusCode != tc.resp.StatusCode || bp.Header != tc.resp.Header.Get("Retry-After") {
				t.Errorf("got %+v; want RetryAfter %s, RetryAt %s, Scope %s, Defaulted %v", *bp, tc.want, now.Add(tc.want), tc.wantScope, tc.wantDefaulted)
			}
			if tc.wantMessage != "" && bp.Error() != tc.wantMessage {
				t.Errorf("Error() = %q\nwant      %q", bp.Error(), tc.wantMessage)
			}
		})
	}
}

// TestBackpressure_notBackpressure: other statuses and a nil response give nil, so a
// handler can call it on every response; bad options give an error that is not one.
func TestBackpressure_notBackpressure(t *testing.T) {
	t.Parallel()
	for _, status := range []int{200, 204, 400, 404, 500, 502, 504} {
		if err := Backpressure(&http.Response{StatusCode: status, Header: http.Header{"Retry-After": {"3"}}}); err != nil {
			t.Errorf("status %d: %v, want nil", status, err)
		}
	}
	if err := Backpressure(nil); err != nil {
		t.Errorf("nil response: %v, want nil", err)
	}
	r429 := &http.Response{StatusCode: 429, Header: http.Header{}}
	for _, tc := range []struct {
		opt  BackpressureOption
		want string
	}{
		{BackpressureScope(0), "worker: Backpressure: scope Scope(0); want throttle.ScopeTenant or throttle.ScopeType"},
		{BackpressureDefault(-time.Second), "worker: Backpressure: negative default wait -1s"},
		{BackpressureMax(0), "worker: Backpressure: maximum wait 0s; want > 0"},
	} {
		err := Backpressure(r429, tc.opt)
		if err == nil || err.Error() != tc.want || errors.Is(err, ErrBackpressure) {
			t.Errorf("Backpressure with a bad option = %v; want %q, not ErrBackpressure", err, tc.want)
		}
	}
	start := time.Now()
	err := Backpressure(&http.Response{StatusCode: 429, Header: http.Header{"Retry-After": {"3"}}})
	var bp *BackpressureError
	if !errors.As(err, &bp) || bp.RetryAfter != 3*time.Second || bp.RetryAt.Before(start.Add(3*time.Second)) || bp.RetryAt.After(time.Now().Add(3*time.Second)) {
		t.Errorf("Backpressure(429, Retry-After: 3) = %+v; want RetryAfter 3s and RetryAt 3s after the call", bp)
	}
}

// TestPauseScope: the asked scope if the rule has a quota there, else the rule's.
func TestPauseScope(t *testing.T) {
	t.Parallel()
	tenant := throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)}
	typ := throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.PerSecond(50)}
	for _, tc := range []struct {
		quotas []throttle.Quota
		want   throttle.Scope
		got    throttle.Scope
	}{
		{[]throttle.Quota{tenant, typ}, throttle.ScopeTenant, throttle.ScopeTenant},
		{[]throttle.Quota{tenant, typ}, throttle.ScopeType, throttle.ScopeType},
		{[]throttle.Quota{typ}, throttle.ScopeTenant, throttle.ScopeType},
		{[]throttle.Quota{tenant}, throttle.ScopeType, throttle.ScopeTenant},
	} {
		if got := pauseScope(tc.quotas, tc.want); got != tc.got {
			t.Errorf("pauseScope(%v, %s) = %s, want %s", tc.quotas, tc.want, got, tc.got)
		}
	}
}

// TestPauseSet counts, at explicit instants, the logs paused and not yet over: a pause
// again of one log is one pause, and an earlier end does not shorten it.
func TestPauseSet(t *testing.T) {
	t.Parallel()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g"})
	at := time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)
	now := at
	p := newPauseSet(g, func() time.Time { return now })
	value := func() float64 {
		var m dto.Metric
		if err := g.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetGauge().GetValue()
	}
	p.add("a", at.Add(3*time.Second))
	p.add("b", at.Add(5*time.Second))
	p.add("a", at.Add(time.Second)) // does not shorten a's
	if got := value(); got != 2 {
		t.Errorf("two logs paused: gauge %g, want 2", got)
	}
	now = at.Add(3 * time.Second) // a's end: over
	p.refresh()
	if got := value(); got != 1 {
		t.Errorf("at a's end: gauge %g, want 1", got)
	}
	now = at.Add(4999 * time.Millisecond)
	p.refresh()
	if got := value(); got != 1 {
		t.Errorf("1ms before b's end: gauge %g, want 1", got)
	}
	now = at.Add(5 * time.Second)
	p.refresh()
	if got := value(); got != 0 {
		t.Errorf("at b's end: gauge %g, want 0", got)
	}
	p.add("c", at) // already over when added
	if got := value(); got != 0 {
		t.Errorf("a pause already over: gauge %g, want 0", got)
	}
}
