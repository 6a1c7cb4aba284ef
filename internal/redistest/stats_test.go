package redistest_test

import (
	"context"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestParseStats reads a fixed INFO text, in Redis 7's format with CRLF line ends, exactly.
func TestParseStats(t *testing.T) {
	t.Parallel()
	info := strings.ReplaceAll(`# CPU
used_cpu_sys:12.345678
used_cpu_user:0.000007
used_cpu_sys_children:0.000000
used_cpu_user_children:0.000000
used_cpu_sys_main_thread:12.000001
used_cpu_user_main_thread:0.000005

# Commandstats
cmdstat_ping:calls=10,usec=25,usec_per_call=2.50,rejected_calls=0,failed_calls=0
cmdstat_config|resetstat:calls=1,usec=48,usec_per_call=48.00,rejected_calls=0,failed_calls=0
cmdstat_evalsha:calls=3,usec=30,usec_per_call=10.00,rejected_calls=1,failed_calls=2

# Errorstats
errorstat_NOSCRIPT:count=2
errorstat_ERR:count=1

# Latencystats
latency_percentiles_usec_ping:p50=0.001,p99=1.003,p99.9=3.007
latency_percentiles_usec_config|resetstat:p50=48.127,p99=48.127,p99.9=48.127
`, "\n", "\r\n")
	s, err := redistest.ParseStats(info)
	if err != nil {
		t.Fatal(err)
	}
	if want := 12*time.Second + 345678*time.Microsecond; s.CPUSys != want {
		t.Errorf("CPUSys = %v, want %v", s.CPUSys, want)
	}
	if want := 7 * time.Microsecond; s.CPUUser != want {
		t.Errorf("CPUUser = %v, want %v", s.CPUUser, want)
	}
	if want := 12*time.Second + 345685*time.Microsecond; s.CPU() != want {
		t.Errorf("CPU() = %v, want %v", s.CPU(), want)
	}
	wantCmds := map[string]redistest.CommandStat{
		"ping":             {Calls: 10, Total: 25 * time.Microsecond},
		"config|resetstat": {Calls: 1, Total: 48 * time.Microsecond},
		"evalsha":          {Calls: 3, Total: 30 * time.Microsecond, RejectedCalls: 1, FailedCalls: 2},
	}
	if len(s.Commands) != len(wantCmds) {
		t.Errorf("Commands = %v, want %v", s.Commands, wantCmds)
	}
	for name, want := range wantCmds {
		if got := s.Commands[name]; got != want {
			t.Errorf("Commands[%q] = %+v, want %+v", name, got, want)
		}
	}
	if got, want := s.Commands["ping"].PerCall(), 2500*time.Nanosecond; got != want {
		t.Errorf("ping PerCall() = %v, want %v", got, want)
	}
	if got, want := s.Command("ping", "evalsha", "eval"), (redistest.CommandStat{Calls: 13, Total: 55 * time.Microsecond, RejectedCalls: 1, FailedCalls: 2}); got != want {
		t.Errorf(`Command("ping", "evalsha", "eval") = %+v, want %+v`, got, want)
	}
	if len(s.Errors) != 2 || s.Errors["NOSCRIPT"] != 2 || s.Errors["ERR"] != 1 {
		t.Errorf("Errors = %v, want NOSCRIPT:2 ERR:1", s.Errors)
	}

	wantLatency := map[string]map[string]time.Duration{
		"ping":             {"p50": time.Nanosecond, "p99": 1003 * time.Nanosecond, "p99.9": 3007 * time.Nanosecond},
		"config|resetstat": {"p50": 48127 * time.Nanosecond, "p99": 48127 * time.Nanosecond, "p99.9": 48127 * time.Nanosecond},
	}
	if len(s.Latency) != len(wantLatency) {
		t.Errorf("Latency = %v, want %v", s.Latency, wantLatency)
	}
	for name, want := range wantLatency {
		if got := s.Latency[name]; !maps.Equal(got, want) {
			t.Errorf("Latency[%q] = %v, want %v", name, got, want)
		}
	}

	for _, bad := range []string{"# CPU\r\nused_cpu_user:1.0\r\n", "used_cpu_sys:1.5\r\nused_cpu_user:-1\r\n",
		"used_cpu_sys:1\r\nused_cpu_user:1\r\ncmdstat_get:calls=x,usec=1\r\n",
		"used_cpu_sys:1\r\nused_cpu_user:1\r\nlatency_percentiles_usec_get:p50=1e3\r\n"} {
		if _, err := redistest.ParseStats(bad); err == nil {
			t.Errorf("ParseStats(%q) = nil error, want one", bad)
		}
	}
}

// TestStats_Sub subtracts counters, dropping those that did not move and counting from
// zero those that went down (a CONFIG RESETSTAT in between).
func TestStats_Sub(t *testing.T) {
	t.Parallel()
	before := redistest.Stats{CPUSys: time.Second, CPUUser: 2 * time.Second,
		Commands: map[string]redistest.CommandStat{"ping": {Calls: 5, Total: 10}, "get": {Calls: 2, Total: 4}, "set": {Calls: 9, Total: 90}},
		Errors:   map[string]int64{"ERR": 3, "NOSCRIPT": 1}}
	after := redistest.Stats{CPUSys: 1500 * time.Millisecond, CPUUser: 2 * time.Second,
		Commands: map[string]redistest.CommandStat{"ping": {Calls: 8, Total: 16}, "get": {Calls: 2, Total: 4}, "set": {Calls: 1, Total: 7, FailedCalls: 1}},
		Errors:   map[string]int64{"ERR": 3, "NOSCRIPT": 4}}
	d := after.Sub(before)
	if d.CPUSys != 500*time.Millisecond || d.CPUUser != 0 {
		t.Errorf("CPU delta = sys %v user %v, want sys 500ms user 0s", d.CPUSys, d.CPUUser)
	}
	want := map[string]redistest.CommandStat{"ping": {Calls: 3, Total: 6}, "set": {Calls: 1, Total: 7, FailedCalls: 1}}
	if len(d.Commands) != len(want) || d.Commands["ping"] != want["ping"] || d.Commands["set"] != want["set"] {
		t.Errorf("Commands delta = %v, want %v", d.Commands, want)
	}
	if len(d.Errors) != 1 || d.Errors["NOSCRIPT"] != 3 {
		t.Errorf("Errors delta = %v, want NOSCRIPT:3", d.Errors)
	}
}

// TestReadStats counts, on one connection of a fresh server, exactly the commands sent
// after CONFIG RESETSTAT: 10 PINGs, one EVALSHA of an unknown script (a NOSCRIPT error), and
// then the INFO that ReadStats sends, seen by the next ReadStats.
func TestReadStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := redistest.Start(t).Conn() // one connection: its handshake comes before the reset
	t.Cleanup(func() { _ = conn.Close() })
	if err := conn.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for range 10 {
		if err := conn.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	const unknownSHA = "0123456789abcdef0123456789abcdef01234567"
	if err := conn.EvalSha(ctx, unknownSHA, nil).Err(); !redis.HasErrorPrefix(err, "NOSCRIPT") {
		t.Fatalf("EVALSHA of an unknown script: %v, want NOSCRIPT", err)
	}

	s1, err := redistest.ReadStats(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]redistest.CommandStat{
		"ping":             {Calls: 10},
		"evalsha":          {Calls: 1, FailedCalls: 1},
		"config|resetstat": {Calls: 1},
	}
	if len(s1.Commands) != len(want) {
		t.Errorf("Commands = %+v, want only %v", s1.Commands, want)
	}
	for name, w := range want {
		got := s1.Commands[name]
		if got.Calls != w.Calls || got.FailedCalls != w.FailedCalls || got.RejectedCalls != 0 {
			t.Errorf("Commands[%q] = %+v, want calls=%d failed_calls=%d rejected_calls=0", name, got, w.Calls, w.FailedCalls)
		}
	}
	if p := s1.Latency["ping"]; len(p) != 3 || p["p50"] <= 0 || p["p50"] > p["p99"] || p["p99"] > p["p99.9"] {
		t.Errorf("Latency[ping] = %v, want p50 <= p99 <= p99.9, all > 0", p)
	}
	if len(s1.Errors) != 1 || s1.Errors["NOSCRIPT"] != 1 {
		t.Errorf("Errors = %v, want NOSCRIPT:1", s1.Errors)
	}
	if s1.CPU() <= 0 {
		t.Errorf("CPU() = %v after starting and answering 13 commands, want > 0", s1.CPU())
	}

	s2, err := redistest.ReadStats(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	d := s2.Sub(s1)
	if len(d.Commands) != 1 || d.Commands["info"].Calls != 1 || len(d.Errors) != 0 {
		t.Errorf("between two ReadStats: Commands %+v, Errors %v; want only info calls=1", d.Commands, d.Errors)
	}
	if d.CPU() < 0 || s2.CPU() < s1.CPU() {
		t.Errorf("CPU went from %v to %v", s1.CPU(), s2.CPU())
	}
}

// TestSlowlogDurations logs every command and finds exactly the PINGs among them.
func TestSlowlogDurations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	for _, kv := range [][2]string{{"slowlog-log-slower-than", "0"}, {"slowlog-max-len", "1000"}} {
		if err := rdb.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := rdb.SlowLogReset(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for i := range 7 {
		if err := rdb.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if err := rdb.Echo(ctx, "x").Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	pings, entries, err := redistest.SlowlogDurations(ctx, rdb, "ping")
	if err != nil {
		t.Fatal(err)
	}
	if len(pings) != 7 || entries < 7+4 {
		t.Errorf("SlowlogDurations(ping) = %v of %d entries, want 7 of at least 11 (7 PING, 4 ECHO)", pings, entries)
	}
	for _, d := range pings {
		if d < 0 || d%time.Microsecond != 0 {
			t.Errorf("PING duration %v, want a whole number of microseconds >= 0", d)
		}
	}
	both, _, err := redistest.SlowlogDurations(ctx, rdb, "ping", "echo")
	if err != nil {
		t.Fatal(err)
	}
	if len(both) != 11 {
		t.Errorf("SlowlogDurations(ping, echo) has %d entries, want 11", len(both))
	}
}

// TestStartServerPinned pins a server to CPU 0, which every machine has, and reads its
// affinity back from the kernel. Without taskset (or where it may not pin) the server runs
// unpinned, and then it must still run.
func TestStartServerPinned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, unpinned := redistest.StartServerPinned(t, 0)
	pinned := unpinned == nil
	rdb := s.Client()
	pid, cpus, err := redistest.ServerCPUs(ctx, rdb)
	if err != nil {
		t.Fatal(err)
	}
	own, err := redistest.ProcessCPUs(0)
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case pid <= 0:
		t.Errorf("ServerCPUs: pid %d, want > 0", pid)
	case pinned && cpus != "0":
		t.Errorf("pinned to CPU 0, but the kernel lets redis-server (pid %d) run on %q", pid, cpus)
	case !pinned && cpus != own:
		t.Errorf("not pinned, but redis-server (pid %d) may run on %q, this test on %q", pid, cpus, own)
	}
	s.Stop()
	s.Restart()
	if _, again, err := redistest.ServerCPUs(ctx, rdb); err != nil || again != cpus {
		t.Errorf("after Restart: CPUs %q, %v; want %q", again, err, cpus)
	}
}

// TestStartServerPinned_NoSuchCPU asks for a core no machine has: taskset refuses, and the
// server runs unpinned.
func TestStartServerPinned_NoSuchCPU(t *testing.T) {
	t.Parallel()
	s, unpinned := redistest.StartServerPinned(t, 1<<20)
	if unpinned == nil {
		t.Errorf("StartServerPinned(CPU %d) reports pinned", 1<<20)
	}
	if err := s.Client().Ping(context.Background()).Err(); err != nil {
		t.Errorf("unpinned server: PING: %v", err)
	}
}
