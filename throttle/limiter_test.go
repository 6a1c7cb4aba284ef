package throttle_test

import (
	"context"
	"errors"
	"fmt"
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

func newLimiter(t *testing.T) *throttle.Limiter {
	t.Helper()
	l, _ := newLimiterClient(t, throttle.Config{})
	return l
}

// newLimiterClient starts a redis-server of the test's own and returns a Limiter on it
// and a client to inspect the server with.
func newLimiterClient(t *testing.T, cfg throttle.Config) (*throttle.Limiter, *redis.Client) {
	t.Helper()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l, rdb
}

func ms(n int64) time.Time { return time.UnixMilli(n) }

// msd is n milliseconds.
func msd(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

func tenantQuota(events int, window time.Duration) throttle.Quota {
	return throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: events, Window: window}}
}

func typeQuota(events int, window time.Duration) throttle.Quota {
	return throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: events, Window: window}}
}

// outcome is every field of a Decision except its instants, to compare with ==.
type outcome struct {
	Allowed, Replay        bool
	Quota                  throttle.Quota
	Count, Remaining       int
	RetryAfter, ResetAfter time.Duration
}

func outcomeOf(d throttle.Decision) outcome {
	return outcome{Allowed: d.Allowed, Replay: d.Replay, Quota: d.Quota, Count: d.Count,
		Remaining: d.Remaining, RetryAfter: d.RetryAfter, ResetAfter: d.ResetAfter}
}

// allowAt decides req at the instant at (ms since the epoch) and fails the test on an
// error. It checks that the decision is made for that instant.
func allowAt(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d, err := l.AllowAt(context.Background(), req, ms(at))
	if err != nil {
		t.Fatalf("AllowAt(%s/%q, t=%d): %v", req.Key.TaskType, req.Key.Tenant, at, err)
	}
	if !d.At.Equal(ms(at)) {
		t.Fatalf("t=%d: Decision.At = %d ms, want %d", at, d.At.UnixMilli(), at)
	}
	if want := d.At.Add(d.RetryAfter); !d.RetryAt().Equal(want) {
		t.Fatalf("t=%d: RetryAt = %v, want At+RetryAfter = %v", at, d.RetryAt(), want)
	}
	return d
}

// mustAdmit decides req at at and fails the test unless it is admitted.
func mustAdmit(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if !d.Allowed || d.RetryAfter != 0 {
		t.Fatalf("t=%d %s/%q: got %+v, want an admission", at, req.Key.TaskType, req.Key.Tenant, outcomeOf(d))
	}
	return d
}

// wantOutcome decides req at at and compares the whole outcome.
func wantOutcome(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64, want outcome) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if got := outcomeOf(d); got != want {
		t.Errorf("t=%d %s/%q cost %d:\n got %+v\nwant %+v", at, req.Key.TaskType, req.Key.Tenant, req.Cost, got, want)
	}
	return d
}

func zcard(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.ZCard(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func zsetOf(t *testing.T, rdb *redis.Client, key string) []redis.Z {
	t.Helper()
	z, err := rdb.ZRangeWithScores(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	return z
}

func pttl(t *testing.T, rdb *redis.Client, key string) time.Duration {
	t.Helper()
	d, err := rdb.PTTL(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// infoInt reads one integer field of INFO section.
func infoInt(t *testing.T, rdb *redis.Client, section, field string) int64 {
	t.Helper()
	s, err := rdb.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(s, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s: %s: %v", section, line, err)
			}
			return n
		}
	}
	t.Fatalf("INFO %s has no field %s", section, field)
	return 0
}

// dirty is the number of writes the server has made (it only grows: persistence is off).
func dirty(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	return infoInt(t, rdb, "persistence", "rdb_changes_since_last_save")
}

// commandsDuring returns how many commands the server processed while fn ran, not
// counting the INFO calls that measure it. Nothing else may use the server meanwhile.
func commandsDuring(t *testing.T, rdb *redis.Client, fn func()) int64 {
	t.Helper()
	first := infoInt(t, rdb, "stats", "total_commands_processed")
	before := infoInt(t, rdb, "stats", "total_commands_processed")
	infoCost := before - first
	fn()
	after := infoInt(t, rdb, "stats", "total_commands_processed")
	return after - before - infoCost
}

func TestLimiter_AllowAt_boundaryInstant(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	ctx := context.Background()
	req := throttle.Request{
		Key:    throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quotas: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Second}}},
	}
	steps := []struct {
		at        int64
		allowed   bool
		retryMS   int64
		remaining int
	}{
		{at: 1000, allowed: true, remaining: 0},
		{at: 1999, allowed: false, retryMS: 1, remaining: 0},
		{at: 2000, allowed: true, remaining: 0},
	}
	for _, s := range steps {
		d, err := l.AllowAt(ctx, req, ms(s.at))
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed != s.allowed || d.RetryAfter != time.Duration(s.retryMS)*time.Millisecond || d.Remaining != s.remaining {
			t.Errorf("t=%d: got allowed=%v retry=%v remaining=%d, want %v %vms %d", s.at, d.Allowed, d.RetryAfter, d.Remaining, s.allowed, s.retryMS, s.remaining)
		}
		if !d.At.Equal(ms(s.at)) {
			t.Errorf("t=%d: At = %v", s.at, d.At)
		}
	}
}

// TestLimiter_AllowAt_admitsUpToLimit counts admissions and checks Count, Remaining and
// ResetAfter as the window fills.
func TestLimiter_AllowAt_admitsUpToLimit(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	q := tenantQuota(3, time.Second)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: t.Name()}, Quotas: []throttle.Quota{q}}
	steps := []struct {
		at   int64
		want outcome
	}{
		{100, outcome{Allowed: true, Quota: q, Count: 1, Remaining: 2, ResetAfter: msd(1000)}},
		{200, outcome{Allowed: true, Quota: q, Count: 2, Remaining: 1, ResetAfter: msd(1000)}},
		{300, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, ResetAfter: msd(1000)}},
		{400, outcome{Quota: q, Count: 3, Remaining: 0, RetryAfter: msd(700), ResetAfter: msd(900)}},
		{1100, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, ResetAfter: msd(1000)}}, // 100 left the window
		{1250, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, ResetAfter: msd(1000)}}, // 200 too
		{1251, outcome{Quota: q, Count: 3, Remaining: 0, RetryAfter: msd(1300 - 1251), ResetAfter: msd(999)}},
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
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(100 + 1000 - 400), ResetAfter: msd(900)},
		},
		{
			name: "Cost2IsSecondOldest", setup: limit3, admits: []int64{100, 200, 300}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(200 + 1000 - 400), ResetAfter: msd(900)},
		},
		{
			name: "Cost3IsThirdOldest", setup: limit3, admits: []int64{100, 200, 300}, probe: limit3, cost: 3, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(300 + 1000 - 400), ResetAfter: msd(900)},
		},
		{
			name: "Cost2WithOneFree", setup: limit3, admits: []int64{100, 200}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 2, Remaining: 1, RetryAfter: msd(100 + 1000 - 400), ResetAfter: msd(800)},
		},
		{
			name: "SameScoreTwice", setup: limit3, admits: []int64{100, 100, 300}, probe: limit3, cost: 2, at: 400,
			want: outcome{Quota: limit3, Count: 3, RetryAfter: msd(100 + 1000 - 400), ResetAfter: msd(900)},
		},
		{
			// 100 was logged under a 5s window and is still in the log, but not in a 1s
			// window at 3600: the oldest entry that counts is 3000.
			name: "OnlyEntriesInWindowCount", setup: tenantQuota(3, 5*time.Second), admits: []int64{100, 3000, 3500},
			probe: tenantQuota(2, time.Second), cost: 1, at: 3600,
			want: outcome{Quota: tenantQuota(2, time.Second), Count: 2, RetryAfter: msd(3000 + 1000 - 3600), ResetAfter: msd(900)},
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
				t.Errorf("1ms before retry_after: got %+v, want a denial with RetryAfter 1ms", outcomeOf(d))
			}
			if d := allowAt(t, l, req, tc.at+retry); !d.Allowed {
				t.Errorf("at now+retry_after (t=%d): got %+v, want an admission", tc.at+retry, outcomeOf(d))
			}
		})
	}
}

// TestLimiter_AllowAt_denialWritesNothing checks contract rule 3 with the server's own
// count of writes, which every admission increases.
func TestLimiter_AllowAt_denialWritesNothing(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	full := throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(3, time.Minute), tenantQuota(2, time.Minute)}}
	logs := []string{l.RedisKey(key, throttle.ScopeTenant), l.RedisKey(key, throttle.ScopeType)}

	before := dirty(t, rdb)
	mustAdmit(t, l, full, 1000)
	if after := dirty(t, rdb); after <= before {
		t.Fatalf("rdb_changes_since_last_save went from %d to %d across an admission: the check below cannot fail", before, after)
	}
	mustAdmit(t, l, full, 2000)

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
		{"TypeFullForOtherTenant", throttle.Request{Key: other, Quotas: []throttle.Quota{typeQuota(2, time.Minute), tenantQuota(2, time.Minute)}}, 3003},
		{"SkewedCallerBehind", full, 1500},
	}
	for _, dn := range denials {
		sets := make([][]redis.Z, len(logs))
		ttls := make([]time.Duration, len(logs))
		for i, k := range logs {
			sets[i], ttls[i] = zsetOf(t, rdb, k), pttl(t, rdb, k)
		}
		writes := dirty(t, rdb)
		if d := allowAt(t, l, dn.req, dn.at); d.Allowed {
			t.Fatalf("%s: admitted, want a denial", dn.name)
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
		if n, err := rdb.Exists(context.Background(), l.RedisKey(other, throttle.ScopeTenant)).Result(); err != nil || n != 0 {
			t.Errorf("%s: the denied tenant's log exists (%d, %v)", dn.name, n, err)
		}
	}
}

// TestLimiter_AllowAt_ttl checks contract rule 6: PEXPIRE is relative to the server's real
// clock, so the script sets TTL = newest score + W - now + grace, W the longest window of
// a log and grace 2 x MaxSkew (2s by default), which keeps entries for callers behind.
func TestLimiter_AllowAt_ttl(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	const slack = time.Second // real time that passes between the script and PTTL
	const grace = 2 * throttle.DefaultMaxSkew
	tenant3per10s := tenantQuota(3, 10*time.Second)
	steps := []struct {
		name    string
		tenant  string
		quotas  []throttle.Quota
		at      int64
		allowed bool
		scope   throttle.Scope
		ttl     time.Duration // the TTL set when allowed; PTTL is within slack below it
	}{
		{"First", "a", []throttle.Quota{tenant3per10s}, 1000, true, throttle.ScopeTenant, 10 * time.Second},
		{"Second", "a", []throttle.Quota{tenant3per10s}, 5000, true, throttle.ScopeTenant, 10 * time.Second},
		// A caller whose clock is behind: the newest entry is 2s ahead of now.
		{"CallerBehind", "a", []throttle.Quota{tenant3per10s}, 3000, true, throttle.ScopeTenant, 12 * time.Second},
		{"Denied", "a", []throttle.Quota{tenant3per10s}, 3001, false, throttle.ScopeTenant, 12 * time.Second},
		{"LongestWindowOfLog", "b", []throttle.Quota{tenant3per10s, tenantQuota(5, time.Minute)}, 1000, true, throttle.ScopeTenant, time.Minute},
		{"TypeLog", "c", []throttle.Quota{tenant3per10s, typeQuota(100, time.Hour)}, 1000, true, throttle.ScopeType, time.Hour},
		{"TenantLogBesideType", "d", []throttle.Quota{tenant3per10s, typeQuota(100, time.Hour)}, 1000, true, throttle.ScopeTenant, 10 * time.Second},
	}
	var last time.Duration
	for _, s := range steps {
		key := throttle.Key{TaskType: "api:call", Tenant: s.tenant}
		d := allowAt(t, l, throttle.Request{Key: key, Quotas: s.quotas}, s.at)
		if d.Allowed != s.allowed {
			t.Fatalf("%s: Allowed = %v, want %v", s.name, d.Allowed, s.allowed)
		}
		got, want := pttl(t, rdb, l.RedisKey(key, s.scope)), s.ttl+grace
		if got > want || got < want-slack {
			t.Errorf("%s: PTTL = %v, want in [%v, %v]", s.name, got, want-slack, want)
		}
		if !s.allowed && got > last {
			t.Errorf("%s: PTTL went up across a denial: %v -> %v", s.name, last, got)
		}
		last = got
	}
}

// TestLimiter_keysAlwaysExpire runs a mix of requests and then checks that every key on
// the server is one of ours and has a TTL: none is left with TTL -1.
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
	want := map[string]bool{}
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
			for n, at := range []int64{1000, 1001, 1002, 500, 900_000, 1003} {
				member := fmt.Sprintf("%s/%q/m%d", key.TaskType, key.Tenant, n%4) // replays
				req := throttle.Request{Key: key, Quotas: quotas, Cost: 1 + n%2, Member: member}
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
						want[local.RedisKey(key, q.Scope)] = true
					}
					if dRemote.Allowed && !dRemote.Replay {
						want[remote.RedisKey(key, q.Scope)] = true
					}
				}
			}
		}
	}
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	var wantKeys []string
	for k := range want {
		wantKeys = append(wantKeys, k)
	}
	slices.Sort(wantKeys)
	if !slices.Equal(keys, wantKeys) {
		t.Errorf("keys on the server:\n got %q\nwant %q", keys, wantKeys)
	}
	for _, k := range keys {
		if ttl := pttl(t, rdb, k); ttl <= 0 {
			t.Errorf("PTTL %s = %v, want > 0", k, ttl)
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
			continue
		}
		denied++
		if want := (outcome{Quota: q, Count: 10, RetryAfter: time.Minute, ResetAfter: time.Minute}); outcomeOf(d) != want {
			t.Errorf("caller %d denied with %+v, want %+v", i, outcomeOf(d), want)
		}
	}
	if allowed != 10 || denied != 190 {
		t.Errorf("admitted %d and denied %d of %d, want 10 and 190", allowed, denied, callers)
	}
	if n := zcard(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant)); n != 10 {
		t.Errorf("ZCARD = %d, want 10", n)
	}
}

// TestLimiter_AllowAt_invalid checks contract rule 9: a request that can never be decided
// is an ErrInvalid error before any command reaches Redis.
func TestLimiter_AllowAt_invalid(t *testing.T) {
	t.Parallel()
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	good := tenantQuota(5, time.Second)
	tests := []struct {
		name     string
		req      throttle.Request
		costOver bool
	}{
		{name: "EventsZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(0, time.Second)}}},
		{name: "EventsNegative", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(-3, time.Second)}}},
		{name: "WindowZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 0)}}},
		{name: "WindowNegative", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, -time.Second)}}},
		{name: "WindowBelow1ms", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 500*time.Microsecond)}}},
		{name: "WindowNotWholeMS", req: throttle.Request{Key: key, Quotas: []throttle.Quota{tenantQuota(5, 1500*time.Microsecond)}}},
		{name: "SecondQuotaBad", req: throttle.Request{Key: key, Quotas: []throttle.Quota{good, typeQuota(5, 0)}}},
		{name: "CostNegative", req: throttle.Request{Key: key, Quotas: []throttle.Quota{good}, Cost: -1}},
		{name: "CostOverLimit", req: throttle.Request{Key: key, Quotas: []throttle.Quota{good}, Cost: 6}, costOver: true},
		{name: "CostOverSmallerQuota", req: throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(100, time.Minute), tenantQuota(2, time.Second)}, Cost: 3}, costOver: true},
		{name: "EmptyTaskType", req: throttle.Request{Key: throttle.Key{Tenant: "acme"}, Quotas: []throttle.Quota{good}}},
		{name: "NoQuotas", req: throttle.Request{Key: key}},
		{name: "EmptyQuotas", req: throttle.Request{Key: key, Quotas: []throttle.Quota{}}},
		{name: "ScopeZero", req: throttle.Request{Key: key, Quotas: []throttle.Quota{{Limit: good.Limit}}}},
		{name: "ScopeUnknown", req: throttle.Request{Key: key, Quotas: []throttle.Quota{{Scope: 3, Limit: good.Limit}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l, rdb := newLimiterClient(t, throttle.Config{})
			rdb.Ping(context.Background()) // open the connection the measurement uses
			var errAt, errNow error
			var dAt, dNow throttle.Decision
			n := commandsDuring(t, rdb, func() {
				dAt, errAt = l.AllowAt(context.Background(), tc.req, ms(1000))
				dNow, errNow = l.Allow(context.Background(), tc.req)
			})
			for _, err := range []error{errAt, errNow} {
				if !errors.Is(err, throttle.ErrInvalid) {
					t.Errorf("err = %v, want ErrInvalid", err)
				}
				if got := errors.Is(err, throttle.ErrCostOverLimit); got != tc.costOver {
					t.Errorf("errors.Is(%v, ErrCostOverLimit) = %v, want %v", err, got, tc.costOver)
				}
			}
			if dAt != (throttle.Decision{}) || dNow != (throttle.Decision{}) {
				t.Errorf("Decisions on error: %+v %+v, want zero", dAt, dNow)
			}
			if n != 0 {
				t.Errorf("the server processed %d commands for an invalid request, want 0", n)
			}
		})
	}
	t.Run("ValidRequestIsCounted", func(t *testing.T) { // the measurement above can fail
		t.Parallel()
		l, rdb := newLimiterClient(t, throttle.Config{})
		rdb.Ping(context.Background())
		n := commandsDuring(t, rdb, func() {
			if _, err := l.AllowAt(context.Background(), throttle.Request{Key: key, Quotas: []throttle.Quota{good}}, ms(1000)); err != nil {
				t.Error(err)
			}
		})
		if n < 1 {
			t.Errorf("the server processed %d commands for a valid request, want at least 1", n)
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
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	for prefix, want := range map[string]string{
		"":       "throttle:{api:call}:type",
		"app":    "app:{api:call}:type",
		"app:rl": "app:rl:{api:call}:type",
	} {
		l, err := throttle.New(rdb, throttle.Config{Prefix: prefix})
		if err != nil {
			t.Fatalf("New(Prefix %q): %v", prefix, err)
		}
		if got := l.RedisKey(key, throttle.ScopeType); got != want {
			t.Errorf("Prefix %q: RedisKey = %q, want %q", prefix, got, want)
		}
		mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{typeQuota(1, time.Minute)}}, 1000)
		if n := zcard(t, rdb, want); n != 1 {
			t.Errorf("Prefix %q: ZCARD %s = %d, want 1", prefix, want, n)
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

	wantOutcome(t, l, a, 0, outcome{Allowed: true, Quota: ten, Count: 1, Remaining: 0, ResetAfter: time.Minute})
	for at := int64(1); at < 20; at++ {
		wantOutcome(t, l, a, at, outcome{Quota: ten, Count: 1, RetryAfter: msd(60000 - at), ResetAfter: msd(60000 - at)})
	}
	if n := zcard(t, rdb, typeLog); n != 1 {
		t.Errorf("type log holds %d entries after A's 20 requests, want 1: denials consumed type quota", n)
	}
	wantOutcome(t, l, b, 100, outcome{Allowed: true, Quota: ten, Count: 1, Remaining: 0, ResetAfter: time.Minute})
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
	wantOutcome(t, l, req("x"), 0, outcome{Allowed: true, Quota: typ, Count: 1, Remaining: 1, ResetAfter: time.Minute})
	wantOutcome(t, l, req("y"), 1, outcome{Allowed: true, Quota: typ, Count: 2, Remaining: 0, ResetAfter: time.Minute})
	wantOutcome(t, l, req("z"), 2, outcome{Quota: typ, Count: 2, RetryAfter: msd(60000 - 2), ResetAfter: msd(60001 - 2)})
	wantOutcome(t, l, req("x"), 3, outcome{Quota: typ, Count: 2, RetryAfter: msd(60000 - 3), ResetAfter: msd(60001 - 3)})
	for tenant, want := range map[string]int64{"x": 1, "y": 1, "z": 0} {
		if n := zcard(t, rdb, l.RedisKey(req(tenant).Key, throttle.ScopeTenant)); n != want {
			t.Errorf("tenant %s's log holds %d entries, want %d", tenant, n, want)
		}
	}
	// Once the type window slides past x's entry, z is admitted into both logs.
	wantOutcome(t, l, req("z"), 60000, outcome{Allowed: true, Quota: typ, Count: 2, Remaining: 0, ResetAfter: time.Minute})
}

// TestLimiter_AllowAt_twoWindowsOneLog: 10/1s and 15/1m per tenant share one log; a
// denial waits until every quota has room and names the quota that needs the longest wait.
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
		// admitted, leaving wantZCard entries after the trim by the longest window + grace
		wantLast  throttle.Quota
		wantZCard int64
	}{
		{
			name: "MinuteBinds", quotas: []throttle.Quota{perSec, perMin}, burst: 5000, at: 5010,
			// 1s: 5000+1000-5010 = 990; 1m: 0+60000-5010 = 54990
			want:     outcome{Quota: perMin, Count: 15, RetryAfter: msd(54990), ResetAfter: msd(5009 + 60000 - 5010)},
			wantLast: perMin, wantZCard: 16, // 0..4 kept at 60000 by the 2s grace
		},
		{
			name: "MinuteBindsListedFirst", quotas: []throttle.Quota{perMin, perSec}, burst: 5000, at: 5010,
			want:     outcome{Quota: perMin, Count: 15, RetryAfter: msd(54990), ResetAfter: msd(5009 + 60000 - 5010)},
			wantLast: perMin, wantZCard: 16, // 0..4 kept at 60000 by the 2s grace
		},
		{
			name: "SecondBinds", quotas: []throttle.Quota{perSec, perMin}, burst: 59500, at: 59510,
			// 1s: 59500+1000-59510 = 990; 1m: 0+60000-59510 = 490
			want:     outcome{Quota: perSec, Count: 10, RetryAfter: msd(990), ResetAfter: msd(59509 + 60000 - 59510)},
			wantLast: perSec, wantZCard: 16, // 0..4 kept at 60500 by the 2s grace
		},
		{
			name: "SecondBindsListedLast", quotas: []throttle.Quota{perMin, perSec}, burst: 59500, at: 59510,
			want:     outcome{Quota: perSec, Count: 10, RetryAfter: msd(990), ResetAfter: msd(59509 + 60000 - 59510)},
			wantLast: perSec, wantZCard: 16, // 0..4 kept at 60500 by the 2s grace
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
				t.Errorf("t=%d: got %+v, want a denial by %s with RetryAfter 1ms", retryAt-1, outcomeOf(d), tc.wantLast)
			}
			mustAdmit(t, l, req, retryAt)
			if n := zcard(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant)); n != tc.wantZCard {
				t.Errorf("ZCARD = %d, want %d", n, tc.wantZCard)
			}
		})
	}
}

// TestLimiter_AllowAt_replay checks contract rule 7: the same Member never takes a second
// slot, and a denial replayed is still a denial.
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
		name  string
		req   throttle.Request
		at    int64
		want  outcome
		zcard int64
	}{
		{"Admit", req("evt-1", 0), 1000, outcome{Allowed: true, Quota: q, Count: 1, Remaining: 2, ResetAfter: msd(1000)}, 1},
		{"ReplaySameInstant", req("evt-1", 0), 1000, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, Remaining: 2, ResetAfter: msd(1000)}, 1},
		{"ReplayLater", req("evt-1", 0), 1500, outcome{Allowed: true, Replay: true, Quota: q, Count: 1, Remaining: 2, ResetAfter: msd(500)}, 1},
		{"FillUp", req("evt-2", 2), 1600, outcome{Allowed: true, Quota: q, Count: 3, Remaining: 0, ResetAfter: msd(1000)}, 3},
		{"ReplayCost2", req("evt-2", 2), 1650, outcome{Allowed: true, Replay: true, Quota: q, Count: 3, ResetAfter: msd(950)}, 3},
		{"ReplayWhenFull", req("evt-1", 0), 1700, outcome{Allowed: true, Replay: true, Quota: q, Count: 3, ResetAfter: msd(900)}, 3},
		{"Deny", req("evt-3", 0), 1700, outcome{Quota: q, Count: 3, RetryAfter: msd(300), ResetAfter: msd(900)}, 3},
		{"DenialReplayed", req("evt-3", 0), 1700, outcome{Quota: q, Count: 3, RetryAfter: msd(300), ResetAfter: msd(900)}, 3},
		{"DenialReplayedLater", req("evt-3", 0), 1800, outcome{Quota: q, Count: 3, RetryAfter: msd(200), ResetAfter: msd(800)}, 3},
		// evt-1 (t=1000) left the window but stays in the log for the 2s grace: ZCARD 4.
		{"DeniedMemberAdmittedLater", req("evt-3", 0), 2000, outcome{Allowed: true, Quota: q, Count: 3, ResetAfter: msd(1000)}, 4},
		{"ThenReplay", req("evt-3", 0), 2001, outcome{Allowed: true, Replay: true, Quota: q, Count: 3, ResetAfter: msd(999)}, 4},
	}
	for _, s := range steps {
		wantOutcome(t, l, s.req, s.at, s.want)
		if n := zcard(t, rdb, log); n != s.zcard {
			t.Errorf("%s: ZCARD = %d, want %d", s.name, n, s.zcard)
		}
	}
}

// TestLimiter_AllowAt_replayNeedsSameMember: a Member that was never admitted is not a
// replay, whatever the entries a cost > 1 admission wrote for another member.
func TestLimiter_AllowAt_replayNeedsSameMember(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(2, time.Minute)
	key := throttle.Key{TaskType: "api:call", Tenant: "acme"}
	mustAdmit(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "task-7", Cost: 2}, 1000)
	// "task-7#2" is a different event (an asynq TaskID may contain '#'): the log is full.
	wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "task-7#2"}, 1001,
		outcome{Quota: q, Count: 2, RetryAfter: msd(59999), ResetAfter: msd(59999)})
	if n := zcard(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); n != 2 {
		t.Errorf("ZCARD = %d, want 2", n)
	}
}

// TestLimiter_AllowAt_callerBehind: entries logged by a caller whose clock runs ahead count
// for a caller behind, and its retry-after is still positive and exact (contract rule 8).
func TestLimiter_AllowAt_callerBehind(t *testing.T) {
	t.Parallel()
	l := newLimiter(t)
	q := tenantQuota(1, time.Second)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	mustAdmit(t, l, req, 5000)
	wantOutcome(t, l, req, 1000, outcome{Quota: q, Count: 1, RetryAfter: msd(5000), ResetAfter: msd(5000)})
	wantOutcome(t, l, req, 5999, outcome{Quota: q, Count: 1, RetryAfter: msd(1), ResetAfter: msd(1)})
	mustAdmit(t, l, req, 6000)
}

func TestLimiter_Allow_clock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	q := tenantQuota(100, time.Hour)
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{q}}
	// loggedAt is the score of the only entry in req's log.
	loggedAt := func(t *testing.T, l *throttle.Limiter, rdb *redis.Client) int64 {
		t.Helper()
		z := zsetOf(t, rdb, l.RedisKey(req.Key, throttle.ScopeTenant))
		if len(z) != 1 {
			t.Fatalf("log holds %v, want one entry", z)
		}
		return int64(z[0].Score)
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
		if !d.Allowed || d.At.After(server) || server.Sub(d.At) > time.Second {
			t.Errorf("Decision %+v at %v, want admitted within 1s before the server's TIME %v", outcomeOf(d), d.At, server)
		}
		if d.Skew() != 0 || !d.ServerTime.Equal(d.At) {
			t.Errorf("Skew() = %v (At %v, ServerTime %v), want 0", d.Skew(), d.At, d.ServerTime)
		}
		if got := loggedAt(t, l, rdb); got != d.At.UnixMilli() {
			t.Errorf("entry logged at %d ms, want At = %d", got, d.At.UnixMilli())
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
		if !d.Allowed || !d.At.Equal(ms(want)) {
			t.Errorf("Decision %+v at %d ms, want admitted at NowFunc's %d ms", outcomeOf(d), d.At.UnixMilli(), want)
		}
		if got := loggedAt(t, l, rdb); got != want {
			t.Errorf("entry logged at %d ms, want %d", got, want)
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
		if !d.SkewFallback || !d.At.Equal(d.ServerTime) {
			t.Errorf("SkewFallback = %v, At %v, ServerTime %v: want the decision made at the server's TIME", d.SkewFallback, d.At, d.ServerTime)
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
	wantOutcome(t, l, req(lower), 600, outcome{Quota: lower, Count: 5, RetryAfter: msd(800), ResetAfter: msd(900)})
	wantOutcome(t, l, req(lower), 1399, outcome{Quota: lower, Count: 2, RetryAfter: msd(1), ResetAfter: msd(101)})
	// A longer window: 100+2000-600.
	wantOutcome(t, l, req(longer), 600, outcome{Quota: longer, Count: 5, RetryAfter: msd(1500), ResetAfter: msd(1900)})
	wantOutcome(t, l, req(higher), 600, outcome{Allowed: true, Quota: higher, Count: 6, ResetAfter: msd(1000)})
	if n := zcard(t, rdb, l.RedisKey(key, throttle.ScopeTenant)); n != 6 {
		t.Errorf("ZCARD = %d, want 6", n)
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
	srv.Restart() // empty: the script is loaded again (NOSCRIPT -> EVAL)
	mustAdmit(t, l, req, 2000)
}
