package main

import (
	"net/http"
	"slices"
	"sort"
	"sync"
	"time"
)

// APITenantHeader is the HTTP header that names the tenant a call to the fake API is for.
const APITenantHeader = "X-Tenant"

// fakeAPI is the third-party API the demo's tasks call: it accepts at most limit requests
// per tenant in any sliding window (t-window, t] of arrival times, and answers 429 Too Many
// Requests to a request that would put one more in some window. It never forgets an
// accepted request, so the report can check the arrivals afterwards.
//
// A fakeAPI is an http.Handler, safe for concurrent use.
type fakeAPI struct {
	limit  int
	window time.Duration
	now    func() time.Time // read under mu, so arrivals are ordered as they are decided

	mu      sync.Mutex
	tenants map[string]*apiTenant
}

type apiTenant struct {
	accepted []time.Time // arrival times of accepted requests, ascending
	rejected int         // requests answered 429
}

// apiStats is what the fake API saw of one tenant.
type apiStats struct {
	Accepted []time.Time // arrival times of accepted requests, ascending
	Rejected int         // requests answered 429
}

// newFakeAPI returns an API that accepts limit requests per tenant per window, reading
// arrival times from now (time.Now if nil).
func newFakeAPI(limit int, window time.Duration, now func() time.Time) *fakeAPI {
	if now == nil {
		now = time.Now
	}
	return &fakeAPI{limit: limit, window: window, now: now, tenants: map[string]*apiTenant{}}
}

// ServeHTTP answers a POST with the tenant in APITenantHeader: 200 if accepted, 429 if
// over the limit; 400 without the header, 405 for other methods.
func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		http.Error(w, "use POST", http.StatusMethodNotAllowed)
		return
	}
	tenant := r.Header.Get(APITenantHeader)
	if tenant == "" {
		http.Error(w, "missing "+APITenantHeader+" header", http.StatusBadRequest)
		return
	}
	if !a.call(tenant) {
		http.Error(w, "rate limit exceeded for tenant "+tenant, http.StatusTooManyRequests)
		return
	}
	_, _ = w.Write([]byte("ok\n"))
}

// call decides one request of tenant arriving now: it is accepted iff, with it, no window
// (s-window, s] holds more than limit accepted requests; otherwise it counts a rejection.
func (a *fakeAPI) call(tenant string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	t := a.tenants[tenant]
	if t == nil {
		t = &apiTenant{}
		a.tenants[tenant] = t
	}
	if a.over(t.accepted, now) {
		t.rejected++
		return false
	}
	i := sort.Search(len(t.accepted), func(i int) bool { return t.accepted[i].After(now) })
	t.accepted = slices.Insert(t.accepted, i, now)
	return true
}

// over reports whether one more arrival at now would put more than limit arrivals in some
// window of ts. The windows holding now are (s-window, s] for s in [now, now+window);
// their count only changes at s = now and at the accepted times in (now, now+window)
// (there are some only if the injected clock went backwards), so checking those is exact.
func (a *fakeAPI) over(ts []time.Time, now time.Time) bool {
	if countIn(ts, now, a.window)+1 > a.limit {
		return true
	}
	for _, s := range ts {
		if s.After(now) && s.Before(now.Add(a.window)) && countIn(ts, s, a.window)+1 > a.limit {
			return true
		}
	}
	return false
}

// countIn returns how many of the ascending times ts are in the window (end-w, end].
func countIn(ts []time.Time, end time.Time, w time.Duration) int {
	first := sort.Search(len(ts), func(i int) bool { return ts[i].After(end.Add(-w)) })
	last := sort.Search(len(ts), func(i int) bool { return ts[i].After(end) })
	return last - first
}

// stats returns a copy of what the API saw of each tenant.
func (a *fakeAPI) stats() map[string]apiStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]apiStats, len(a.tenants))
	for name, t := range a.tenants {
		out[name] = apiStats{Accepted: slices.Clone(t.accepted), Rejected: t.rejected}
	}
	return out
}

// rejectedTotal returns the number of 429s answered so far, all tenants together.
func (a *fakeAPI) rejectedTotal() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, t := range a.tenants {
		n += t.rejected
	}
	return n
}
