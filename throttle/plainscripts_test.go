package throttle_test

import (
	"context"
	_ "embed"
	"slices"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// The plain scripts of the benchmark's rows (c0), (d0) and (e0): fixtures, not product
// code, checked here so that the yardsticks the README quotes decide what they say they do.

//go:embed testdata/plain_quotas.lua
var plainQuotasSrc string

//go:embed testdata/plain_reserve.lua
var plainReserveSrc string

// TestPlainQuotas_decides: a tenant quota of 3/1h and 2/1s and a type quota of 3/1s, on
// two keys, explicit times. Tenant a at 1000 and 1001 is admitted on both keys; at 1002
// its 1 s quota (the second) has no room; tenant b at 1002 is admitted (the type key then
// holds 3); tenant c at 1003 is denied by the type quota (the third); tenant a at 2001
// (its 1000 has left the 1 s window, the type's too) is admitted, and at 2002 its 1 h
// quota (the first) is full. Tenant e at 5000 and 5500 is admitted, and at 6000 too: its
// 1 s window (5000, 6000] leaves 5000 out. The keys then hold a's 1000, 1001 and 2001,
// e's three, and the type's 5500 and 6000 (each call trims the type key by its 1 s window:
// 5000 goes at 6000), with TTLs of the key's longest window.
func TestPlainQuotas_decides(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	ctx := context.Background()
	script := redis.NewScript(plainQuotasSrc)
	call := func(tenant string, now int64, member string) []int64 {
		t.Helper()
		r, err := script.Run(ctx, rdb, []string{"plain:" + tenant, "plain:type"}, now, member,
			3, 3600000, 1, 2, 1000, 1, 3, 1000, 2).Int64Slice()
		if err != nil {
			t.Fatalf("%s at %d: %v", tenant, now, err)
		}
		return r
	}
	steps := []struct {
		tenant string
		now    int64
		want   []int64
	}{
		{"a", 1000, []int64{1}},
		{"a", 1001, []int64{1}},
		{"a", 1002, []int64{0, 2}},
		{"b", 1002, []int64{1}},
		{"c", 1003, []int64{0, 3}},
		{"a", 2001, []int64{1}},
		{"a", 2002, []int64{0, 1}},
		{"e", 5000, []int64{1}},
		{"e", 5500, []int64{1}},
		{"e", 6000, []int64{1}},
	}
	for i, s := range steps {
		if got := call(s.tenant, s.now, "m"+string(rune('0'+i))); !slices.Equal(got, s.want) {
			t.Errorf("step %d: %s at %d: %v, want %v", i, s.tenant, s.now, got, s.want)
		}
	}
	for key, want := range map[string][]string{"plain:a": {"m0", "m1", "m5"}, "plain:e": {"m7", "m8", "m9"}, "plain:type": {"m8", "m9"}} {
		got, err := rdb.ZRange(ctx, key, 0, -1).Result()
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("%s holds %v (%v), want %v", key, got, err, want)
		}
	}
	for key, want := range map[string]int64{"plain:e": 3600000, "plain:type": 1000} {
		if ttl, err := rdb.PTTL(ctx, key).Result(); err != nil || ttl.Milliseconds() > want || ttl.Milliseconds() < want-100 {
			t.Errorf("%s: PTTL %v (%v), want at most %d ms and more than %d", key, ttl, err, want, want-100)
		}
	}
}

// TestPlainReserve_reserves: limit 2/1s, explicit times. a1 at 1000 and a2 at 1001 are
// admitted; x at 1002 reserves 2000 (a1's 1000 leaving the window), y at 1003 reserves
// 2001 (a2's 1001), z at 1004 reserves 3000 (x's 2000), and x again is a claim (-1, not
// timed by the benchmark). Each reservation is a log entry "@<token>", a pending entry
// and a lease, and the keys' TTLs reach the latest instant plus the window.
func TestPlainReserve_reserves(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	ctx := context.Background()
	script := redis.NewScript(plainReserveSrc)
	keys := []string{"plain:log", "plain:pending", "plain:leases"}
	steps := []struct {
		token string
		now   int64
		want  []int64
	}{
		{"a1", 1000, []int64{1, 0}},
		{"a2", 1001, []int64{1, 0}},
		{"x", 1002, []int64{0, 2000}},
		{"y", 1003, []int64{0, 2001}},
		{"z", 1004, []int64{0, 3000}},
		{"x", 1005, []int64{0, -1}},
	}
	for _, s := range steps {
		got, err := script.Run(ctx, rdb, keys, s.now, 1000, 2, s.token).Int64Slice()
		if err != nil || !slices.Equal(got, s.want) {
			t.Errorf("%s at %d: %v (%v), want %v", s.token, s.now, got, err, s.want)
		}
	}
	log, err := rdb.ZRangeWithScores(ctx, "plain:log", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	want := []redis.Z{{Score: 1000, Member: "@a1"}, {Score: 1001, Member: "@a2"}, {Score: 2000, Member: "@x"}, {Score: 2001, Member: "@y"}, {Score: 3000, Member: "@z"}}
	if !slices.Equal(log, want) {
		t.Errorf("the log holds %v, want %v", log, want)
	}
	pending, err := rdb.ZRangeWithScores(ctx, "plain:pending", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if want := []redis.Z{{Score: 2000, Member: "x"}, {Score: 2001, Member: "y"}, {Score: 3000, Member: "z"}}; !slices.Equal(pending, want) {
		t.Errorf("the pending set holds %v, want %v", pending, want)
	}
	if leases, err := rdb.HGetAll(ctx, "plain:leases").Result(); err != nil || len(leases) != 3 || leases["z"] != "1004" {
		t.Errorf("the leases hold %v (%v), want x, y and z, z's 1004", leases, err)
	}
	// z's write set every TTL to 3000 - 1004 + 1000 ms.
	for _, k := range keys {
		if ttl, err := rdb.PTTL(ctx, k).Result(); err != nil || ttl.Milliseconds() <= 2900 || ttl.Milliseconds() > 2996 {
			t.Errorf("%s: PTTL %v (%v), want at most 2996 ms and more than 2900", k, ttl, err)
		}
	}
}

// TestPlainReserve_seededLog: on logs written directly, limit 2/1s. With @a at 1000, @b at
// 1001 and @c at 5000, x at 1002 reserves 5000, the newest entry's instant (later than
// b's 1001 + 1000). With @o at 500 and @r at 9000 alone, y at 1500 trims o (at
// 1500 - 1000, out of the window) and is admitted, the key's TTL outlasting r: 9000 - 1500
// + 1000 ms.
func TestPlainReserve_seededLog(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	ctx := context.Background()
	script := redis.NewScript(plainReserveSrc)
	run := func(log string, now int64, token string) []int64 {
		t.Helper()
		got, err := script.Run(ctx, rdb, []string{log, log + ":pending", log + ":leases"}, now, 1000, 2, token).Int64Slice()
		if err != nil {
			t.Fatalf("%s at %d: %v", token, now, err)
		}
		return got
	}
	if err := rdb.ZAdd(ctx, "full", redis.Z{Score: 1000, Member: "@a"}, redis.Z{Score: 1001, Member: "@b"}, redis.Z{Score: 5000, Member: "@c"}).Err(); err != nil {
		t.Fatal(err)
	}
	if got := run("full", 1002, "x"); !slices.Equal(got, []int64{0, 5000}) {
		t.Errorf("x at 1002: %v, want [0 5000]", got)
	}
	if err := rdb.ZAdd(ctx, "gap", redis.Z{Score: 500, Member: "@o"}, redis.Z{Score: 9000, Member: "@r"}).Err(); err != nil {
		t.Fatal(err)
	}
	if got := run("gap", 1500, "y"); !slices.Equal(got, []int64{1, 0}) {
		t.Errorf("y at 1500: %v, want [1 0]", got)
	}
	if got, err := rdb.ZRange(ctx, "gap", 0, -1).Result(); err != nil || !slices.Equal(got, []string{"@y", "@r"}) {
		t.Errorf("the gap log holds %v (%v), want [@y @r]", got, err)
	}
	if ttl, err := rdb.PTTL(ctx, "gap").Result(); err != nil || ttl.Milliseconds() > 8500 || ttl.Milliseconds() <= 8400 {
		t.Errorf("the gap log: PTTL %v (%v), want at most 8500 ms and more than 8400", ttl, err)
	}
}
