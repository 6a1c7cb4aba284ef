package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestLimiter_AllowAt_boundaryInstant(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	q := tenantQuota(1, time.Second)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	for _, s := range []struct {
		at   int64
		want outcome
	}{
		{1000, outcome{Allowed: true, Quota: q, Count: 1, At: 1000}},
		// 1000 still counts at 1999 (1000 > 1999 - 1000) and no longer at 2000.
		{1999, outcome{Quota: q, Count: 1, RetryAfter: msd(1), At: 1999}},
		{2000, outcome{Allowed: true, Quota: q, Count: 1, At: 2000}},
	} {
		wantOutcome(t, l, req, s.at, s.want)
	}
}

// TestLimiter_AllowAt_admitsUpToLimit counts admissions and checks Count and Remaining as
// the window fills and slides. (v1 also checked ResetAfter, which v2 has no more.)
func TestLimiter_AllowAt_admitsUpToLimit(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	q := tenantQuota(3, time.Second)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: t.Name()}, Quotas: []throttle.Quota{q}}
	steps := []struct {
		at   int64
		want outcome
	}{
		{100, outcome{Allowed: true, Quota: q, Count: 1, Remaining: 2, At: 100}},
		{200, outcome{Allowed: true, Quota: q, Count: 2, Remaining: 1, At: 200}},
		{300, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, At: 300}},
		{400, outcome{Quota: q, Count: 3, Remaining: 0, RetryAfter: msd(700), At: 400}},
		{1100, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, At: 1100}}, // 100 left the window
		{1250, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, At: 1250}}, // 200 too
		{1251, outcome{Quota: q, Count: 3, Remaining: 0, RetryAfter: msd(1300 - 1251), At: 1251}},
	}
	for _, s := range steps {
		wantOutcome(t, l, req, s.at, s.want)
	}
}

// TestLimiter_AllowAt_retryAfter checks contract rule 4: retry_after is the k-th oldest
// score in the window + W - now with k = count + cost - limit, the request is still denied
// (by 1ms) one millisecond earlier, and admitted at exactly now + retry_after.
func TestLimiter_AllowAt_retryAfter(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	limit3 := tenantQuota(3, time.Second)
	tests := []struct {
		name   string
		setup  throttle.Quota // quota of the admissions made first
		admits []int64
		probe  throttle.Quota
		cost   int
		at     int64
		want   outcome
	}{
		{
			name: "Cost1IsOldest", setup: limit3, admits: []int64{100, 200, 300}, probe: limit3, cost: 1, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(100 + 1000 - 400), At: 400},
		},
		{
			name: "Cost2IsSecondOldest", setup: limit3, admits: []int64{100, 200, 300}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(200 + 1000 - 400), At: 400},
		},
		{
			name: "Cost3IsThirdOldest", setup: limit3, admits: []int64{100, 200, 300}, probe: limit3, cost: 3, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(300 + 1000 - 400), At: 400},
		},
		{
			name: "Cost2WithOneFree", setup: limit3, admits: []int64{100, 200}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 2, Remaining: 1, RetryAfter: msd(100 + 1000 - 400), At: 400},
		},
		{
			name: "SameScoreTwice", setup: limit3, admits: []int64{100, 100, 300}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(100 + 1000 - 400), At: 400},
		},
		{
			// 100 was logged under a 5s window and is still in the log, but not in a 1s
			// window at 3600: the oldest entry that counts is 3000.
			name: "OnlyEntriesInWindowCount", setup: tenantQuota(3, 5*time.Second), admits: []int64{100, 3000, 3500},
			probe: tenantQuota(2, time.Second), cost: 1, at: 3600,
			want: outcome{Quota: tenantQuota(2, time.Second), Count: 2, RetryAfter: msd(3000 + 1000 - 3600), At: 3600},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			key := throttle.Key{TaskType: "api:call", Tenant: t.Name()}
			for _, at := range tc.admits {
				mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{tc.setup}}, at)
			}
			req := throttle.Request{Key: key, Quotas: []throttle.Quota{tc.probe}, Cost: tc.cost}
			d := wantOutcome(t, l, req, tc.at, tc.want)
			if want := ms(tc.at).Add(tc.want.RetryAfter); !d.RetryAt().Equal(want) {
				t.Errorf("RetryAt = %d ms, want %d", d.RetryAt().UnixMilli(), want.UnixMilli())
			}
			retry := tc.want.RetryAfter.Milliseconds()
			if d := allowAt(t, l, req, tc.at+retry-1); d.Allowed || d.RetryAfter != time.Millisecond {
				t.Errorf("1ms before retry_after: got %s, want a denial with RetryAfter 1ms", outcomeOf(d))
			}
			mustAdmit(t, l, req, tc.at+retry)
		})
	}
}

// TestLimiter_AllowAt_denialWritesNothing checks contract rule 3 with the server's own
// count of writes, which every admission increases: a denial without a reservation writes
// nothing to any key (logs, pending and cost sets, leases, fair state), whoever denies it,
// whatever its cost, wait or clock.
func TestLimiter_AllowAt_denialWritesNothing(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	ctx := context.Background()
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	full := throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(3, time.Minute), tenantQuota(2, time.Minute)}}

	before := dirty(t, rdb)
	mustAdmit(t, l, full, 1000)
	if after := dirty(t, rdb); after <= before {
		t.Fatalf("rdb_changes_since_last_save went from %d to %d across an admission: the check below cannot fail", before, after)
	}
	// A cost-2 event beside: the tenant's log gets a cost set too.
	weighted := throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(3, time.Minute), tenantQuota(3, time.Minute)}, Cost: 2}
	mustAdmit(t, l, weighted, 2000)

	other := throttle.Key{TaskType: "api:call", Tenant: "other"}
	denials := []struct {
		name string
		req  throttle.Request
		at   int64
	}{
		{"TenantFull", full, 3000},
		{"TenantFullCost2", throttle.Request{Key: key, Quotas: full.Quotas, Cost: 2}, 3000},
		{"TenantFullOwnMember", throttle.Request{Key: key, Quotas: full.Quotas, Member: "m-1"}, 3001},
		{"TenantFullOnlyTenantQuota", throttle.Request{Key: key, Quotas: full.Quotas[1:]}, 3002},
		{"TypeFullForOtherTenant", throttle.Request{Key: other, Quotas: []throttle.Quota{typeQuota(3, time.Minute), tenantQuota(2, time.Minute)}}, 3003},
		// The slot is 58s ahead, further than its wait: a denial, not an admission ahead.
		{"SlotBeyondMaxWait", throttle.Request{Key: key, Quotas: full.Quotas, MaxWait: 30 * time.Second}, 3004},
		// Behind the logs' high-water instant (2000): decided at 2000, and denied there.
		{"CallerBehind", full, 1500},
		{"CallerBehindWeighted", weighted, 1},
	}
	logs := []string{l.RedisKey(key, throttle.ScopeTenant), l.RedisKey(key, throttle.ScopeType), resvCostsKey(t, l, key, throttle.ScopeTenant)}
	for _, dn := range denials {
		keys, err := rdb.Keys(ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(keys)
		sets := make([][]redis.Z, len(logs))
		ttls := make([]time.Duration, len(logs))
		for i, k := range logs {
			sets[i], ttls[i] = zsetOf(t, rdb, k), pttl(t, rdb, k)
			if len(sets[i]) == 0 {
				t.Fatalf("%s: %s is empty: the check below cannot fail", dn.name, k)
			}
		}
		writes := dirty(t, rdb)
		if d := allowAt(t, l, dn.req, dn.at); d.Allowed || d.Reserved {
			t.Fatalf("%s: %s, want a denial", dn.name, outcomeOf(d))
		}
		if got := dirty(t, rdb); got != writes {
			t.Errorf("%s: rdb_changes_since_last_save went from %d to %d across a denial", dn.name, writes, got)
		}
		for i, k := range logs {
			if got := zsetOf(t, rdb, k); !slices.Equal(got, sets[i]) {
				t.Errorf("%s: %s changed across a denial:\n got %v\nwant %v", dn.name, k, got, sets[i])
			}
			if got := pttl(t, rdb, k); got > ttls[i] {
				t.Errorf("%s: PTTL of %s went up across a denial, from %v to %v", dn.name, k, ttls[i], got)
			}
		}
		after, err := rdb.Keys(ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		if slices.Sort(after); !slices.Equal(after, keys) {
			t.Errorf("%s: the keys went from %q to %q across a denial", dn.name, keys, after)
		}
	}
}

// TestLimiter_AllowAt_ttl checks contract rule 6: PEXPIRE is relative to the server's real
// clock, so the script sets TTL = max(newest entry, now) - now + W, W the longest window
// of the log's quotas in the call, plus the claim timeout while it holds reservations (and
// the same on their pending and cost sets). v1 added a trim grace of 2 x MaxSkew to every
// TTL, and a caller behind the newest entry got a longer one; v2 has no grace, and a
// caller behind the logs' high-water instant is decided at it, so its TTL is the same as
// any other call's there.
func TestLimiter_AllowAt_ttl(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	const slack = time.Second // real time that passes between the script and PTTL
	tenant3per10s, tenant1per10s := tenantQuota(3, 10*time.Second), tenantQuota(1, 10*time.Second)
	steps := []struct {
		name      string
		tenant    string
		quotas    []throttle.Quota
		cost      int
		token     string
		wait      time.Duration
		timeout   time.Duration // ClaimTimeout
		at        int64
		want      outcome
		kind      string // the key: "" the log, "pending:", "costs:", or "leases" for the type's
		scope     throttle.Scope
		ttl       time.Duration // the TTL set; PTTL is within slack below it
		unchanged bool          // a call that writes nothing: PTTL must not go up
	}{
		{name: "First", tenant: "a", quotas: []throttle.Quota{tenant3per10s}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 1, Remaining: 2, At: 1000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		{name: "Second", tenant: "a", quotas: []throttle.Quota{tenant3per10s}, at: 5000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 2, Remaining: 1, At: 5000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		// A caller whose clock is behind the log's high-water instant (5000) is decided,
		// and logged, at 5000: admitted with a Delay of 2s, and the TTL is 10s as at 5000.
		{name: "CallerBehind", tenant: "a", quotas: []throttle.Quota{tenant3per10s}, at: 3000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 3, Delay: 2 * time.Second, At: 5000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		{name: "Denied", tenant: "a", quotas: []throttle.Quota{tenant3per10s}, at: 3001,
			want: outcome{Quota: tenant3per10s, Count: 3, RetryAfter: msd(11000 - 3001), At: 5000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second, unchanged: true},
		{name: "LongestWindowOfLog", tenant: "b", quotas: []throttle.Quota{tenant3per10s, tenantQuota(5, time.Minute)}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 1, Remaining: 2, At: 1000}, scope: throttle.ScopeTenant, ttl: time.Minute},
		{name: "TypeLog", tenant: "c", quotas: []throttle.Quota{tenant3per10s, typeQuota(100, time.Hour)}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 1, Remaining: 2, At: 1000}, scope: throttle.ScopeType, ttl: time.Hour},
		{name: "TenantLogBesideType", tenant: "d", quotas: []throttle.Quota{tenant3per10s, typeQuota(100, time.Hour)}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant3per10s, Count: 1, Remaining: 2, At: 1000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		// An admission for a slot ahead: the log outlives that entry by the window.
		{name: "AheadFirst", tenant: "e", quotas: []throttle.Quota{tenant1per10s}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant1per10s, Count: 1, At: 1000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		{name: "AdmittedAhead", tenant: "e", quotas: []throttle.Quota{tenant1per10s}, wait: 10 * time.Second, at: 2000,
			want: outcome{Allowed: true, Quota: tenant1per10s, Count: 1, Delay: 9 * time.Second, At: 11000}, scope: throttle.ScopeTenant, ttl: 19 * time.Second},
		// A reservation at 11000: its log, pending set and the type's leases keep it until
		// its claim timeout after its window: 11000 - 2000 + 10s + 5s.
		{name: "ReserveFirst", tenant: "f", quotas: []throttle.Quota{tenant1per10s}, at: 1000,
			want: outcome{Allowed: true, Quota: tenant1per10s, Count: 1, At: 1000}, scope: throttle.ScopeTenant, ttl: 10 * time.Second},
		{name: "Reserved", tenant: "f", quotas: []throttle.Quota{tenant1per10s}, token: "R", at: 2000,
			want: outcome{Reserved: true, Quota: tenant1per10s, Count: 1, RetryAfter: 9 * time.Second, At: 2000}, scope: throttle.ScopeTenant, ttl: 24 * time.Second},
		{name: "ReservedPending", tenant: "f", quotas: []throttle.Quota{tenant1per10s}, token: "R", at: 2001,
			want: outcome{Reserved: true, Held: true, Quota: tenant1per10s, Count: 1, RetryAfter: msd(11000 - 2001), At: 2001},
			kind: "pending:", scope: throttle.ScopeTenant, ttl: 24 * time.Second, unchanged: true},
		{name: "ReservedLease", tenant: "f", quotas: []throttle.Quota{tenant1per10s}, token: "R", at: 2002,
			want: outcome{Reserved: true, Held: true, Quota: tenant1per10s, Count: 1, RetryAfter: msd(11000 - 2002), At: 2002},
			kind: "leases", ttl: 24 * time.Second, unchanged: true},
		{name: "ReservedShortClaimTimeout", tenant: "g", quotas: []throttle.Quota{tenant1per10s}, token: "S", timeout: 2 * time.Second, at: 2000,
			want: outcome{Reserved: true, Quota: tenant1per10s, Count: 1, RetryAfter: 9 * time.Second, At: 2000}, scope: throttle.ScopeTenant, ttl: 21 * time.Second},
		// A weighted entry: its cost set expires with its log.
		{name: "Weighted", tenant: "h", quotas: []throttle.Quota{tenantQuota(5, 10*time.Second)}, cost: 3, at: 1000,
			want: outcome{Allowed: true, Quota: tenantQuota(5, 10*time.Second), Count: 3, Remaining: 2, At: 1000},
			kind: "costs:", scope: throttle.ScopeTenant, ttl: 10 * time.Second},
	}
	// g's log is written at 1000 first, so that S is denied.
	mustAdmit(t, l, throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "g"}, Quotas: []throttle.Quota{tenant1per10s}}, 1000)
	for _, s := range steps {
		key := throttle.Key{TaskType: "api:call", Tenant: s.tenant}
		var k string
		switch s.kind {
		case "leases":
			k = resvTypeKey(t, l, key.TaskType, "leases")
		case "":
			k = l.RedisKey(key, s.scope)
		default:
			k = resvBeside(t, l, key, s.scope, s.kind)
		}
		before := pttl(t, rdb, k)
		req := throttle.Request{Key: key, Quotas: s.quotas, Cost: s.cost, Reservation: s.token, MaxWait: s.wait, ClaimTimeout: s.timeout}
		d := allowAt(t, l, req, s.at)
		if got := outcomeOf(d); got != s.want {
			t.Fatalf("%s:\n got %s\nwant %s", s.name, got, s.want)
		}
		got := pttl(t, rdb, k)
		if got > s.ttl || got < s.ttl-slack {
			t.Errorf("%s: PTTL %s = %v, want in [%v, %v]", s.name, k, got, s.ttl-slack, s.ttl)
		}
		if s.unchanged && (before <= 0 || got > before) {
			t.Errorf("%s: PTTL %s went from %v to %v across a call that writes nothing", s.name, k, before, got)
		}
	}
}

// ourKey matches every key a Limiter with prefix "throttle" or "app" writes: a task type's
// window logs, their pending and cost sets, and its leases, fair tags and fair state.
var ourKey = regexp.MustCompile(`^(throttle|app):\{[^{}]+\}:(type|tenant:[^{}]*|pending:type|pending:tenant:[^{}]*|costs:type|costs:tenant:[^{}]*|leases|fair|fairstate)$`)

// TestLimiter_keysAlwaysExpire runs a mix of requests (replays, weights, callers behind,
// reservations claimed, released and left to lapse, the caller's clock and the server's)
// and then checks that every key on the server is one of ours and has a TTL: none is left
// with TTL -1 (contract rule 6). Every kind of key must have been written, or the test
// shows less than it should.
func TestLimiter_keysAlwaysExpire(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	local, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := throttle.New(rdb, throttle.Config{Prefix: "app", Clock: throttle.ClockRedis})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	wantLogs := map[string]bool{}
	// Windows of a minute or more: no key may expire while the test runs.
	quotaSets := [][]throttle.Quota{
		{tenantQuota(2, time.Minute)},
		{tenantQuota(2, time.Minute), tenantQuota(5, 5*time.Minute)},
		{typeQuota(3, 2*time.Minute)},
		{typeQuota(3, 2*time.Minute), tenantQuota(2, 10*time.Minute)},
	}
	for i, quotas := range quotaSets {
		for _, tenant := range []string{"acme", "", "{x}", "ü"} {
			key := throttle.Key{TaskType: fmt.Sprintf("job:%d", i), Tenant: tenant}
			for n, at := range []int64{1000, 1001, 1002, 500, 900_000, 1003, 900_001, 900_002} {
				member := fmt.Sprintf("%s/%q/m%d", key.TaskType, key.Tenant, n%4) // replays
				req := throttle.Request{Key: key, Quotas: quotas, Cost: 1 + n%2, Member: member}
				if n%3 == 2 {
					req.Reservation = fmt.Sprintf("r%d", n%6) // claimed later, or left to lapse
				}
				dLocal, err := local.AllowAt(ctx, req, ms(at))
				if err != nil {
					t.Fatal(err)
				}
				dRemote, err := remote.Allow(ctx, req)
				if err != nil {
					t.Fatal(err)
				}
				for _, q := range quotas {
					if dLocal.Allowed && !dLocal.Replay {
						wantLogs[local.RedisKey(key, q.Scope)] = true
					}
					if dRemote.Allowed && !dRemote.Replay {
						wantLogs[remote.RedisKey(key, q.Scope)] = true
					}
				}
			}
			if _, err := local.Release(ctx, key.TaskType, "r2"); err != nil {
				t.Fatal(err)
			}
		}
	}
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]int{}
	for _, k := range keys {
		m := ourKey.FindStringSubmatch(k)
		if m == nil {
			t.Errorf("key %q on the server is not one of ours", k)
			continue
		}
		kind, _, _ := strings.Cut(m[2], ":")
		if kind == "pending" || kind == "costs" {
			kind += ":" + strings.SplitN(m[2], ":", 3)[1]
		}
		kinds[kind]++
		if ttl := pttl(t, rdb, k); ttl <= 0 {
			t.Errorf("PTTL %s = %v, want > 0", k, ttl)
		}
	}
	for k := range wantLogs {
		if !slices.Contains(keys, k) {
			t.Errorf("window log %s, written by an admission, is not on the server", k)
		}
	}
	for _, kind := range []string{"type", "tenant", "pending:type", "pending:tenant", "costs:type", "costs:tenant", "leases", "fair", "fairstate"} {
		if kinds[kind] == 0 {
			t.Errorf("no key of kind %q was written (keys by kind: %v): the test shows less than it should", kind, kinds)
		}
	}
}

// TestLimiter_AllowAt_concurrent checks that the script decides atomically: 200 callers at
// one instant share 10 slots exactly.
func TestLimiter_AllowAt_concurrent(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(10, time.Minute)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	const callers = 200
	decisions := make([]throttle.Decision, callers)
	errs := make([]error, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			decisions[i], errs[i] = l.AllowAt(context.Background(), req, ms(5000))
		})
	}
	wg.Wait()
	allowed, denied := 0, 0
	for i, d := range decisions {
		if errs[i] != nil {
			t.Fatalf("caller %d: %v", i, errs[i])
		}
		if d.Allowed {
			allowed++
			if d.At.UnixMilli() != 5000 || d.Delay != 0 || d.Replay {
				t.Errorf("caller %d admitted with %s, want an admission at 5000", i, outcomeOf(d))
			}
			continue
		}
		denied++
		if want := (outcome{Quota: q, Count: 10, RetryAfter: time.Minute, At: 5000}); outcomeOf(d) != want {
			t.Errorf("caller %d denied with %s, want %s", i, outcomeOf(d), want)
		}
	}
	if allowed != 10 || denied != 190 {
		t.Errorf("admitted %d and denied %d of %d, want 10 and 190", allowed, denied, callers)
	}
	if n := zcard(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant)); n != 10 {
		t.Errorf("the log holds %d entries, want 10", n)
	}
}

// TestLimiter_AllowAt_invalid checks contract rule 9: a request that can never be decided
// is an ErrInvalid error before any command reaches Redis.
func TestLimiter_AllowAt_invalid(t *testing.T) {
	t.Parallel()
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	good := tenantQuota(5, time.Second)
	one := []throttle.Quota{good}
	tests := []struct {
		name     string
		req      throttle.Request
		at       time.Time // AllowAt's instant; zero: 1000 ms, and Allow is called too
		costOver bool
	}{
		{name: "EventsZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(0, time.Second)}}},
		{name: "EventsNegative", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(-3, time.Second)}}},
		{name: "EventsTooMany", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(1<<42, time.Second)}}},
		{name: "WindowZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 0)}}},
		{name: "WindowNegative", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, -time.Second)}}},
		{name: "WindowBelow1ms", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 500*time.Microsecond)}}},
		{name: "WindowNotWholeMS", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 1500*time.Microsecond)}}},
		{name: "WindowTooLong", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, msd(1<<42))}}},
		{name: "SecondQuotaBad", req: throttle.Request{Key: key, Quotas: []throttle.Quota{good, typeQuota(5, 0)}}},
		{name: "CostNegative", req: throttle.Request{Key: key, Quotas: one, Cost: -1}},
		{name: "CostOverLimit", req: throttle.Request{Key: key, Quotas: one, Cost: 6}, costOver: true},
		{name: "CostOverSmallerQuota", req: throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(100, time.Minute), tenantQuota(2, time.Second)}, Cost: 3}, costOver: true},
		{name: "EmptyTaskType", req: throttle.Request{Key: throttle.Key{Tenant: "acme"}, Quotas: one}},
		{name: "TenantTooLong", req: throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: strings.Repeat("t", throttle.MaxTenantBytes+1)}, Quotas: one}},
		{name: "NoQuotas", req: throttle.Request{Key: key}},
		{name: "EmptyQuotas", req: throttle.Request{Key: key, Quotas: []throttle.Quota{}}},
		{name: "ScopeZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{{Limit: good.Limit}}}},
		{name: "ScopeUnknown", req: throttle.Request{Key: key, Quotas: []throttle.Quota{{Scope: 3, Limit: good.Limit}}}},
		// Members: the first byte of '@', '*', '~' and '#' starts the script's own entries.
		{name: "MemberReservationLike", req: throttle.Request{Key: key, Quotas: one, Member: "@1:task"}},
		{name: "MemberWeightedLike", req: throttle.Request{Key: key, Quotas: one, Member: "*2:task"}},
		{name: "MemberReleasedLike", req: throttle.Request{Key: key, Quotas: one, Member: "~2:task@5"}},
		{name: "MemberSentinel", req: throttle.Request{Key: key, Quotas: one, Member: "#"}},
		{name: "MemberSentinelF", req: throttle.Request{Key: key, Quotas: one, Member: "#f"}},
		{name: "MemberTooLong", req: throttle.Request{Key: key, Quotas: one, Member: strings.Repeat("m", 201)}},
		{name: "WeightNegative", req: throttle.Request{Key: key, Quotas: one, Weight: -1}},
		{name: "WeightOverMax", req: throttle.Request{Key: key, Quotas: one, Weight: throttle.MaxWeight + 1}},
		{name: "MaxWaitNegative", req: throttle.Request{Key: key, Quotas: one, MaxWait: -time.Millisecond}},
		{name: "ClaimWaitNegative", req: throttle.Request{Key: key, Quotas: one, ClaimWait: -time.Millisecond}},
		{name: "ClaimTimeoutNegative", req: throttle.Request{Key: key, Quotas: one, ClaimTimeout: -time.Second}},
		{name: "MaxWaitTooLong", req: throttle.Request{Key: key, Quotas: one, MaxWait: msd(1 << 42)}},
		// Instants: [0, 2^42) ms. A time before the epoch must not reach the script, where
		// it would read as "use the server's TIME" (-1) or as a negative instant.
		{name: "InstantBeforeEpoch", req: throttle.Request{Key: key, Quotas: one}, at: ms(-5000)},
		{name: "InstantOneMSBeforeEpoch", req: throttle.Request{Key: key, Quotas: one}, at: ms(-1)},
		{name: "InstantOneNSBeforeEpoch", req: throttle.Request{Key: key, Quotas: one}, at: time.Unix(0, -1)},
		{name: "InstantFrom2^42ms", req: throttle.Request{Key: key, Quotas: one}, at: ms(1 << 42)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, rdb := newLimiterClient(t, throttle.Config{})
			rdb.Ping(context.Background()) // open the connection the measurement uses
			at, both := tc.at, tc.at.IsZero()
			if both {
				at = ms(1000)
			}
			var errs []error
			var ds []throttle.Decision
			n := commandsDuring(t, rdb, func() {
				d, err := l.AllowAt(context.Background(), tc.req, at)
				ds, errs = append(ds, d), append(errs, err)
				if both {
					d, err = l.Allow(context.Background(), tc.req)
					ds, errs = append(ds, d), append(errs, err)
				}
			})
			for i, err := range errs {
				if !errors.Is(err, throttle.ErrInvalid) {
					t.Errorf("err = %v (decision %s), want ErrInvalid", err, outcomeOf(ds[i]))
				}
				if got := errors.Is(err, throttle.ErrCostOverLimit); got != tc.costOver {
					t.Errorf("errors.Is(%v, ErrCostOverLimit) = %v, want %v", err, got, tc.costOver)
				}
				if err != nil && !strings.HasPrefix(err.Error(), "throttle: ") {
					t.Errorf("err = %q, want it to start with \"throttle: \"", err)
				}
				if ds[i] != (throttle.Decision{}) {
					t.Errorf("Decision on error: %+v, want zero", ds[i])
				}
			}
			if n != 0 {
				t.Errorf("the server processed %d commands for an invalid request, want 0", n)
			}
		})
	}
	t.Run("ReleaseAndCancel", func(t *testing.T) {
		t.Parallel()
		l, rdb := newLimiterClient(t, throttle.Config{})
		rdb.Ping(context.Background())
		var errs []error
		n := commandsDuring(t, rdb, func() {
			_, err := l.Release(context.Background(), "", "token")
			errs = append(errs, err)
			_, err = l.Release(context.Background(), "api:call", "")
			errs = append(errs, err)
			errs = append(errs, l.Cancel(context.Background(), throttle.Request{Key: throttle.Key{Tenant: "acme"}, Quotas: one, Reservation: "token"}))
			errs = append(errs, l.Cancel(context.Background(), throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(0, time.Second)}, Reservation: "token"}))
		})
		for i, err := range errs {
			if !errors.Is(err, throttle.ErrInvalid) {
				t.Errorf("call %d: err = %v, want ErrInvalid", i, err)
			}
		}
		if n != 0 {
			t.Errorf("the server processed %d commands for invalid releases, want 0", n)
		}
	})
	t.Run("ValidRequestIsCounted", func(t *testing.T) { // the measurement above can fail
		t.Parallel()
		l, rdb := newLimiterClient(t, throttle.Config{})
		rdb.Ping(context.Background())
		n := commandsDuring(t, rdb, func() {
			// The longest valid member, an instant just below 2^42 ms, the largest weight.
			req := throttle.Request{Key: key, Quotas: one, Member: strings.Repeat("m", 200), Weight: throttle.MaxWeight}
			if d, err := l.AllowAt(context.Background(), req, ms(1<<42-1)); err != nil || !d.Allowed {
				t.Errorf("valid request: %+v, %v; want admitted", d, err)
			}
			if d, err := l.AllowAt(context.Background(), throttle.Request{Key: key, Quotas: one}, ms(0)); err != nil {
				t.Errorf("valid request at the epoch: %+v, %v", d, err)
			}
			longest := throttle.Key{TaskType: "api:call", Tenant: strings.Repeat("t", throttle.MaxTenantBytes)}
			if d, err := l.AllowAt(context.Background(), throttle.Request{Key: longest, Quotas: one}, ms(1000)); err != nil || !d.Allowed {
				t.Errorf("valid request for a tenant of MaxTenantBytes: %+v, %v; want admitted", d, err)
			}
		})
		if n < 3 {
			t.Errorf("the server processed %d commands for three valid requests, want at least 3", n)
		}
	})
}

func TestNew_config(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	for _, cfg := range []throttle.Config{
		{Prefix: "app{x"},
		{Prefix: "app}"},
		{Prefix: "{app}"},
		{Clock: throttle.ClockRedis + 1},
	} {
		if l, err := throttle.New(rdb, cfg); err == nil || l != nil {
			t.Errorf("New(%+v) = %v, %v; want an error", cfg, l, err)
		}
	}
	// A nil client, bare or typed, is an error, not a panic at the first Allow.
	var nilClient *redis.Client
	var nilCluster *redis.ClusterClient
	for _, c := range []struct {
		rdb  redis.UniversalClient
		want string
	}{
		{nil, "throttle: New: nil Redis client"},
		{nilClient, "throttle: New: nil *redis.Client"},
		{nilCluster, "throttle: New: nil *redis.ClusterClient"},
	} {
		if l, err := throttle.New(c.rdb, throttle.Config{}); err == nil || err.Error() != c.want || l != nil {
			t.Errorf("New(%T nil) = %v, %v; want %q", c.rdb, l, err, c.want)
		}
	}
	// AutoPipeline needs a client that has an autopipeliner.
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	t.Cleanup(func() { _ = ring.Close() })
	if l, err := throttle.New(ring, throttle.Config{AutoPipeline: true}); err == nil || l != nil {
		t.Errorf("New(Ring, AutoPipeline) = %v, %v; want an error", l, err)
	}
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	for _, c := range []struct {
		cfg  throttle.Config
		want string
	}{
		{throttle.Config{}, "throttle:{api:call}:type"},
		{throttle.Config{Prefix: "app"}, "app:{api:call}:type"},
		{throttle.Config{Prefix: "app:rl"}, "app:rl:{api:call}:type"},
		{throttle.Config{Prefix: "auto", AutoPipeline: true}, "auto:{api:call}:type"},
	} {
		l, err := throttle.New(rdb, c.cfg)
		if err != nil {
			t.Fatalf("New(%+v): %v", c.cfg, err)
		}
		if got := l.RedisKey(key, throttle.ScopeType); got != c.want {
			t.Errorf("Prefix %q: RedisKey = %q, want %q", c.cfg.Prefix, got, c.want)
		}
		q := typeQuota(1, time.Minute)
		req := throttle.Request{Key: key, Quotas: []throttle.Quota{q}}
		mustAdmit(t, l, req, 1000)
		wantOutcome(t, l, req, 1001, outcome{Quota: q, Count: 1, RetryAfter: msd(59999), At: 1001})
		if n := zcard(t, rdb, c.want); n != 1 {
			t.Errorf("Prefix %q: %s holds %d entries, want 1", c.cfg.Prefix, c.want, n)
		}
	}
}

// TestLimiter_AllowAt_multiQuota is the example of contract rule 10: a type-wide
// quota and a per-tenant quota in one request, decided all or nothing.
func TestLimiter_AllowAt_multiQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	typ, ten := typeQuota(10, time.Minute), tenantQuota(1, time.Minute)
	quotas := []throttle.Quota{typ, ten}
	a := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "A"}, Quotas: quotas}
	b := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "B"}, Quotas: quotas}
	typeLog := l.RedisKey(a.Key, throttle.ScopeType)

	wantOutcome(t, l, a, 0, outcome{Allowed: true, Quota: ten, Count: 1, Remaining: 0, At: 0})
	for at := int64(1); at < 20; at++ {
		wantOutcome(t, l, a, at, outcome{Quota: ten, Count: 1, RetryAfter: msd(60000 - at), At: at})
	}
	if n := zcard(t, rdb, typeLog); n != 1 {
		t.Errorf("type log holds %d entries after A's 20 requests, want 1: denials consumed type quota", n)
	}
	wantOutcome(t, l, b, 100, outcome{Allowed: true, Quota: ten, Count: 1, Remaining: 0, At: 100})
	if n := zcard(t, rdb, typeLog); n != 2 {
		t.Errorf("type log holds %d entries after B, want 2", n)
	}
	if n := zcard(t, rdb, l.RedisKey(a.Key, throttle.ScopeTenant)); n != 1 {
		t.Errorf("A's log holds %d entries, want 1", n)
	}
}

// TestLimiter_AllowAt_typeDenialConsumesNoTenantQuota: a denial by the type-wide quota
// leaves the tenant logs alone.
func TestLimiter_AllowAt_typeDenialConsumesNoTenantQuota(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	typ, ten := typeQuota(2, time.Minute), tenantQuota(5, time.Minute)
	req := func(tenant string) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: tenant}, Quotas: []throttle.Quota{ten, typ}}
	}
	wantOutcome(t, l, req("x"), 0, outcome{Allowed: true, Quota: typ, Count: 1, Remaining: 1, At: 0})
	wantOutcome(t, l, req("y"), 1, outcome{Allowed: true, Quota: typ, Count: 2, Remaining: 0, At: 1})
	wantOutcome(t, l, req("z"), 2, outcome{Quota: typ, Count: 2, RetryAfter: msd(60000 - 2), At: 2})
	wantOutcome(t, l, req("x"), 3, outcome{Quota: typ, Count: 2, RetryAfter: msd(60000 - 3), At: 3})
	for tenant, want := range map[string]int64{"x": 1, "y": 1, "z": 0} {
		if n := zcard(t, rdb, l.RedisKey(req(tenant).Key, throttle.ScopeTenant)); n != want {
			t.Errorf("tenant %s's log holds %d entries, want %d", tenant, n, want)
		}
	}
	// Once the type window slides past x's entry, z is admitted into both logs.
	wantOutcome(t, l, req("z"), 60000, outcome{Allowed: true, Quota: typ, Count: 2, Remaining: 0, At: 60000})
}

// TestLimiter_AllowAt_twoWindowsOneLog: 10/1s and 15/1m per tenant share one log; a
// denial waits until every quota has room. The quota it names is the one that needs the
// longest wait: the first (in the request's order) with no room a millisecond before the
// instant it waits for, whichever is listed first. Logs are trimmed at the high-water instant minus the longest window:
// v1's trim grace of 2s kept entries for 2s longer.
func TestLimiter_AllowAt_twoWindowsOneLog(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	perSec, perMin := tenantQuota(10, time.Second), tenantQuota(15, time.Minute)
	tests := []struct {
		name   string
		quotas []throttle.Quota
		burst  int64 // 5 admissions at 0..4 ms, then 10 at burst..burst+9
		at     int64
		want   outcome
		// at At+RetryAfter-1 still denied with 1ms by wantLast; at At+RetryAfter
		// admitted, leaving wantZCard entries: the fast path trims by the longest window
		// once K_TRIM (8) entries have left it, so the 1 or 5 that have stay
		wantLast  throttle.Quota
		wantZCard int64
	}{
		{
			// Both windows are full at 5010; the later room names the denial. 1s:
			// 5000+1000-5010 = 990; 1m: 0+60000-5010 = 54990, the later.
			name: "MinuteBinds", quotas: []throttle.Quota{perSec, perMin}, burst: 5000, at: 5010,
			want:     outcome{Quota: perMin, Count: 15, RetryAfter: msd(54990), At: 5010},
			wantLast: perMin, wantZCard: 16, // 0..4, 5000..5009, 60000: 0 has left, untrimmed
		},
		{
			name: "MinuteBindsListedFirst", quotas: []throttle.Quota{perMin, perSec}, burst: 5000, at: 5010,
			want:     outcome{Quota: perMin, Count: 15, RetryAfter: msd(54990), At: 5010},
			wantLast: perMin, wantZCard: 16,
		},
		{
			// 1s: 59500+1000-59510 = 990, the later; 1m: 0+60000-59510 = 490.
			name: "SecondBinds", quotas: []throttle.Quota{perSec, perMin}, burst: 59500, at: 59510,
			want:     outcome{Quota: perSec, Count: 10, RetryAfter: msd(990), At: 59510},
			wantLast: perSec, wantZCard: 16, // 0..4, 59500..59509, 60500: 0..4 have left, untrimmed
		},
		{
			name: "SecondBindsListedLast", quotas: []throttle.Quota{perMin, perSec}, burst: 59500, at: 59510,
			want:     outcome{Quota: perSec, Count: 10, RetryAfter: msd(990), At: 59510},
			wantLast: perSec, wantZCard: 16,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: t.Name()}, Quotas: tc.quotas}
			for at := int64(0); at < 5; at++ {
				mustAdmit(t, l, req, at)
			}
			for at := tc.burst; at < tc.burst+10; at++ {
				mustAdmit(t, l, req, at)
			}
			d := wantOutcome(t, l, req, tc.at, tc.want)
			retryAt := d.RetryAt().UnixMilli()
			if d := allowAt(t, l, req, retryAt-1); d.Allowed || d.RetryAfter != time.Millisecond || d.Quota != tc.wantLast {
				t.Errorf("t=%d: got %s, want a denial by %s with RetryAfter 1ms", retryAt-1, outcomeOf(d), tc.wantLast)
			}
			mustAdmit(t, l, req, retryAt)
			if n := zcard(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant)); n != tc.wantZCard {
				t.Errorf("the log holds %d entries, want %d: %v", n, tc.wantZCard, entriesOf(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant)))
			}
		})
	}
}

// TestLimiter_AllowAt_replay checks contract rule 7: the same Member never takes a second
// slot, and a denial replayed is still a denial. A replay reports the admission it
// replays: At is that admission's instant, and Count and Remaining are its window's.
// One entry per event whatever its cost: a cost-2 admission is one entry "*2:<member>".
func TestLimiter_AllowAt_replay(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(3, time.Second)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	log := l.RedisKey(key, throttle.ScopeTenant)
	req := func(member string, cost int) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: member, Cost: cost}
	}
	steps := []struct {
		name    string
		req     throttle.Request
		at      int64
		want    outcome
		entries map[string]int64
	}{
		{"Admit", req("evt-1", 0), 1000, outcome{Allowed: true, Quota: q, Count: 1, Remaining: 2, At: 1000}, map[string]int64{"evt-1": 1000}},
		{"ReplaySameInstant", req("evt-1", 0), 1000, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, Remaining: 2, At: 1000}, map[string]int64{"evt-1": 1000}},
		{"ReplayLater", req("evt-1", 0), 1500, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, Remaining: 2, At: 1000}, map[string]int64{"evt-1": 1000}},
		{"FillUp", req("evt-2", 2), 1600, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, At: 1600}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		{"ReplayCost2", req("evt-2", 2), 1650, outcome{Allowed: true, Replay: true, Quota: q, Count: 3, At: 1600}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		// The window ending at evt-1's instant held only evt-1.
		{"ReplayWhenFull", req("evt-1", 0), 1700, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, Remaining: 2, At: 1000}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		{"Deny", req("evt-3", 0), 1700, outcome{Quota: q, Count: 3, RetryAfter: msd(300), At: 1700}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		{"DenialReplayed", req("evt-3", 0), 1700, outcome{Quota: q, Count: 3, RetryAfter: msd(300), At: 1700}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		{"DenialReplayedLater", req("evt-3", 0), 1800, outcome{Quota: q, Count: 3, RetryAfter: msd(200), At: 1800}, map[string]int64{"evt-1": 1000, "*2:evt-2": 1600}},
		// evt-1 (t=1000) left the window and is trimmed (v1 kept it for its 2s grace).
		{"DeniedMemberAdmittedLater", req("evt-3", 0), 2000, outcome{Allowed: true, Quota: q, Count: 3, At: 2000}, map[string]int64{"*2:evt-2": 1600, "evt-3": 2000}},
		{"ThenReplay", req("evt-3", 0), 2001, outcome{Allowed: true, Replay: true, Quota: q, Count: 3, At: 2000}, map[string]int64{"*2:evt-2": 1600, "evt-3": 2000}},
		// A log remembers its longest window only: evt-1, trimmed, is a new event again
		// (and the window is full).
		{"TrimmedMemberIsNew", req("evt-1", 0), 2002, outcome{Quota: q, Count: 3, RetryAfter: msd(1600 + 1000 - 2002), At: 2002}, map[string]int64{"*2:evt-2": 1600, "evt-3": 2000}},
	}
	for _, s := range steps {
		wantOutcome(t, l, s.req, s.at, s.want)
		if got := entriesOf(t, rdb, log); fmt.Sprint(got) != fmt.Sprint(s.entries) {
			t.Errorf("%s: the log holds %v, want %v", s.name, got, s.entries)
		}
	}
	// The replay check looks in the log of the longest window, whichever quota is listed
	// first: a type-wide hour beside a tenant's minute. evt-10 to evt-17, a minute apart,
	// push evt-9 out of the tenant's minute; the fast path trims once K_TRIM (8) entries
	// have left it, at evt-17, so the tenant's log then holds evt-17 alone. The type's
	// still holds evt-9, so evt-9 again is a replay (and not a denial by the tenant's full
	// minute). Its counts are those of the window ending at 1000 now: the tenant's is empty.
	quotas := []throttle.Quota{tenantQuota(1, time.Minute), typeQuota(20, time.Hour)}
	other := throttle.Request{Key: throttle.Key{TaskType: "replay:two", Tenant: "b"}, Quotas: quotas, Member: "evt-9"}
	mustAdmit(t, l, other, 1000)
	for i := range 8 {
		next := other
		next.Member = "evt-" + strconv.Itoa(10+i)
		mustAdmit(t, l, next, 65_000+60_000*int64(i))
	}
	if got := entriesOf(t, rdb, l.RedisKey(other.Key, throttle.ScopeTenant)); fmt.Sprint(got) != fmt.Sprint(map[string]int64{"evt-17": 485_000}) {
		t.Errorf("the tenant's log holds %v, want only evt-17: the check below cannot fail", got)
	}
	wantOutcome(t, l, other, 490_000, outcome{Allowed: true, Replay: true, Quota: quotas[0], Count: 0, Remaining: 1, At: 1000})
}

// TestLimiter_AllowAt_replayNeedsSameMember: a Member that was never admitted is not a
// replay, whatever the entries an admission of cost > 1 wrote for another member ("*2:
// task-7"), and the same Member with another cost is another call.
func TestLimiter_AllowAt_replayNeedsSameMember(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(2, time.Minute)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "task-7", Cost: 2}, 1000)
	for _, r := range []struct {
		member string
		cost   int
	}{{"task-7#2", 1}, {"2:task-7", 1}, {"task-7", 1}, {"task-", 2}, {"task-7:2", 2}} {
		// An asynq TaskID may contain '#' or ':': the log is full for these others.
		wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: r.member, Cost: r.cost}, 1001,
			outcome{Quota: q, Count: 2, RetryAfter: msd(59999), At: 1001})
	}
	if got := entriesOf(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); fmt.Sprint(got) != fmt.Sprint(map[string]int64{"*2:task-7": 1000}) {
		t.Errorf("the log holds %v, want only *2:task-7 at 1000", got)
	}
}

// TestLimiter_AllowAt_callerBehind: a caller whose clock is behind the log's high-water
// instant (the latest instant a write was decided at) is decided at that instant, so
// entries logged by a caller ahead count for it, its retry-after counts from its own
// clock and is exact (contract rule 8). v1 decided at the caller's clock with the same
// retry-after; At now says where the decision was made.
func TestLimiter_AllowAt_callerBehind(t *testing.T) {
	t.Parallel()
	q := msQuota(throttle.ScopeTenant, 1, 1000)
	checkSequence(t, []modelStep{
		{at: 5000, tenant: "acme", quotas: []throttle.Quota{q}, want: &modelDecision{Allowed: true, Quota: q, Count: 1, At: 5000}},
		{at: 1000, tenant: "acme", quotas: []throttle.Quota{q}, want: &modelDecision{Quota: q, Count: 1, RetryAfter: msd(5000), At: 5000}},
		{at: 5999, tenant: "acme", quotas: []throttle.Quota{q}, want: &modelDecision{Quota: q, Count: 1, RetryAfter: msd(1), At: 5999}},
		{at: 6000, tenant: "acme", quotas: []throttle.Quota{q}, want: &modelDecision{Allowed: true, Quota: q, Count: 1, At: 6000}},
		// Behind again, with room at the high-water instant 6000 for a quota of 2: admitted
		// there, Delay 1000ms after its own clock, and logged at 6000, not 5000.
		{at: 5000, tenant: "acme", quotas: []throttle.Quota{msQuota(throttle.ScopeTenant, 2, 1000)},
			want: &modelDecision{Allowed: true, Quota: msQuota(throttle.ScopeTenant, 2, 1000), Count: 2, Delay: msd(1000), At: 6000}},
	})
}

func TestLimiter_Allow_clock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := tenantQuota(100, time.Hour)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	// loggedAt is the score of the only entry in req's log.
	loggedAt := func(t *testing.T, l *throttle.Limiter, rdb *redis.Client) int64 {
		t.Helper()
		e := entriesOf(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant))
		if len(e) != 1 {
			t.Fatalf("log holds %v, want one entry", e)
		}
		for _, at := range e {
			return at
		}
		return 0
	}

	t.Run("Redis", func(t *testing.T) {
		t.Parallel()
		l, rdb := newLimiterClient(t, throttle.Config{Clock: throttle.ClockRedis,
			NowFunc: func() time.Time { return ms(5000) }}) // ignored
		d, err := l.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		server, err := rdb.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if !d.Allowed || d.Delay != 0 || d.At.After(server) || server.Sub(d.At) > time.Second {
			t.Errorf("Decision %s, want admitted now, within 1s before the server's TIME %v", outcomeOf(d), server)
		}
		if d.Skew() != 0 || !d.ServerTime.Equal(d.At) || !d.RetryAt().Equal(d.At) {
			t.Errorf("Skew() = %v, At %v, ServerTime %v, RetryAt %v: want 0 and all three equal", d.Skew(), d.At, d.ServerTime, d.RetryAt())
		}
		if got := loggedAt(t, l, rdb); got != d.At.UnixMilli() {
			t.Errorf("entry logged at %d ms, want At = %d", got, d.At.UnixMilli())
		}
		// A denial's RetryAt counts from the server's TIME, the clock it was decided by.
		one := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "one"}, Quotas: []throttle.Quota{tenantQuota(1, time.Hour)}}
		if d, err := l.Allow(ctx, one); err != nil || !d.Allowed {
			t.Fatalf("first of one per hour: %+v, %v", d, err)
		}
		d2, err := l.Allow(ctx, one)
		if err != nil || d2.Allowed || !d2.RetryAt().Equal(d2.ServerTime.Add(d2.RetryAfter)) || d2.RetryAfter > time.Hour || d2.RetryAfter < time.Hour-time.Second {
			t.Errorf("second of one per hour: %s, RetryAt %v, ServerTime %v, %v; want a denial for about an hour from ServerTime",
				outcomeOf(d2), d2.RetryAt(), d2.ServerTime, err)
		}
	})
	t.Run("RedisAllowAtUsesItsTime", func(t *testing.T) {
		t.Parallel()
		l, rdb := newLimiterClient(t, throttle.Config{Clock: throttle.ClockRedis})
		mustAdmit(t, l, req, 7000)
		if got := loggedAt(t, l, rdb); got != 7000 {
			t.Errorf("entry logged at %d ms, want 7000", got)
		}
	})
	t.Run("LocalNowFunc", func(t *testing.T) {
		t.Parallel()
		// A fixed instant close to the real one, 0.999ms past a whole millisecond.
		fixed := time.UnixMilli(time.Now().UnixMilli()).Add(999 * time.Microsecond)
		l, rdb := newLimiterClient(t, throttle.Config{NowFunc: func() time.Time { return fixed }})
		d, err := l.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		want := fixed.UnixMilli() // truncated
		if !d.Allowed || !d.At.Equal(ms(want)) || d.Delay != 0 || d.SkewFallback {
			t.Errorf("Decision %s, want admitted at NowFunc's %d ms", outcomeOf(d), want)
		}
		if got := loggedAt(t, l, rdb); got != want {
			t.Errorf("entry logged at %d ms, want %d", got, want)
		}
		if got, wantSkew := d.Skew(), ms(want).Sub(d.ServerTime); got != wantSkew {
			t.Errorf("Skew() = %v, want NowFunc - ServerTime = %v", got, wantSkew)
		}
	})
	// A clock 10 minutes ahead is further than MaxSkew (1s) from the server's: the script
	// decides and logs by the server's TIME and says so; Skew still reports the local clock.
	t.Run("LocalAheadFallsBackToRedis", func(t *testing.T) {
		t.Parallel()
		const ahead = 10 * time.Minute
		l, rdb := newLimiterClient(t, throttle.Config{NowFunc: func() time.Time { return time.Now().Add(ahead) }})
		d, err := l.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if skew := d.Skew(); skew < ahead-time.Second || skew > ahead+time.Second {
			t.Errorf("Skew() = %v, want within 1s of %v", skew, ahead)
		}
		if !d.SkewFallback || !d.At.Equal(d.ServerTime) || d.Delay != 0 {
			t.Errorf("SkewFallback = %v, At %v, ServerTime %v, Delay %v: want the decision made at the server's TIME", d.SkewFallback, d.At, d.ServerTime, d.Delay)
		}
		if got := loggedAt(t, l, rdb); got != d.ServerTime.UnixMilli() {
			t.Errorf("entry logged at %d ms, want the server's TIME %d", got, d.ServerTime.UnixMilli())
		}
	})
	// Within MaxSkew the local clock is trusted: 500ms ahead is decided and logged at the
	// local time. MaxSkew < 0 turns the check off: 10 minutes ahead is trusted too.
	t.Run("LocalWithinMaxSkewOrCheckOff", func(t *testing.T) {
		t.Parallel()
		for _, c := range []struct {
			ahead   time.Duration
			maxSkew time.Duration
		}{{500 * time.Millisecond, 0}, {10 * time.Minute, -1}} {
			local := time.Now().Add(c.ahead).Truncate(time.Millisecond)
			l, rdb := newLimiterClient(t, throttle.Config{MaxSkew: c.maxSkew, NowFunc: func() time.Time { return local }})
			d, err := l.Allow(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			if d.SkewFallback || !d.At.Equal(local) || loggedAt(t, l, rdb) != local.UnixMilli() {
				t.Errorf("ahead %v, MaxSkew %v: SkewFallback %v, At %v; want the local time %v", c.ahead, c.maxSkew, d.SkewFallback, d.At, local)
			}
		}
	})
	// Two workers within MaxSkew of the server, one 400ms ahead of the other: the one
	// behind is decided at the instant the one ahead wrote the log (its high-water), so it
	// is admitted with a Delay of 400ms on its own clock, and logged at that instant: the
	// window log is never written behind a window another call has trimmed.
	t.Run("LocalBehindHighWater", func(t *testing.T) {
		t.Parallel()
		rdb := redistest.Start(t)
		base := time.Now().Truncate(time.Millisecond)
		ahead, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return base.Add(400 * time.Millisecond) }})
		if err != nil {
			t.Fatal(err)
		}
		behind, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return base }})
		if err != nil {
			t.Fatal(err)
		}
		d1, err := ahead.Allow(ctx, req)
		if err != nil || !d1.Allowed || !d1.At.Equal(base.Add(400*time.Millisecond)) || d1.SkewFallback {
			t.Fatalf("the worker ahead: %s, SkewFallback %v, %v; want admitted at its own clock", outcomeOf(d1), d1.SkewFallback, err)
		}
		d2, err := behind.Allow(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if !d2.Allowed || !d2.At.Equal(d1.At) || d2.Delay != 400*time.Millisecond || !d2.RetryAt().Equal(d1.At) || d2.SkewFallback {
			t.Errorf("the worker behind: %s, RetryAt %v, SkewFallback %v; want admitted at %v with a Delay of 400ms",
				outcomeOf(d2), d2.RetryAt(), d2.SkewFallback, d1.At)
		}
		e := entriesOf(t, rdb, ahead.RedisKey(req.Key, throttle.ScopeTenant))
		if len(e) != 2 {
			t.Fatalf("log holds %v, want two entries", e)
		}
		for m, at := range e {
			if at != d1.At.UnixMilli() {
				t.Errorf("entry %s logged at %d, want %d, the high-water instant", m, at, d1.At.UnixMilli())
			}
		}
	})
}

// TestLimiter_AllowAt_limitChanged: a log written under one limit is read under another.
func TestLimiter_AllowAt_limitChanged(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	req := func(q throttle.Quota) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}}
	}
	for at := int64(100); at <= 500; at += 100 {
		mustAdmit(t, l, req(tenantQuota(5, time.Second)), at)
	}
	lower, longer, higher := tenantQuota(2, time.Second), tenantQuota(5, 2*time.Second), tenantQuota(6, time.Second)
	// count 5, limit 2: k = 5+1-2 = 4, the 4th oldest is 400: 400+1000-600.
	wantOutcome(t, l, req(lower), 600, outcome{Quota: lower, Count: 5, RetryAfter: msd(800), At: 600})
	wantOutcome(t, l, req(lower), 1399, outcome{Quota: lower, Count: 2, RetryAfter: msd(1), At: 1399})
	// A longer window: 100+2000-600. (The denials wrote nothing: the high-water is 500.)
	wantOutcome(t, l, req(longer), 600, outcome{Quota: longer, Count: 5, RetryAfter: msd(1500), At: 600})
	wantOutcome(t, l, req(higher), 600, outcome{Allowed: true, Quota: higher, Count: 6, At: 600})
	if n := zcard(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); n != 6 {
		t.Errorf("the log holds %d entries, want 6", n)
	}
	// A shorter window: at 1150 under 6/200ms the 6 entries at or before 950 have left
	// it. The fast path trims once K_TRIM (8) have: not yet, and they do not count.
	shorter := tenantQuota(6, 200*time.Millisecond)
	wantOutcome(t, l, req(shorter), 1150, outcome{Allowed: true, Quota: shorter, Count: 1, Remaining: 5, At: 1150})
	if n := zcard(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); n != 7 {
		t.Errorf("the log holds %d entries, want 7: 6 that left the window and the one at 1150", n)
	}
	wantOutcome(t, l, req(shorter), 1400, outcome{Allowed: true, Quota: shorter, Count: 1, Remaining: 5, At: 1400})
	wantOutcome(t, l, req(shorter), 1450, outcome{Allowed: true, Quota: shorter, Count: 2, Remaining: 4, At: 1450})
	// At 1700, 9 have left (100..600, 1150, 1400, 1450): the trim takes them all.
	wantOutcome(t, l, req(shorter), 1700, outcome{Allowed: true, Quota: shorter, Count: 1, Remaining: 5, At: 1700})
	if got := entriesOf(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); len(got) != 1 {
		t.Errorf("the log holds %v, want only the entry at 1700", got)
	}
}

// TestLimiter_AllowAt_redisDown checks that a Redis error is an error, never an admission.
func TestLimiter_AllowAt_redisDown(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t)
	l, err := throttle.New(srv.Client(), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{tenantQuota(5, time.Second)}}
	mustAdmit(t, l, req, 1000)
	srv.Stop()
	d, err := l.AllowAt(context.Background(), req, ms(2000))
	if err == nil || errors.Is(err, throttle.ErrInvalid) || d != (throttle.Decision{}) {
		t.Errorf("with Redis down: %+v, %v; want a zero Decision and a Redis error", d, err)
	}
	if err != nil && !strings.Contains(err.Error(), "api:call") {
		t.Errorf("error %q does not name the task type", err)
	}
	if ok, err := l.Release(context.Background(), "api:call", "token"); err == nil || ok {
		t.Errorf("Release with Redis down: %v, %v; want false and a Redis error", ok, err)
	}
	srv.Restart() // empty: the script is loaded again (NOSCRIPT -> EVAL)
	mustAdmit(t, l, req, 2000)
}
