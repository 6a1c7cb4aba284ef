package throttle

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestClockCheck_estimate: a measure stamped after mono m0, the caller's clock at 1,000
// ms and the server's TIME at 900 ms, with a reply 4 ms after m0, says the caller is 100
// to 104 ms ahead, and each end of a range gives 1 ms more for the whole-ms instants
// (99 to 105). Within ClockCheckInterval it vouches for the clock it predicts while that
// whole range is within MaxSkew (1,000 ms), giving its upper end; a step of the caller's
// clock counts in full; an old (or future) measure vouches for nothing; a pause between
// the monotonic readings around the clock's read widens the range. A measure whose reply
// took longer than clockCheckMaxRTT (5 ms) vouches for nothing: one whose call waited
// 400 ms (the script ran late, the clock really 1.2 s ahead) would read 800 to 1,200 ms.
func TestClockCheck_estimate(t *testing.T) {
	var c clockCheck
	m0 := time.Unix(1000, 0)
	if skew, ok := c.estimate(m0, m0, 1_000, 1_000); ok || skew != 0 {
		t.Fatalf("no measure: %d, %v; want 0, false", skew, ok)
	}
	c.record(m0, 1_000, 900, 4*time.Millisecond)
	for _, tc := range []struct {
		name          string
		before, after time.Duration // mono since the measure, around the clock's read
		nowMS         int64
		wantSkew      int64
		wantOK        bool
	}{
		{"at once", 0, 0, 1_000, 105, true},
		{"with the server", 300 * time.Millisecond, 300 * time.Millisecond, 1_300, 105, true},
		{"behind by 50ms more", 300 * time.Millisecond, 300 * time.Millisecond, 1_250, 55, true},
		{"stepped ahead to the bound", 300 * time.Millisecond, 300 * time.Millisecond, 2_195, 1_000, true},
		{"stepped ahead past it", 300 * time.Millisecond, 300 * time.Millisecond, 2_196, 0, false},
		{"stepped behind to the bound", 300 * time.Millisecond, 300 * time.Millisecond, 201, -994, true},
		{"stepped behind past it", 300 * time.Millisecond, 300 * time.Millisecond, 200, 0, false},
		{"the last ms of the interval", ClockCheckInterval - time.Millisecond, ClockCheckInterval - time.Millisecond, 1_999, 105, true},
		{"interval over", ClockCheckInterval - time.Millisecond, ClockCheckInterval, 2_000, 0, false},
		{"a measure from the future", -time.Millisecond, 0, 1_000, 0, false},
		{"a 100ms pause around the read", 300 * time.Millisecond, 400 * time.Millisecond, 1_400, 205, true},
	} {
		if skew, ok := c.estimate(m0.Add(tc.before), m0.Add(tc.after), tc.nowMS, 1_000); skew != tc.wantSkew || ok != tc.wantOK {
			t.Errorf("%s: %d, %v; want %d, %v", tc.name, skew, ok, tc.wantSkew, tc.wantOK)
		}
	}
	// A clock 1,050 ms behind, read 100 ms into a pause: were the read's time taken as
	// the reading before it, it would seem 950 ms behind, within MaxSkew.
	c.record(m0, 1_000, 2_050, time.Millisecond)
	if skew, ok := c.estimate(m0.Add(10*time.Millisecond), m0.Add(110*time.Millisecond), 1_110, 1_000); ok || skew != 0 {
		t.Errorf("a clock 1050ms behind, read in a pause: %d, %v; want 0, false", skew, ok)
	}
	for _, rtt := range []time.Duration{400 * time.Millisecond, clockCheckMaxRTT + time.Microsecond} {
		c.record(m0, 1_000, 800, rtt) // 200 ms ahead at least: within MaxSkew by the low end
		if skew, ok := c.estimate(m0.Add(10*time.Millisecond), m0.Add(10*time.Millisecond), 1_010, 1_000); ok || skew != 0 {
			t.Errorf("after a call that waited %v: %d, %v; want 0, false", rtt, skew, ok)
		}
	}
	c.record(m0, 1_000, 800, clockCheckMaxRTT)
	if skew, ok := c.estimate(m0, m0, 1_000, 1_000); !ok || skew != 206 {
		t.Errorf("after a %v round trip: %d, %v; want 206, true", clockCheckMaxRTT, skew, ok)
	}
	c.record(m0, 1_000, 500, 1500*time.Microsecond) // 500 to 502 ms: the rtt rounded up, then 1 ms
	if skew, ok := c.estimate(m0, m0, 1_000, 1_000); !ok || skew != 503 {
		t.Errorf("after a 1.5ms round trip: %d, %v; want 503, true", skew, ok)
	}
}

// TestLimiter_Allow_clockCheck: Allow reads the server's TIME (INFO commandstats) on its
// first write, then vouches for its clock for ClockCheckInterval of the process's
// monotonic clock (stepped here) without it, giving the estimated ServerTime and Skew; a
// step of the caller's clock past MaxSkew is checked at once (and falls back), and a
// measure older than the interval is taken again.
func TestLimiter_Allow_clockCheck(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t)
	base := time.Now().Truncate(time.Millisecond)
	mono0 := time.Now()
	var nowOff, monoOff time.Duration
	l, err := New(rdb, Config{NowFunc: func() time.Time { return base.Add(nowOff) }})
	if err != nil {
		t.Fatal(err)
	}
	l.mono = func() time.Time { return mono0.Add(monoOff) }
	req := Request{Key: Key{TaskType: "clock:check", Tenant: "acme"}, Quotas: []Quota{{Scope: ScopeTenant, Limit: Limit{Events: 100, Window: time.Second}}}}
	step := func(now, mono time.Duration, wantTimes int, wantFallback bool) Decision {
		t.Helper()
		nowOff, monoOff = now, mono
		d, err := l.Allow(ctx, req)
		if err != nil || !d.Allowed || d.SkewFallback != wantFallback {
			t.Fatalf("now +%v, mono +%v: %+v, %v; want admitted, SkewFallback %v", now, mono, d, err, wantFallback)
		}
		if got := timeCalls(t, rdb); got != wantTimes {
			t.Errorf("now +%v, mono +%v: %d TIME calls in all, want %d", now, mono, got, wantTimes)
		}
		return d
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	d1 := step(0, 0, 1, false) // no measure yet: the script checks
	d2 := step(400*time.Millisecond, 400*time.Millisecond, 1, false)
	// The measure's skew, and 1 ms for its whole-ms instants (its round trip: 0 here).
	if want := d1.Skew() + time.Millisecond; d2.Skew() != want || !d2.ServerTime.Equal(base.Add(400*time.Millisecond).Add(-want)) {
		t.Errorf("vouched: Skew %v, ServerTime %v; want %v and %v", d2.Skew(), d2.ServerTime, want, base.Add(400*time.Millisecond).Add(-want))
	}
	// A step 3s ahead: checked at once, and falling back, the fast path's check and then
	// the general path's each read TIME.
	step(3400*time.Millisecond, 450*time.Millisecond, 3, true)
	// That measure, 3s ahead, sees the clock step back into line: vouched again.
	step(460*time.Millisecond, 460*time.Millisecond, 3, false)
	step(470*time.Millisecond, 470*time.Millisecond, 3, false)
	step(480*time.Millisecond, 450*time.Millisecond+ClockCheckInterval, 4, false) // a second after it
	step(490*time.Millisecond, 460*time.Millisecond+ClockCheckInterval, 4, false)
}

// TestLimiter_Allow_clockCheckSlowReply: a measure whose reply took long vouches for
// nothing, however small its skew looked. The caller's clock is 800 ms ahead of the
// server's and its first write's reply comes 400 ms (of the stepped monotonic clock)
// after its stamp, past clockCheckMaxRTT (and the clock may be up to 1.2 s ahead, past
// MaxSkew), so the next
// write, stamped at once, is checked by the script again (TIME read: 2 in all; 800 ms is
// within MaxSkew, no fallback), where a measure taken as a point would have vouched.
func TestLimiter_Allow_clockCheckSlowReply(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t)
	ahead := time.Now().Add(800 * time.Millisecond).Truncate(time.Millisecond)
	mono0 := time.Now()
	reads := 0 // Allow reads l.mono before and after the stamp, and after the reply
	l, err := New(rdb, Config{NowFunc: func() time.Time { return ahead }})
	if err != nil {
		t.Fatal(err)
	}
	l.mono = func() time.Time { // every reading at mono0, the clock never moved since
		reads++
		if reads == 3 { // the first call's reply (before the stamp, after it, after the reply)
			return mono0.Add(400 * time.Millisecond)
		}
		return mono0
	}
	req := Request{Key: Key{TaskType: "clock:slow", Tenant: "acme"}, Quotas: []Quota{{Scope: ScopeTenant, Limit: Limit{Events: 100, Window: time.Second}}}}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for i, want := range []int{1, 2} {
		d, err := l.Allow(ctx, req)
		if err != nil || !d.Allowed || d.SkewFallback {
			t.Fatalf("call %d: %+v, %v; want admitted by the caller's clock", i+1, d, err)
		}
		if got := timeCalls(t, rdb); got != want {
			t.Errorf("call %d: %d TIME calls in all, want %d", i+1, got, want)
		}
	}
}

// TestNew_clockCheckOffOnCluster: a Limiter on a *redis.ClusterClient checks every write
// with TIME (each master has its own clock); on one node it vouches; with a negative
// MaxSkew it never checks.
func TestNew_clockCheckOffOnCluster(t *testing.T) {
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	defer cluster.Close()
	node := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer node.Close()
	for _, tc := range []struct {
		name      string
		rdb       redis.UniversalClient
		maxSkew   time.Duration
		wantVouch bool
		wantArg   string
	}{
		{"cluster", cluster, 0, false, "1000"},
		{"node", node, 0, true, "1000"},
		{"node, 250ms", node, 250 * time.Millisecond, true, "250"},
		{"node, no check", node, -1, false, "0"},
	} {
		l, err := New(tc.rdb, Config{MaxSkew: tc.maxSkew})
		if err != nil {
			t.Fatal(err)
		}
		if l.vouch != tc.wantVouch || l.skewArg != tc.wantArg || l.vouchArg != "~"+tc.wantArg {
			t.Errorf("%s: vouch %v, ARGV[4] %q or %q; want %v, %q or %q", tc.name, l.vouch, l.skewArg, l.vouchArg, tc.wantVouch, tc.wantArg, "~"+tc.wantArg)
		}
	}
}

// timeCalls is the server's count of TIME commands (scripts' included) since CONFIG
// RESETSTAT.
func timeCalls(t *testing.T, rdb *redis.Client) int {
	t.Helper()
	st, err := redistest.ReadStats(context.Background(), rdb)
	if err != nil {
		t.Fatal(err)
	}
	return int(st.Command("time").Calls)
}
