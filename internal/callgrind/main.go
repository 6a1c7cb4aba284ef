// Command callgrind counts the instructions redis-server runs per call, under valgrind's
// callgrind, for the rows of the throttle benchmark (BenchmarkLimiter_Allow): PING, the
// seed's plain script and Limiter.Allow in cases (a) to (e), one caller, explicit times.
// Counts are repeatable whatever else the machine runs, unlike the benchmark's CPU times;
// they leave out the kernel's share of a call (its read and write), so their ratios to the
// seed's are higher than the benchmark's CPU ratios. Run it from the module root, with
// valgrind and redis-server on PATH:
//
//	go run ./internal/callgrind -n 300 -backlog 3000
//
// -only a,d runs PING, the seed rows and the named cases only (a to e; fair: (e) with a
// fair displacement; admit: a task its rule does not throttle, as the middleware asks;
// claim: a reservation claimed on time; floor: an EVALSHA of a script that returns at once,
// sent (c)'s keys and arguments, the part of every row no script can save); with c, d
// and e, plain_c, plain_d and plain_e, rows (c0), (d0) and (e0) of the benchmark (plain
// scripts deciding them: testdata/plain_quotas.lua, plain_reserve.lua). It prints instructions per call and their ratios to the
// matching seed row and to PING.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/lua"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

var (
	calls   = flag.Int("n", 400, "calls per case")
	backlog = flag.Int("backlog", 10000, "reservations waiting on the type log of case e")
	only    = flag.String("only", "", "comma-separated cases to run (a-e, fair, admit, claim, floor); empty: all")
	dir     = flag.String("dir", filepath.Join(os.TempDir(), "callgrind-throttle"), "directory for callgrind's dumps (emptied first)")
)

func main() {
	flag.Parse()
	os.RemoveAll(*dir)
	os.MkdirAll(*dir, 0o755)
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command("valgrind", "--tool=callgrind", "--callgrind-out-file="+*dir+"/cg.%p",
		"redis-server", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no")
	cmd.Stderr, cmd.Stdout = nil, nil
	if err := cmd.Start(); err != nil {
		log.Fatal(err)
	}
	defer cmd.Process.Kill()
	fatalf := func(format string, args ...any) { // log.Fatalf runs no deferred call
		_ = cmd.Process.Kill()
		log.Fatalf(format, args...)
	}
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), ReadTimeout: time.Minute, WriteTimeout: time.Minute})
	for i := 0; ; i++ {
		if rdb.Ping(ctx).Err() == nil {
			break
		}
		if i > 600 {
			fatalf("redis-server under valgrind did not answer PING within a minute")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The limiter's clock: fixed (a hot key denies every timed call) or moved 1 ms a call.
	// MaxSkew so wide that the script still reads TIME before a write, as Allow does by
	// default, but never falls back to it.
	var clock atomic.Int64
	clock.Store(1_800_000_000_000)
	lim, err := throttle.New(rdb, throttle.Config{MaxSkew: 100000 * time.Hour, NowFunc: func() time.Time { return time.UnixMilli(clock.Load()) }})
	if err != nil {
		fatalf("%v", err)
	}
	seedSrc, err := os.ReadFile("throttle/testdata/seed_sliding_window.lua")
	if err != nil {
		fatalf("%v (run from the module root)", err)
	}
	seed := redis.NewScript(string(seedSrc))
	seed.Load(ctx, rdb)
	fixture := func(name string) *redis.Script { // a plain_ fixture beside the seed's
		src, err := os.ReadFile("throttle/testdata/" + name)
		if err != nil {
			fatalf("%v (run from the module root)", err)
		}
		s := redis.NewScript(string(src))
		s.Load(ctx, rdb)
		return s
	}
	plainQuotas, plainReserve := fixture("plain_quotas.lua"), fixture("plain_reserve.lua")
	lua.SlidingWindow.Load(ctx, rdb)
	pid := cmd.Process.Pid
	measure := func(name string, call func(i int)) float64 {
		if err := exec.Command("callgrind_control", "-z", strconv.Itoa(pid)).Run(); err != nil {
			fatalf("callgrind_control -z: %v", err)
		}
		for i := 0; i < *calls; i++ {
			call(i)
		}
		if err := exec.Command("callgrind_control", "-d", name, strconv.Itoa(pid)).Run(); err != nil {
			fatalf("callgrind_control -d: %v", err)
		}
		files, _ := filepath.Glob(*dir + "/cg.*")
		var newest string
		var mt time.Time
		for _, f := range files {
			st, _ := os.Stat(f)
			if st.ModTime().After(mt) {
				mt, newest = st.ModTime(), f
			}
		}
		b, _ := os.ReadFile(newest)
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "summary:") || strings.HasPrefix(line, "totals:") {
				n, _ := strconv.ParseFloat(strings.TrimSpace(strings.SplitN(line, ":", 2)[1]), 64)
				return n / float64(*calls)
			}
		}
		fatalf("no totals in %s", newest)
		return 0
	}
	must := func(d throttle.Decision, err error) throttle.Decision {
		if err != nil {
			fatalf("%v", err)
		}
		return d
	}
	tq := func(n int, w time.Duration) throttle.Quota {
		return throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: n, Window: w}}
	}
	yq := func(n int, w time.Duration) throttle.Quota {
		return throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: n, Window: w}}
	}
	tenants := make([]string, 10000)
	for i := range tenants {
		tenants[i] = "t" + strconv.Itoa(i)
	}
	res := map[string]float64{}
	order := []string{}
	var want func(n string) bool
	want = func(n string) bool {
		if c, ok := strings.CutPrefix(n, "plain_"); ok { // with the row it is the floor of
			return want(c)
		}
		return *only == "" || strings.Contains(","+*only+",", ","+n+",") || n == "ping" || strings.HasPrefix(n, "seed")
	}
	run := func(name string, prep func(), call func(i int)) {
		if !want(name) {
			return
		}
		if prep != nil {
			prep()
		}
		res[name] = measure(name, call)
		order = append(order, name)
	}
	run("ping", nil, func(int) { rdb.Ping(ctx) })
	seedCall := func(key string, limit int) {
		if err := seed.Run(ctx, rdb, []string{key}, clock.Load(), 1000, limit, throttle.NewMember()).Err(); err != nil {
			fatalf("%v", err)
		}
	}
	run("seed_hot", func() {
		for i := 0; i < 100; i++ {
			seedCall("seed:hot", 100)
		}
	}, func(int) { seedCall("seed:hot", 100) })
	run("seed_10k", func() {
		for i := 0; i < 10000; i++ {
			seedCall("seed:"+tenants[i], 1e9)
		}
	}, func(i int) { clock.Add(1); seedCall("seed:"+tenants[i%10000], 1e9) })
	hot := throttle.Request{Key: throttle.Key{TaskType: "hot", Tenant: "hot"}, Quotas: []throttle.Quota{tq(100, time.Second)}}
	run("a", func() {
		for i := 0; i < 100; i++ {
			must(lim.Allow(ctx, hot))
		}
	}, func(int) {
		if must(lim.Allow(ctx, hot)).Allowed {
			fatalf("case a admitted: a wrong outcome")
		}
	})
	huge := []throttle.Quota{tq(1e9, time.Second)}
	run("b", func() {
		for i := 0; i < 10000; i++ {
			must(lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: "10k", Tenant: tenants[i]}, Quotas: huge}))
		}
	}, func(i int) {
		clock.Add(1)
		if !must(lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: "10k", Tenant: tenants[i%10000]}, Quotas: huge})).Allowed {
			fatalf("case b denied: a wrong outcome")
		}
	})
	q3 := []throttle.Quota{tq(1e9, time.Second), tq(1e9, time.Hour), yq(1e9, time.Second)}
	run("c", func() {
		for i := 0; i < 10000; i++ {
			must(lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: "3q", Tenant: tenants[i]}, Quotas: q3}))
		}
	}, func(i int) {
		clock.Add(1)
		if !must(lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: "3q", Tenant: tenants[i%10000]}, Quotas: q3})).Allowed {
			fatalf("case c denied: a wrong outcome")
		}
	})
	// plain_c, row (c0) of the benchmark: row (c) decided by the seed's algorithm on its
	// two keys and three quotas (testdata/plain_quotas.lua), nothing more.
	plainCall := func(i int) {
		t := tenants[i%10000]
		now := clock.Load()
		r, err := plainQuotas.Run(ctx, rdb, []string{"plain:3q:" + t, "plain:3q:type"}, now, throttle.NewMember(),
			1e9, 3600000, 1, 1e9, 1000, 1, 1e9, 1000, 2).Int64Slice()
		if err != nil {
			fatalf("%v", err)
		}
		if len(r) != 1 || r[0] != 1 {
			fatalf("case plain_c: reply %v, want [1]: a wrong outcome", r)
		}
	}
	run("plain_c", func() {
		for i := 0; i < 10000; i++ {
			plainCall(i)
		}
	}, func(i int) { clock.Add(1); plainCall(i) })
	// floor, not a row of the benchmark: what Redis spends on an EVALSHA with row (c)'s 2
	// keys and 15 arguments (as the limiter sends them, seen with MONITOR) when the script
	// returns at once: parsing the call, building KEYS and ARGV, the reply.
	floor := redis.NewScript("return {1, 1, 0, ARGV[1], 1, 0}")
	floor.Load(ctx, rdb)
	floorKeys := []string{"throttle:{3q}:tenant:t5", "throttle:{3q}:type"}
	run("floor", nil, func(i int) {
		clock.Add(1)
		now := clock.Load()
		args := []any{now, "!" + throttle.NewMember(), strconv.FormatInt(16*now-(1<<51), 10), "360000000000", "",
			"1000000000", "1000", now - 1000, "1000000000", "3600000", now - 3600000, "1000000000", "1000", now - 1000, "112"}
		if err := floor.Run(ctx, rdb, floorKeys, args...).Err(); err != nil {
			fatalf("%v", err)
		}
	})
	rk := throttle.Key{TaskType: "reserve", Tenant: "hot"}
	run("d", func() {
		for i := 0; i < 100; i++ {
			must(lim.Allow(ctx, throttle.Request{Key: rk, Quotas: hot.Quotas}))
		}
		for i := 0; i < 2000; i++ {
			must(lim.Allow(ctx, throttle.Request{Key: rk, Quotas: hot.Quotas, Reservation: "p" + strconv.Itoa(i)}))
		}
	}, func(i int) {
		clock.Add(1)
		if !must(lim.Allow(ctx, throttle.Request{Key: rk, Quotas: hot.Quotas, Reservation: "d" + strconv.Itoa(i)})).Reserved {
			fatalf("case d not reserved: a wrong outcome")
		}
	})
	// plain_d, row (d0) of the benchmark: row (d)'s reservation written plainly
	// (testdata/plain_reserve.lua): a log entry, a pending entry and a lease, each with
	// its TTL, and none of the limiter's other rules.
	plainReserveCall := func(log string, limit int, token string) int64 {
		r, err := plainReserve.Run(ctx, rdb, []string{"plain:" + log, "plain:pending:" + log, "plain:leases:" + log}, clock.Load(), 1000, limit, token).Int64Slice()
		if err != nil {
			fatalf("%v", err)
		}
		return r[1]
	}
	plainRow := func(name, log string, limit, backlog int) {
		run(name, func() {
			for i := 0; i < limit; i++ {
				plainReserveCall(log, limit, "a"+strconv.Itoa(i))
			}
			for i := 0; i < backlog; i++ {
				plainReserveCall(log, limit, "p"+strconv.Itoa(i))
			}
		}, func(i int) {
			clock.Add(1)
			if plainReserveCall(log, limit, "d"+strconv.Itoa(i)) <= clock.Load() {
				fatalf("case %s not reserved: a wrong outcome", name)
			}
		})
	}
	plainRow("plain_d", "reserve", 100, 2000)
	// plain_e, row (e0) of the benchmark: the same on row (e)'s limit and backlog, one
	// log, no fairness.
	plainRow("plain_e", "backlog", 1000, *backlog)
	yq1000 := []throttle.Quota{yq(1000, time.Second)}
	next := 0
	ereq := func() throttle.Request {
		next++
		return throttle.Request{Key: throttle.Key{TaskType: "backlog", Tenant: tenants[next%100]}, Quotas: yq1000, Reservation: "e" + strconv.Itoa(next)}
	}
	run("e", func() {
		for r := 0; r < *backlog; {
			if must(lim.Allow(ctx, ereq())).Reserved {
				r++
			}
		}
	}, func(i int) {
		clock.Add(1)
		if !must(lim.Allow(ctx, ereq())).Reserved {
			fatalf("case e not reserved: a wrong outcome")
		}
	})
	// fair, not a row of the benchmark: row (e)'s type log, each timed call from a tenant
	// with nothing waiting yet, whose fair tag ranks it first: it takes the slot of another
	// tenant's reservation, which moves to the end (fair displacement, as the benchmark's
	// 64 callers cause whenever their calls arrive out of tag order). Weight 2: its tag
	// (half a unit) is before every backlog tenant's (a unit and more), since a fair rank
	// takes only the slot of a reservation of a later tag; at weight 1 it would tie with
	// the backlog's first tags, and the first pending at its instant would hold them.
	run("fair", func() {
		for r := 0; r < *backlog; {
			if must(lim.Allow(ctx, ereq())).Reserved {
				r++
			}
		}
	}, func(i int) {
		clock.Add(1)
		next++
		req := throttle.Request{Key: throttle.Key{TaskType: "backlog", Tenant: "new" + strconv.Itoa(i)}, Quotas: yq1000, Reservation: "n" + strconv.Itoa(next), Weight: 2}
		if d := must(lim.Allow(ctx, req)); !d.Reserved || d.RetryAfter >= time.Second {
			fatalf("case fair: %+v, want a reservation within the next second (a displaced slot): a wrong outcome", d)
		}
	})
	// admit, not a row of the benchmark: what the middleware sends for a task its rule does
	// not throttle (a reservation token, a wait, a claim timeout), 100 tenants round-robin,
	// as in the drain benchmark (BenchmarkMiddleware_Drain), each log holding about 80
	// entries in its window.
	admit := func(i int, token string) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "admit", Tenant: tenants[i%100]}, Quotas: huge,
			Reservation: token + strconv.Itoa(i), MaxWait: 250 * time.Millisecond, ClaimTimeout: 3 * time.Second}
	}
	run("admit", func() {
		for i := 0; i < 8000; i++ {
			must(lim.Allow(ctx, admit(i, "w")))
			if i%10 == 0 {
				clock.Add(1)
			}
		}
	}, func(i int) {
		clock.Add(1)
		if !must(lim.Allow(ctx, admit(i, "a"))).Allowed {
			fatalf("case admit denied: a wrong outcome")
		}
	})
	// claim, not a row of the benchmark: a task claiming its reservation on time, as each
	// throttled task does once after its denial. The window is full and n reservations
	// wait; each timed call claims the earliest, at its instant.
	ck := throttle.Key{TaskType: "claim", Tenant: "hot"}
	var claimAt []int64
	run("claim", func() {
		for i := 0; i < 100; i++ {
			must(lim.Allow(ctx, throttle.Request{Key: ck, Quotas: hot.Quotas}))
		}
		for i := 0; i < *calls; i++ {
			d := must(lim.Allow(ctx, throttle.Request{Key: ck, Quotas: hot.Quotas, Reservation: "f" + strconv.Itoa(i)}))
			if !d.Reserved {
				fatalf("case claim: reservation %d not reserved: a wrong outcome", i)
			}
			claimAt = append(claimAt, clock.Load()+d.RetryAfter.Milliseconds())
		}
	}, func(i int) {
		clock.Store(claimAt[i])
		if d := must(lim.Allow(ctx, throttle.Request{Key: ck, Quotas: hot.Quotas, Reservation: "f" + strconv.Itoa(i)})); !d.Allowed || !d.Held {
			fatalf("case claim: claim %d: %+v, want admitted, held: a wrong outcome", i, d)
		}
	})
	fmt.Printf("%-10s %10s %8s %8s\n", "case", "Ir/call", "x_seed", "x_ping")
	for _, n := range order {
		ref := "seed_hot"
		if n == "b" || n == "c" || n == "plain_c" || n == "floor" || n == "seed_10k" {
			ref = "seed_10k"
		}
		fmt.Printf("%-10s %10.0f %8.2f %8.2f\n", n, res[n], res[n]/res[ref], res[n]/res["ping"])
	}
}
