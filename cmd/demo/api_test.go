package main

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"
)

// fakeClock returns the time it is set to.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// at returns the instant ms milliseconds after a fixed epoch.
func at(ms int64) time.Time { return time.UnixMilli(1_700_000_000_000 + ms) }

func TestFakeAPI_call(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{}
	api := newFakeAPI(2, time.Second, clock.now)
	steps := []struct {
		ms     int64
		tenant string
		want   bool
	}{
		{0, "acme", true},
		{0, "acme", true},
		{0, "globex", true},    // each tenant has its own limit
		{999, "acme", false},   // (−1ms, 999ms] holds both arrivals at 0
		{1000, "acme", true},   // (0, 1000ms]: 0 is out, a boundary instant counts once
		{1000, "acme", true},   // 2 in (0, 1000ms]
		{1500, "acme", false},  // (500ms, 1500ms] holds the two at 1000
		{1999, "acme", false},  // still both
		{2000, "acme", true},   // (1000ms, 2000ms] is empty
		{2000, "globex", true}, // globex: only the one at 0, long gone
	}
	for _, s := range steps {
		clock.t = at(s.ms)
		if got := api.call(s.tenant); got != s.want {
			t.Errorf("t=%dms %s: accepted = %v, want %v", s.ms, s.tenant, got, s.want)
		}
	}
	st := api.stats()
	if want := []time.Time{at(0), at(0), at(1000), at(1000), at(2000)}; !slices.Equal(st["acme"].Accepted, want) {
		t.Errorf("acme accepted at %v, want %v", st["acme"].Accepted, want)
	}
	if st["acme"].Rejected != 3 || st["globex"].Rejected != 0 || len(st["globex"].Accepted) != 2 {
		t.Errorf("stats = %+v", st)
	}
	if n := api.rejectedTotal(); n != 3 {
		t.Errorf("rejectedTotal = %d, want 3", n)
	}
}

// An injected clock may go backwards: a request is refused if it would overfill any window
// that holds it, including ones ending at a later accepted arrival.
func TestFakeAPI_call_anyWindow(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{}
	api := newFakeAPI(1, time.Second, clock.now)
	steps := []struct {
		ms   int64
		want bool
	}{
		{1500, true},
		{1000, false}, // (500ms, 1500ms] would hold 1000 and 1500
		{501, false},  // (500ms, 1500ms] again
		{500, true},   // windows holding 500 end before 1500: (499, 1499] at most
		{2499, false}, // (1499ms, 2499ms] holds 1500
		{2500, true},
	}
	for _, s := range steps {
		clock.t = at(s.ms)
		if got := api.call("acme"); got != s.want {
			t.Errorf("t=%dms: accepted = %v, want %v", s.ms, got, s.want)
		}
	}
	if got, want := api.stats()["acme"].Accepted, []time.Time{at(500), at(1500), at(2500)}; !slices.Equal(got, want) {
		t.Errorf("accepted at %v, want %v (ascending)", got, want)
	}
}

func TestFakeAPI_ServeHTTP(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{t: at(0)}
	srv := httptest.NewServer(newFakeAPI(1, time.Second, clock.now))
	t.Cleanup(srv.Close)
	tests := []struct {
		name, method, tenant string
		want                 int
	}{
		{"Accepted", http.MethodPost, "acme", http.StatusOK},
		{"OverLimit", http.MethodPost, "acme", http.StatusTooManyRequests},
		{"OtherTenant", http.MethodPost, "globex", http.StatusOK},
		{"NoTenant", http.MethodPost, "", http.StatusBadRequest},
		{"NotPost", http.MethodGet, "initech", http.StatusMethodNotAllowed},
	}
	for _, tc := range tests { // in order: each step sees the ones before
		req, err := http.NewRequest(tc.method, srv.URL+"/call", nil)
		if err != nil {
			t.Fatal(err)
		}
		if tc.tenant != "" {
			req.Header.Set(APITenantHeader, tc.tenant)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s: status %d, want %d", tc.name, resp.StatusCode, tc.want)
		}
	}
}
