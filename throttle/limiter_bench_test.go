package throttle_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/lua"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// The shape of every row of BenchmarkLimiter_Allow.
const (
	benchCallers   = 64     // goroutines calling at once in every row
	benchTenants   = 10_000 // keys of the many-keys rows
	benchHotLimit  = 100    // events per second of the hot-key rows
	benchRedisCPU  = 1      // the core redis-server is pinned to: the second of two
	benchBacklog   = 10_000 // reservations waiting on the type log before row (e) is timed
	benchTypeLimit = 1000   // events per second of row (e)'s type quota
	benchSample    = 2000   // calls of row (e) whose script time SLOWLOG records one by one
	benchHuge      = 1e9    // events per window of the admitting rows: never reached
)

// benchRounds is how many times BenchmarkLimiter_Allow runs its single-node rows, round
// after round (the cluster and replica rows run in the last): on a shared machine whose
// speed drifts over a run, a row's ratio to the ping and seed rows of its own round, and
// the median of those over rounds, compare like with like better than one pass does.
var benchRounds = flag.Int("bench.rounds", 1, "BenchmarkLimiter_Allow: rounds of its rows; above 1 the table adds each row's medians over the rounds")

// benchTenantNames are the tenants of the many-keys rows, formatted once.
var benchTenantNames = func() []string {
	names := make([]string, benchTenants)
	for i := range names {
		names[i] = "t" + strconv.Itoa(i)
	}
	return names
}()

// BenchmarkLimiter_Allow measures, in one run against one redis-server (pinned to CPU 1
// when taskset is on PATH) and one go-redis client, plain PINGs, the seed's plain
// sliding-window script (testdata/seed_sliding_window.lua) and Limiter.Allow in several
// scenarios, each with 64 callers at once, and then prints them side by side in one table
// on stdout.
//
// Each case=<name> sub-benchmark reports decisions/s (PINGs/s for case=ping); x_ping, that
// over PING's; cpu_us/op, the Redis server's CPU time per call in microseconds (INFO cpu
// used_cpu_sys + used_cpu_user over the run, divided by its calls); x_ping_cpu and
// x_seed_cpu, that over PING's and over the matching seed row's (seed_hot for the hot-key
// and reservation rows, seed_10k for the many-keys rows); script_us, the mean execution
// time in microseconds of one EVALSHA (or EVAL, after a NOSCRIPT) from INFO commandstats,
// or of one PING; and script_p99_us, the 99th percentile of the EVALSHA (PING) execution
// times from INFO latencystats, reset before each run. Row (e) also makes 4000 more calls,
// untimed, the last 2000 timed one by one in SLOWLOG, and prints their percentiles under
// the table. Rows (f) and (f') make the same calls, over 10 task types whose slots every
// master serves, on the one node and on a 3-master Redis Cluster started for (f') (its
// nodes pinned to the same core). Rows (c0), (d0) and (e0) are not the limiter: they
// decide (c)'s, (d)'s and (e)'s calls by plain scripts, the yardsticks of what the
// limiter's rules add: testdata/plain_quotas.lua, the seed's algorithm on (c)'s three
// quotas and two keys, and testdata/plain_reserve.lua, a reservation written as an
// entry, a pending entry and a lease with their TTLs, deciding nothing else (for (e):
// its limit of 1000/1s and 10,000 reservations waiting, on one log, no fairness). Row (s') is the seed's script through
// go-redis's automatic pipelining, as row (a') sends the limiter's. Ratios are
// only meaningful within one run: rows compare with the ping and seed rows run before them.
// With -bench.rounds N the single-node rows run N times, round after round (the cluster
// and replica rows in the last), and a second table gives each row's medians over the
// rounds, its ratios each over its own round's ping and seed rows.
//
// The benchmark asserts no speed. It fails on errors and on wrong outcomes: an admitting
// row that denies, a hot-key row that admits more than its limit allows in the time the
// run took, a reservation row that does not reserve.
func BenchmarkLimiter_Allow(b *testing.B) {
	env := benchStart(b)
	cases := env.cases()
	for round := 1; round <= *benchRounds; round++ {
		env.round = round
		for _, c := range cases {
			if !c.once || round == *benchRounds {
				env.run(b, c)
			}
		}
	}
	if len(env.order)+len(env.failures) > 0 {
		redistest.PrintBenchTable(b.Name(), env.table())
	}
}

// benchEnv is the server, the client, the limiters and the rows measured so far.
type benchEnv struct {
	ctx      context.Context
	rdb      *redis.Client
	lim, ap  *throttle.Limiter // ap: with Config.AutoPipeline
	durable  *throttle.Limiter // with Config.MinReplicas 1, for rows (f) and (f')
	replica  *redistest.Server // idle until row (f) makes it replicate the server (attach)
	attached bool              // the replica is in sync
	seed     *redis.Script
	seedAP   redis.Scripter         // e.rdb's AutoPipeliner, for row (s')
	plainQ   *redis.Script          // testdata/plain_quotas.lua: row (c0)
	plainR   *redis.Script          // testdata/plain_reserve.lua: rows (d0) and (e0)
	header   []string               // lines above the table: the setup
	rows     map[string]*benchRow   // by case name: the last run of each
	rounds   map[string][]*benchRow // by case name: every run of it, in order (-bench.rounds)
	round    int                    // the round running, from 1
	order    []string               // case names in the order they ran
	runs     int                    // runs started so far, to give each run keys of its own
	failures []string               // cases that failed, and why

	top            *testing.B         // BenchmarkLimiter_Allow's own: its cleanups run at its end
	cluster        *redistest.Cluster // row (f'), started by its first run
	clusterLim     *throttle.Limiter
	clusterMasters []*redis.Client
}

// benchStart starts the server and the client, loads both scripts, and notes the setup.
func benchStart(b *testing.B) *benchEnv {
	b.Helper()
	ctx := context.Background()
	srv, unpinned := redistest.StartServerPinned(b, benchRedisCPU)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 2 * benchCallers, MinIdleConns: benchCallers})
	b.Cleanup(func() { _ = rdb.Close() })
	env := &benchEnv{ctx: ctx, rdb: rdb, rows: map[string]*benchRow{}, rounds: map[string][]*benchRow{}, top: b}
	var err error
	if env.lim, err = throttle.New(rdb, throttle.Config{}); err != nil {
		b.Fatal(err)
	}
	if env.ap, err = throttle.New(rdb, throttle.Config{AutoPipeline: true}); err != nil {
		b.Fatal(err)
	}
	ap, err := rdb.AutoPipeline()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = ap.Close() })
	env.seedAP = ap
	// Started now, replicating nothing: the rows before (f) run on a primary without a
	// replica, as before there were such rows.
	env.replica = redistest.StartServer(b)
	if env.durable, err = throttle.New(rdb, throttle.Config{MinReplicas: 1}); err != nil {
		b.Fatal(err)
	}
	for _, f := range []struct {
		s    **redis.Script
		file string
	}{{&env.seed, "seed_sliding_window.lua"}, {&env.plainQ, "plain_quotas.lua"}, {&env.plainR, "plain_reserve.lua"}} {
		src, err := os.ReadFile("testdata/" + f.file)
		if err != nil {
			b.Fatal(err)
		}
		*f.s = redis.NewScript(string(src))
	}
	for _, s := range []*redis.Script{env.seed, env.plainQ, env.plainR, lua.SlidingWindow} { // no NOSCRIPT in the rows
		if err := s.Load(ctx, rdb).Err(); err != nil {
			b.Fatalf("SCRIPT LOAD: %v", err)
		}
	}

	serverLine, clientCPUs := redistest.DescribePinning(ctx, rdb, benchRedisCPU, unpinned)
	env.header = []string{
		serverLine,
		fmt.Sprintf("go client: %d callers, PoolSize %d, GOMAXPROCS %d, may run on CPUs %s (not pinned: it shares Redis's core)",
			benchCallers, 2*benchCallers, runtime.GOMAXPROCS(0), clientCPUs),
		"cpu_us/op: Redis CPU (INFO used_cpu_sys+used_cpu_user) per call; script_us: INFO commandstats usec per EVALSHA/EVAL (PING for ping)",
		"p99_us: INFO latencystats p99 of the run's EVALSHA (PING) execution times, after CONFIG RESETSTAT (histogram, within 1%)",
		"x_seed_cpu: cpu_us/op over seed hot's for (a) (a') (s') (d) (d0) (e) (e0), over seed 10k's for (b) (b') (c) (c0) (f) (f')",
		"(s'): the seed's script through go-redis's AutoPipeliner on the same client, as (a') sends the limiter's",
		"(c0) (d0) (e0): not the limiter: (c) by the seed's algorithm on its 3 quotas (testdata/plain_quotas.lua), (d) and (e)'s limit and backlog on one log by a plain reservation script (testdata/plain_reserve.lua: no fairness)",
		"(f'): 3 masters, all pinned to the one node's CPU; its Redis columns add up the masters' INFO (p99_us: the largest)",
		"(g) (g'): the server has one replica (another redis-server, not pinned, attached before (g)); (g') is durable: MinReplicas 1, the script and WAIT in one pipeline",
	}
	return env
}

// benchResult is the outcome of one call.
type benchResult uint8

const (
	benchAdmitted benchResult = iota // admitted (or, for PING, answered)
	benchReserved                    // denied, holding a reservation
	benchDenied                      // denied, holding nothing
)

// benchCall makes call number i of a run.
type benchCall func(ctx context.Context, i int64) (benchResult, error)

// benchCase is one row of the table.
type benchCase struct {
	name     string   // sub-benchmark name, after "case="
	label    string   // first column of the table
	seed     string   // the seed row whose cpu_us/op it is compared with; "" for none
	commands []string // the commands script_us is read from (INFO commandstats names)
	// prepare readies one run, untimed, and returns the call it times.
	prepare func(b *testing.B, run int) benchCall
	// check returns an error if the outcomes of a run are wrong for the case.
	check func(o benchOutcomes) error
	// sample, if set, runs after the timed run, untimed, and returns a note for the table.
	sample func(b *testing.B, call benchCall) string
	// nodes, if set, returns the servers whose INFO the row's Redis columns add up (a
	// cluster's masters); nil: the one server.
	nodes func() []*redis.Client
	// once: the row runs in the last round only (-bench.rounds): the cluster's, and the
	// replica's, which stays attached once a row attached it.
	once bool
}

// benchOutcomes counts what the calls of one run got, and when the run began and ended.
type benchOutcomes struct {
	calls, admitted, reserved, denied int64
	start, end                        time.Time
}

// benchRow is one run of a case: the last that testing made to size b.N (rows keeps each
// case's latest, rounds each round's).
type benchRow struct {
	c         benchCase
	round     int // the round it ran in, from 1
	out       benchOutcomes
	perSec    float64 // calls per second
	cpuUS     float64 // Redis CPU per call, microseconds
	cmdUS     float64 // execution time per script call (or PING), microseconds
	p99US     float64 // 99th percentile of the EVALSHA (or PING) execution times, microseconds
	cmdCalls  int64   // script calls (or PINGs) Redis counted in the run
	noscript  int64   // NOSCRIPT errors Redis replied in the run
	otherErrs string  // other error replies counted by INFO errorstats, if any
	note      string  // from benchCase.sample
}

// errBenchStop, returned by a call, ends benchParallel early without an error.
var errBenchStop = errors.New("enough calls")

// benchParallel calls call(i) for every i in [0, n) from benchCallers goroutines at once,
// each taking the next i, and counts the results. It stops at the first error and returns
// it; errBenchStop ends it early without an error.
func benchParallel(ctx context.Context, n int64, call benchCall) (benchOutcomes, error) {
	var next, admitted, reserved, denied atomic.Int64
	var mu sync.Mutex
	var firstErr error
	var wg sync.WaitGroup
	o := benchOutcomes{start: time.Now()}
	for range benchCallers {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= n {
					return
				}
				r, err := call(ctx, i)
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					next.Store(n) // the others stop at their next call
					return
				}
				switch r {
				case benchAdmitted:
					admitted.Add(1)
				case benchReserved:
					reserved.Add(1)
				default:
					denied.Add(1)
				}
			}
		})
	}
	wg.Wait()
	o.end = time.Now()
	o.admitted, o.reserved, o.denied = admitted.Load(), reserved.Load(), denied.Load()
	o.calls = o.admitted + o.reserved + o.denied
	if errors.Is(firstErr, errBenchStop) {
		firstErr = nil
	}
	return o, firstErr
}

// run runs case c as a sub-benchmark, case=<name>, and keeps its last run as a row.
func (e *benchEnv) run(b *testing.B, c benchCase) {
	ok := b.Run("case="+c.name, func(b *testing.B) {
		b.ReportAllocs()
		e.runs++
		call := c.prepare(b, e.runs)
		nodes := []*redis.Client{e.rdb}
		if c.nodes != nil {
			nodes = c.nodes()
		}
		for _, n := range nodes {
			if err := n.ConfigResetStat(e.ctx).Err(); err != nil { // for the run's own percentiles
				b.Fatal(err)
			}
		}
		before, err := benchReadStats(e.ctx, nodes)
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		out, err := benchParallel(e.ctx, int64(b.N), call)
		b.StopTimer()
		if err != nil {
			e.fail(c, err)
			b.Fatalf("%s: %v", c.label, err)
		}
		after, err := benchReadStats(e.ctx, nodes)
		if err != nil {
			b.Fatal(err)
		}
		if err := c.check(out); err != nil {
			e.fail(c, err)
			b.Fatalf("%s: wrong outcome: %v", c.label, err)
		}
		d := after.Sub(before)
		cmd := d.Command(c.commands...)
		row := &benchRow{c: c, round: e.round, out: out,
			perSec:   float64(out.calls) / out.end.Sub(out.start).Seconds(),
			cpuUS:    d.CPU().Seconds() * 1e6 / float64(out.calls),
			cmdCalls: cmd.Calls, noscript: d.Errors["NOSCRIPT"]}
		if cmd.Calls > 0 {
			row.cmdUS = cmd.Total.Seconds() * 1e6 / float64(cmd.Calls)
		}
		row.p99US = after.Latency[c.commands[0]]["p99"].Seconds() * 1e6
		for _, name := range slices.Sorted(maps.Keys(d.Errors)) {
			if name != "NOSCRIPT" {
				row.otherErrs += fmt.Sprintf(" %s:%d", name, d.Errors[name])
			}
		}
		if c.sample != nil {
			row.note = c.sample(b, call)
		}
		if e.rows[c.name] == nil {
			e.order = append(e.order, c.name)
		}
		e.rows[c.name] = row

		b.ReportMetric(row.perSec, "decisions/s")
		b.ReportMetric(row.cpuUS, "cpu_us/op")
		b.ReportMetric(row.cmdUS, "script_us")
		b.ReportMetric(row.p99US, "script_p99_us")
		if x, ok := e.ratio(c.name, "ping", func(r *benchRow) float64 { return r.perSec }); ok {
			b.ReportMetric(x, "x_ping")
		}
		if x, ok := e.ratio(c.name, "ping", func(r *benchRow) float64 { return r.cpuUS }); ok {
			b.ReportMetric(x, "x_ping_cpu")
		}
		if x, ok := e.ratio(c.name, c.seed, func(r *benchRow) float64 { return r.cpuUS }); ok {
			b.ReportMetric(x, "x_seed_cpu")
		}
	})
	// The round's row: the last of the runs testing made to size b.N. testing names a
	// case's later rounds case=<name>#01, #02...: a -bench pattern ending in $ skips them.
	if r := e.rows[c.name]; ok && r != nil && r.round == e.round {
		e.rounds[c.name] = append(e.rounds[c.name], r)
	}
	if !ok { // no row from a shorter run before the failure
		delete(e.rows, c.name)
		e.order = slices.DeleteFunc(e.order, func(name string) bool { return name == c.name })
		if !slices.ContainsFunc(e.failures, func(f string) bool { return strings.HasPrefix(f, c.label+":") }) {
			e.failures = append(e.failures, c.label+": failed (see its --- FAIL above)")
		}
	}
}

// fail notes that case c failed with err, for the table.
func (e *benchEnv) fail(c benchCase, err error) {
	e.failures = append(e.failures, fmt.Sprintf("%s: %v", c.label, err))
}

// ratio returns metric(row name) / metric(row ref), if both rows ran.
func (e *benchEnv) ratio(name, ref string, metric func(*benchRow) float64) (float64, bool) {
	r, base := e.rows[name], e.rows[ref]
	if r == nil || base == nil || metric(base) == 0 {
		return 0, false
	}
	return metric(r) / metric(base), true
}

// table formats the rows side by side, then the notes of the rows that have one and the
// failures.
func (e *benchEnv) table() string {
	var sb strings.Builder
	for _, line := range e.header {
		sb.WriteString(line + "\n")
	}
	sb.WriteString("\n")
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "case\tcalls\tdecisions/s\tx_ping\tcpu_us/op\tx_ping_cpu\tx_seed_cpu\tscript_us\tp99_us\toutcome")
	var notes []string
	for _, name := range e.order {
		r := e.rows[name]
		ratio := func(ref string, metric func(*benchRow) float64) string {
			if x, ok := e.ratio(name, ref, metric); ok {
				return fmt.Sprintf("%.2f", x)
			}
			return "-"
		}
		perSec := func(r *benchRow) float64 { return r.perSec }
		cpu := func(r *benchRow) float64 { return r.cpuUS }
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%.2f\t%s\t%s\t%.2f\t%.1f\t%s\n", r.c.label, r.out.calls, r.perSec,
			ratio("ping", perSec), r.cpuUS, ratio("ping", cpu), ratio(r.c.seed, cpu), r.cmdUS, r.p99US, r.outcome())
		if r.note != "" {
			notes = append(notes, r.c.label+": "+r.note)
		}
	}
	tw.Flush()
	if *benchRounds > 1 {
		e.medians(&sb)
	}
	for _, n := range notes {
		sb.WriteString("\n" + n)
	}
	for _, f := range e.failures {
		sb.WriteString("\nFAILED " + f)
	}
	return strings.TrimRight(sb.String(), "\n")
}

// medians writes, per row that ran in more than one round, the median over its rounds of
// decisions/s, cpu_us/op, script_us and p99_us, and of its ratios to the ping and seed rows
// of the same round (with their lowest and highest).
func (e *benchEnv) medians(sb *strings.Builder) {
	fmt.Fprintf(sb, "\nmedians over %d rounds, each ratio over its own round's ping and seed rows [lowest-highest]:\n", *benchRounds)
	tw := tabwriter.NewWriter(sb, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "case\trounds\tdecisions/s\tx_ping\tcpu_us/op\tx_seed_cpu\tscript_us\tp99_us")
	ofRound := func(name string, round int) *benchRow {
		for _, r := range e.rounds[name] {
			if r.round == round {
				return r
			}
		}
		return nil
	}
	for _, name := range e.order {
		runs := e.rounds[name]
		if len(runs) < 2 {
			continue
		}
		var perSec, cpu, script, p99, xPing, xSeed []float64
		for _, r := range runs {
			perSec, cpu, script, p99 = append(perSec, r.perSec), append(cpu, r.cpuUS), append(script, r.cmdUS), append(p99, r.p99US)
			if p := ofRound("ping", r.round); p != nil && p.perSec > 0 {
				xPing = append(xPing, r.perSec/p.perSec)
			}
			if s := ofRound(r.c.seed, r.round); s != nil && s.cpuUS > 0 {
				xSeed = append(xSeed, r.cpuUS/s.cpuUS)
			}
		}
		spread := func(xs []float64) string {
			if len(xs) == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f [%.2f-%.2f]", median(xs), slices.Min(xs), slices.Max(xs))
		}
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%.2f\t%s\t%.2f\t%.1f\n", runs[0].c.label, len(runs), median(perSec),
			spread(xPing), median(cpu), spread(xSeed), median(script), median(p99))
	}
	tw.Flush()
}

// median is the middle value of xs (the mean of the middle two for an even count); xs
// must not be empty. It sorts a copy.
func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if n := len(s); n%2 == 0 {
		return (s[n/2-1] + s[n/2]) / 2
	}
	return s[len(s)/2]
}

// outcome says what the calls got, and anything odd Redis counted.
func (r *benchRow) outcome() string {
	pct := func(n int64) string { return fmt.Sprintf("%.1f%%", 100*float64(n)/float64(r.out.calls)) }
	var s string
	switch {
	case r.c.name == "ping":
		s = "PONG"
	case r.out.reserved > 0:
		s = "reserved " + pct(r.out.reserved)
	case r.out.denied > 0:
		s = "denied " + pct(r.out.denied)
	default:
		s = "admitted " + pct(r.out.admitted)
	}
	if r.out.admitted > 0 && r.out.admitted < r.out.calls {
		s += fmt.Sprintf(", %d admitted", r.out.admitted)
	}
	if r.cmdCalls != r.out.calls {
		s += fmt.Sprintf(", Redis counted %d %s", r.cmdCalls, strings.Join(r.c.commands, "+"))
	}
	if r.noscript > 0 {
		s += fmt.Sprintf(", %d NOSCRIPT", r.noscript)
	}
	if r.otherErrs != "" {
		s += ", errors" + r.otherErrs
	}
	return s
}

// cases lists the rows in the order they run: the references first.
func (e *benchEnv) cases() []benchCase {
	script := []string{"evalsha", "eval"}
	hot := throttle.Key{TaskType: "bench:hot", Tenant: "hot"}
	hotQuota := []throttle.Quota{tenantQuota(benchHotLimit, time.Second)}
	hugeQuota := []throttle.Quota{tenantQuota(benchHuge, time.Second)}
	return []benchCase{
		{name: "ping", label: "ping", commands: []string{"ping"},
			prepare: e.static(func(ctx context.Context, _ int64) (benchResult, error) {
				return benchAdmitted, e.rdb.Ping(ctx).Err()
			}),
			check: benchAllAdmitted},
		{name: "seed_hot", label: "seed hot", seed: "seed_hot", commands: script,
			prepare: e.static(e.seedCall(func(int64) string { return "bench:seed:hot" }, benchHotLimit)),
			check:   benchHotBound(1)},
		{name: "seed_10k", label: "seed 10k", seed: "seed_10k", commands: script,
			prepare: e.static(e.seedCall(func(i int64) string { return "bench:seed:" + benchTenantNames[i%benchTenants] }, benchHuge)),
			check:   benchAllAdmitted},
		{name: "hot", label: "(a) hot key", seed: "seed_hot", commands: script,
			prepare: e.static(e.allowCall(e.lim, func(int64) throttle.Request {
				return throttle.Request{Key: hot, Quotas: hotQuota}
			})),
			check: benchHotBound(0)},
		{name: "tenants_10k", label: "(b) 10k tenants", seed: "seed_10k", commands: script,
			prepare: e.static(e.allowCall(e.lim, func(i int64) throttle.Request {
				return throttle.Request{Key: throttle.Key{TaskType: "bench:10k", Tenant: benchTenantNames[i%benchTenants]}, Quotas: hugeQuota}
			})),
			check: benchAllAdmitted},
		{name: "three_quotas", label: "(c) 3 quotas, 10k tenants", seed: "seed_10k", commands: script,
			prepare: e.static(e.allowCall(e.lim, func() func(int64) throttle.Request {
				quotas := []throttle.Quota{tenantQuota(benchHuge, time.Second), tenantQuota(benchHuge, time.Hour), typeQuota(benchHuge, time.Second)}
				return func(i int64) throttle.Request {
					return throttle.Request{Key: throttle.Key{TaskType: "bench:3q", Tenant: benchTenantNames[i%benchTenants]}, Quotas: quotas}
				}
			}())),
			check: benchAllAdmitted},
		{name: "three_quotas_plain", label: "(c0) seed's algorithm, (c)'s quotas", seed: "seed_10k", commands: script,
			prepare: e.static(e.plainQuotasCall), check: benchAllAdmitted},
		{name: "reserve", label: "(d) hot key, reserve", seed: "seed_hot", commands: script,
			prepare: e.prepareReserve, check: benchAllReserved},
		{name: "reserve_plain", label: "(d0) plain reservation script", seed: "seed_hot", commands: script,
			prepare: e.preparePlainReserve, check: benchMostlyReserved},
		{name: "type_backlog", label: "(e) type, 10k waiting", seed: "seed_hot", commands: script,
			prepare: e.prepareBacklog, check: benchAllReserved, sample: e.sampleScriptTimes},
		{name: "type_backlog_plain", label: "(e0) plain reservation script, (e)'s log", seed: "seed_hot", commands: script,
			prepare: e.preparePlainBacklog, check: benchMostlyReserved},
		{name: "hot_autopipeline", label: "(a') hot key, AutoPipeline", seed: "seed_hot", commands: script,
			prepare: e.static(e.allowCall(e.ap, func(int64) throttle.Request {
				return throttle.Request{Key: throttle.Key{TaskType: "bench:hot-ap", Tenant: "hot"}, Quotas: hotQuota}
			})),
			check: benchHotBound(0)},
		{name: "seed_hot_autopipeline", label: "(s') seed hot, AutoPipeline", seed: "seed_hot", commands: script,
			prepare: e.static(e.seedCallOn(e.seedAP, func(int64) string { return "bench:seed:hot-ap" }, benchHotLimit)),
			check:   benchHotBound(1)},
		{name: "tenants_10k_autopipeline", label: "(b') 10k tenants, AutoPipeline", seed: "seed_10k", commands: script,
			prepare: e.static(e.allowCall(e.ap, func(i int64) throttle.Request {
				return throttle.Request{Key: throttle.Key{TaskType: "bench:10k-ap", Tenant: benchTenantNames[i%benchTenants]}, Quotas: hugeQuota}
			})),
			check: benchAllAdmitted},
		{name: "types_10", label: "(f) 10 types x 1k tenants, one node", seed: "seed_10k", commands: script,
			prepare: e.static(e.allowCall(e.lim, benchTypesRequest)),
			check:   benchAllAdmitted},
		{name: "types_10_cluster", label: "(f') the same, 3-master cluster", seed: "seed_10k", commands: script,
			prepare: e.prepareCluster, check: benchAllAdmitted, nodes: e.clusterNodes, once: true},
		// Last: they attach the replica, whose stream the server then feeds on every write.
		{name: "tenants_10k_replica", label: "(g) 10k tenants, 1 replica", seed: "seed_10k", commands: script,
			prepare: e.attached10k("bench:10k-r", e.lim), check: benchAllAdmitted, once: true},
		{name: "tenants_10k_durable", label: "(g') 10k tenants, durable", seed: "seed_10k", commands: script,
			prepare: e.attached10k("bench:10k-d", e.durable), check: benchAllAdmitted, once: true},
	}
}

// benchTypes are the task types of rows (f) and (f'): clusterTypes, whose slots are
// served by every master of a 3-master cluster (3, 4 and 3 of them).
var benchTypes = func() []string {
	names := make([]string, len(clusterTypes))
	for i, ct := range clusterTypes {
		names[i] = "bench:" + ct.name
	}
	return names
}()

// benchTypesRequest is call i of rows (f) and (f'): type i%10, tenant i/10 % 1000, two
// quotas (tenant and type), so one script call on two keys of one slot.
func benchTypesRequest(i int64) throttle.Request {
	return throttle.Request{Key: throttle.Key{TaskType: benchTypes[i%10], Tenant: benchTenantNames[i/10%1000]},
		Quotas: []throttle.Quota{tenantQuota(benchHuge, time.Second), typeQuota(benchHuge, time.Second)}}
}

// prepareCluster readies row (f'): on its first run, a 3-master cluster with every node
// pinned to the single node's core (the cluster gets the same Redis CPU, so the row shows
// what cluster mode costs, not what more cores give), and a limiter on a cluster client
// with the single node's pool size per node; the script is loaded on every master.
func (e *benchEnv) prepareCluster(_ *testing.B, _ int) benchCall {
	if e.cluster == nil {
		b := e.top // the cluster outlives each run of the row
		c := redistest.StartClusterWith(b, redistest.ClusterConfig{Masters: 3, Pin: true, PinCPU: benchRedisCPU})
		rdb := c.ClientWith(&redis.ClusterOptions{PoolSize: 2 * benchCallers, MinIdleConns: benchCallers})
		l, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			b.Fatal(err)
		}
		for _, addr := range c.Addrs {
			n := redis.NewClient(&redis.Options{Addr: addr})
			b.Cleanup(func() { _ = n.Close() })
			if err := lua.SlidingWindow.Load(e.ctx, n).Err(); err != nil {
				b.Fatalf("SCRIPT LOAD on %s: %v", addr, err)
			}
			e.clusterMasters = append(e.clusterMasters, n)
		}
		e.cluster, e.clusterLim = c, l
	}
	return e.allowCall(e.clusterLim, benchTypesRequest)
}

// clusterNodes returns row (f')'s masters.
func (e *benchEnv) clusterNodes() []*redis.Client { return e.clusterMasters }

// benchReadStats reads the stats of every node and adds them up: CPU, commands and errors
// are sums; a latency percentile is the largest of the nodes'.
func benchReadStats(ctx context.Context, nodes []*redis.Client) (redistest.Stats, error) {
	var sum redistest.Stats
	for i, n := range nodes {
		s, err := redistest.ReadStats(ctx, n)
		if err != nil || i == 0 {
			sum = s
			if err != nil {
				return sum, err
			}
			continue
		}
		sum.CPUSys += s.CPUSys
		sum.CPUUser += s.CPUUser
		for name, c := range s.Commands {
			t := sum.Commands[name]
			t.Calls, t.Total, t.RejectedCalls, t.FailedCalls = t.Calls+c.Calls, t.Total+c.Total, t.RejectedCalls+c.RejectedCalls, t.FailedCalls+c.FailedCalls
			sum.Commands[name] = t
		}
		for name, v := range s.Errors {
			sum.Errors[name] += v
		}
		for name, ps := range s.Latency {
			if sum.Latency[name] == nil {
				sum.Latency[name] = map[string]time.Duration{}
			}
			for p, d := range ps {
				sum.Latency[name][p] = max(sum.Latency[name][p], d)
			}
		}
	}
	return sum, nil
}

// attached10k is the prepare of rows (g) and (g'): it makes the replica replicate the
// server (once, untimed) and returns the calls of row (b) on taskType's logs with l.
func (e *benchEnv) attached10k(taskType string, l *throttle.Limiter) func(*testing.B, int) benchCall {
	hugeQuota := []throttle.Quota{tenantQuota(benchHuge, time.Second)}
	return func(b *testing.B, _ int) benchCall {
		e.attach(b)
		return e.allowCall(l, func(i int64) throttle.Request {
			return throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: benchTenantNames[i%benchTenants]}, Quotas: hugeQuota}
		})
	}
}

// attach makes e.replica a replica of the server and waits (at most 10s) until a write and
// a WAIT on one connection find it in sync.
func (e *benchEnv) attach(b *testing.B) {
	if e.attached {
		return
	}
	host, port, _ := strings.Cut(e.rdb.Options().Addr, ":")
	rc := redis.NewClient(&redis.Options{Addr: e.replica.Addr})
	defer rc.Close()
	if err := rc.ReplicaOf(e.ctx, host, port).Err(); err != nil {
		b.Fatalf("REPLICAOF on the bench replica: %v", err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var wait *redis.Cmd
		_, err := e.rdb.Pipelined(e.ctx, func(p redis.Pipeliner) error {
			p.Set(e.ctx, "bench:replica-sync", "1", time.Minute)
			wait = p.Do(e.ctx, "WAIT", 1, 100)
			return nil
		})
		if n, _ := wait.Int(); err == nil && n == 1 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("the bench replica is not in sync 10s after REPLICAOF: %v", err)
		}
	}
	e.attached = true
}

// static is a prepare that readies nothing: every run makes the same calls.
func (e *benchEnv) static(call benchCall) func(*testing.B, int) benchCall {
	return func(*testing.B, int) benchCall { return call }
}

// seedCall runs the seed script on key(i) with a window of 1s and limit events, and the
// caller's clock, with a fresh member as Limiter.Allow would make.
func (e *benchEnv) seedCall(key func(i int64) string, limit int) benchCall {
	return e.seedCallOn(e.rdb, key, limit)
}

// seedCallOn is seedCall through c: e.rdb, or its AutoPipeliner (row (s')).
func (e *benchEnv) seedCallOn(c redis.Scripter, key func(i int64) string, limit int) benchCall {
	return func(ctx context.Context, i int64) (benchResult, error) {
		r, err := e.seed.Run(ctx, c, []string{key(i)}, time.Now().UnixMilli(), time.Second.Milliseconds(), limit, throttle.NewMember()).Int64Slice()
		switch {
		case err != nil:
			return 0, fmt.Errorf("seed script: %w", err)
		case len(r) != 2:
			return 0, fmt.Errorf("seed script: reply %v, want 2 integers", r)
		case r[0] == 1:
			return benchAdmitted, nil
		}
		return benchDenied, nil
	}
}

// plainQuotasCall is call i of row (c0): row (c)'s keys and quotas (a tenant's 1 s and
// 1 h windows, the type's 1 s) decided by testdata/plain_quotas.lua, by the real clock.
func (e *benchEnv) plainQuotasCall(ctx context.Context, i int64) (benchResult, error) {
	t := benchTenantNames[i%benchTenants]
	r, err := e.plainQ.Run(ctx, e.rdb, []string{"bench:plain:3q:" + t, "bench:plain:3q:type"}, time.Now().UnixMilli(), throttle.NewMember(),
		benchHuge, time.Hour.Milliseconds(), 1, benchHuge, time.Second.Milliseconds(), 1, benchHuge, time.Second.Milliseconds(), 2).Int64Slice()
	switch {
	case err != nil:
		return 0, fmt.Errorf("plain_quotas script: %w", err)
	case len(r) == 0:
		return 0, fmt.Errorf("plain_quotas script: an empty reply")
	case r[0] == 1:
		return benchAdmitted, nil
	}
	return benchDenied, nil
}

// preparePlainReserve readies a run of row (d0): row (d)'s hot key, its window filled,
// each timed call reserving with a new token by testdata/plain_reserve.lua, by the real
// clock.
func (e *benchEnv) preparePlainReserve(b *testing.B, run int) benchCall {
	return e.preparePlain(b, "reserve-"+strconv.Itoa(run), benchHotLimit, 0)
}

// preparePlainBacklog readies a run of row (e0): row (e)'s limit of 1000/1s on one log
// of its own, its window filled and then benchBacklog reservations made, by
// testdata/plain_reserve.lua, before the timed calls reserve one more each.
func (e *benchEnv) preparePlainBacklog(b *testing.B, run int) benchCall {
	return e.preparePlain(b, "backlog-"+strconv.Itoa(run), benchTypeLimit, benchBacklog)
}

// preparePlain fills the window of the plain reservation log named name with limit
// admissions, makes backlog reservations, and returns the timed call: a reservation with
// a new token, by the real clock.
func (e *benchEnv) preparePlain(b *testing.B, name string, limit, backlog int) benchCall {
	keys := []string{"bench:plain:" + name, "bench:plain:pending:" + name, "bench:plain:leases:" + name}
	call := func(ctx context.Context, token string) (int64, error) {
		r, err := e.plainR.Run(ctx, e.rdb, keys, time.Now().UnixMilli(), time.Second.Milliseconds(), limit, token).Int64Slice()
		if err == nil && len(r) != 2 {
			err = fmt.Errorf("reply %v, want 2 integers", r)
		}
		if err != nil {
			return 0, fmt.Errorf("plain_reserve script: %w", err)
		}
		return r[0], nil
	}
	for i := range limit {
		if allowed, err := call(e.ctx, "a"+strconv.Itoa(i)); err != nil || allowed != 1 {
			b.Fatalf("%s: filling the window: call %d of %d: %d, %v; want an admission", name, i+1, limit, allowed, err)
		}
	}
	for i, admitted, reserved := 0, 0, 0; reserved < backlog; i++ { // admitted: in a gap (benchMostlyReserved)
		allowed, err := call(e.ctx, "w"+strconv.Itoa(i))
		if err != nil {
			b.Fatalf("%s: making the backlog: call %d: %v", name, i+1, err)
		}
		if allowed == 1 {
			if admitted++; admitted*100 > backlog {
				b.Fatalf("%s: making the backlog: %d admitted, %d reserved; want at most one in 100 admitted", name, admitted, reserved)
			}
		} else {
			reserved++
		}
	}
	return func(ctx context.Context, i int64) (benchResult, error) {
		allowed, err := call(ctx, "t-"+strconv.FormatInt(i, 10))
		if err != nil || allowed == 1 {
			return benchAdmitted, err
		}
		return benchReserved, nil
	}
}

// allowCall decides req(i) with l by the real clock.
func (e *benchEnv) allowCall(l *throttle.Limiter, req func(i int64) throttle.Request) benchCall {
	return func(ctx context.Context, i int64) (benchResult, error) {
		d, err := l.Allow(ctx, req(i))
		switch {
		case err != nil:
			return 0, err
		case d.Allowed:
			return benchAdmitted, nil
		case d.Reserved:
			return benchReserved, nil
		}
		return benchDenied, nil
	}
}

// prepareReserve readies a run of row (d): a tenant of its own whose 100/1s window is
// already full, so that every timed call is a denial that writes a new reservation (a new
// token each), behind those of the calls before it.
func (e *benchEnv) prepareReserve(b *testing.B, run int) benchCall {
	key := throttle.Key{TaskType: "bench:reserve", Tenant: "hot-" + strconv.Itoa(run)}
	quotas := []throttle.Quota{tenantQuota(benchHotLimit, time.Second)}
	for i := range benchHotLimit {
		d, err := e.lim.Allow(e.ctx, throttle.Request{Key: key, Quotas: quotas})
		if err != nil || !d.Allowed {
			b.Fatalf("(d) filling the window: call %d of %d: %+v, %v; want an admission", i+1, benchHotLimit, d, err)
		}
	}
	prefix := "d" + strconv.Itoa(run) + "-"
	return e.allowCall(e.lim, func(i int64) throttle.Request {
		return throttle.Request{Key: key, Quotas: quotas, Reservation: prefix + strconv.FormatInt(i, 10)}
	})
}

// prepareBacklog readies a run of row (e): a task type of its own, with a type quota of
// 1000/1s, whose log holds at least 10,000 reservations of 100 tenants (the first calls
// are admitted until the window is full); each timed call then makes one more, with a new
// token and the next tenant.
func (e *benchEnv) prepareBacklog(b *testing.B, run int) benchCall {
	taskType := "bench:backlog-" + strconv.Itoa(run)
	quotas := []throttle.Quota{typeQuota(benchTypeLimit, time.Second)}
	var next atomic.Int64 // token number, shared by the fill and the timed calls
	req := func(tenant int64) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: taskType, Tenant: benchTenantNames[tenant%100]}, Quotas: quotas,
			Reservation: "e" + strconv.Itoa(run) + "-" + strconv.FormatInt(next.Add(1), 10)}
	}
	var reserved atomic.Int64
	fill := e.allowCall(e.lim, req)
	out, err := benchParallel(e.ctx, math.MaxInt64, func(ctx context.Context, i int64) (benchResult, error) {
		if reserved.Load() >= benchBacklog {
			return 0, errBenchStop
		}
		r, err := fill(ctx, i)
		if r == benchReserved {
			reserved.Add(1)
		}
		return r, err
	})
	if err != nil || out.denied > 0 || out.admitted > benchTypeLimit*int64(2+out.end.Sub(out.start)/time.Second) {
		b.Fatalf("(e) filling the backlog: %d admitted, %d reserved, %d denied in %v, %v; want at most %d admitted per second, then reservations",
			out.admitted, out.reserved, out.denied, out.end.Sub(out.start).Round(time.Millisecond), err, benchTypeLimit)
	}
	return e.allowCall(e.lim, req)
}

// sampleScriptTimes makes 2 x benchSample more calls of row (e), untimed, in batches of
// 4 x benchCallers: the first half with SLOWLOG off, read from INFO commandstats and
// latencystats; the second with SLOWLOG recording every command, each batch's log read and
// reset before the next so that none is dropped. It returns both halves' mean and p99
// script execution times, and the second's p50 and maximum. Redis 7 also logs every
// redis.call a script makes, within the script's own time: the first half shows how much
// that logging adds.
func (e *benchEnv) sampleScriptTimes(b *testing.B, call benchCall) string {
	const batch = 4 * benchCallers
	const maxLen = 100_000 // entries a batch may leave: 390 per call
	batches := func(each func()) {
		for done := int64(0); done < benchSample; done += batch {
			each()
			out, err := benchParallel(e.ctx, min(batch, benchSample-done), call)
			if err == nil {
				err = benchAllReserved(out)
			}
			if err != nil {
				b.Fatalf("(e) sampled calls: %v", err)
			}
		}
	}

	if err := e.rdb.ConfigResetStat(e.ctx).Err(); err != nil {
		b.Fatal(err)
	}
	batches(func() {})
	quiet, err := redistest.ReadStats(e.ctx, e.rdb)
	if err != nil {
		b.Fatal(err)
	}

	old, err := e.rdb.ConfigGet(e.ctx, "slowlog-*").Result()
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		for _, k := range []string{"slowlog-log-slower-than", "slowlog-max-len"} {
			if err := e.rdb.ConfigSet(e.ctx, k, old[k]).Err(); err != nil {
				b.Errorf("restore %s: %v", k, err)
			}
		}
		_ = e.rdb.SlowLogReset(e.ctx).Err()
	}()
	for k, v := range map[string]string{"slowlog-log-slower-than": "0", "slowlog-max-len": strconv.Itoa(maxLen)} {
		if err := e.rdb.ConfigSet(e.ctx, k, v).Err(); err != nil {
			b.Fatal(err)
		}
	}
	var durations []time.Duration
	entries, full := 0, false
	read := func() { // the previous batch's log, then a clean one
		ds, n, err := redistest.SlowlogDurations(e.ctx, e.rdb, "evalsha", "eval")
		if err != nil {
			b.Fatal(err)
		}
		durations, entries, full = append(durations, ds...), entries+n, full || n >= maxLen
		if err := e.rdb.SlowLogReset(e.ctx).Err(); err != nil {
			b.Fatal(err)
		}
	}
	read()
	durations, entries = nil, 0
	batches(read)
	read()
	if len(durations) == 0 {
		return "SLOWLOG recorded no script call"
	}
	var sum time.Duration
	for _, d := range durations {
		sum += d
	}
	slices.Sort(durations)
	at := func(p float64) int64 { // nearest rank, microseconds
		return durations[max(int(math.Ceil(p*float64(len(durations))))-1, 0)].Microseconds()
	}
	us := func(d time.Duration) float64 { return d.Seconds() * 1e6 }
	note := fmt.Sprintf("%d more calls in batches of %d: script mean %.1f us, p99 %.1f us (INFO latencystats); "+
		"then %d with SLOWLOG logging every command (%.1f entries per call): script mean %.1f us, p50 %d us, p99 %d us, max %d us",
		benchSample, batch, us(quiet.Command("evalsha", "eval").PerCall()), us(quiet.Latency["evalsha"]["p99"]),
		len(durations), float64(entries)/float64(benchSample), us(sum)/float64(len(durations)), at(0.50), at(0.99), at(1))
	if len(durations) != benchSample || full {
		note += fmt.Sprintf(" (SLOWLOG was full or missed calls: %d script entries for %d calls)", len(durations), benchSample)
	}
	return note
}

// benchAllAdmitted requires every call admitted.
func benchAllAdmitted(o benchOutcomes) error {
	if o.admitted != o.calls {
		return fmt.Errorf("%d of %d calls admitted, want all (%d reserved, %d denied)", o.admitted, o.calls, o.reserved, o.denied)
	}
	return nil
}

// benchAllReserved requires every call denied with a reservation.
func benchAllReserved(o benchOutcomes) error {
	if o.reserved != o.calls {
		return fmt.Errorf("%d of %d calls reserved, want all (%d admitted, %d denied without a reservation)", o.reserved, o.calls, o.admitted, o.denied)
	}
	return nil
}

// benchMostlyReserved requires every call of rows (d0) and (e0) to reserve but at most
// one in a hundred, which may be admitted: the plain script's end slot is the limit-th
// newest entry's instant plus the window, or its newest entry's if later, not the
// earliest instant with room, so that it can leave a window with room that the real
// clock then reaches (in (d0) 18-46 admissions in runs of 35,000-81,000 calls, in (e0)
// 102 in 57,836). The plain script denies nothing without a reservation.
func benchMostlyReserved(o benchOutcomes) error {
	if o.admitted*100 > o.calls {
		return fmt.Errorf("%d of %d calls reserved, want all but at most one in 100 admitted (%d admitted, %d denied without a reservation)", o.reserved, o.calls, o.admitted, o.denied)
	}
	return nil
}

// benchHotBound requires no more admissions in a hot-key run than a 100/1s sliding window
// allows over the milliseconds the run spanned (calls decided at whole milliseconds in
// [start, end]; each block of 1000 consecutive ones is one window), plus slack windows, and
// no reservation. Limiter.Allow never decides before its caller's clock nor after the
// latest clock any caller read, so it keeps the exact bound (slack 0). The seed decides by
// each caller's clock as its call reaches Redis, which is out of order among 64 callers:
// a call trims what an earlier-stamped call arriving later would still count, so the seed
// gets a window of slack.
func benchHotBound(slack int64) func(o benchOutcomes) error {
	return func(o benchOutcomes) error {
		spanMS := o.end.UnixMilli() - o.start.UnixMilli() + 1
		limit := benchHotLimit * ((spanMS+999)/1000 + slack)
		if o.admitted > limit || o.reserved > 0 {
			return fmt.Errorf("%d of %d calls admitted and %d reserved in %d ms; want at most %d admitted (%d/1s) and none reserved",
				o.admitted, o.calls, o.reserved, spanMS, limit, benchHotLimit)
		}
		return nil
	}
}
