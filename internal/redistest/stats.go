package redistest

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Stats is what a server reports, in INFO cpu, commandstats and errorstats, about the work
// it has done since it started (CPU) or since the last CONFIG RESETSTAT (the rest). Take
// two and subtract them (Sub) to see the work in between.
type Stats struct {
	// CPUSys and CPUUser are the CPU time the server process (all its threads) has spent
	// in the kernel and in user space since it started: used_cpu_sys and used_cpu_user,
	// which Redis reports to the microsecond.
	CPUSys, CPUUser time.Duration
	// Commands holds each command's counters, by the name INFO commandstats gives it
	// after "cmdstat_": lower case, with the subcommand after '|' ("ping", "evalsha",
	// "config|resetstat"). A command never called since the last reset is absent.
	Commands map[string]CommandStat
	// Errors counts the error replies by their first word (INFO errorstats after
	// "errorstat_"), e.g. "NOSCRIPT", "ERR", "WRONGTYPE".
	Errors map[string]int64
	// Latency holds, by command name as in Commands, the percentiles of its calls'
	// execution times that INFO latencystats reports (Redis 7+, latency-tracking on, its
	// default), keyed as INFO writes them: "p50", "p99", "p99.9" by default
	// (latency-tracking-info-percentiles). Redis keeps them in a histogram that is exact
	// to 2 significant digits (within 1%) and reports each to the nanosecond.
	Latency map[string]map[string]time.Duration
}

// CommandStat is one command's line of INFO commandstats.
type CommandStat struct {
	Calls         int64         // calls executed, failed ones included
	Total         time.Duration // time spent executing them (INFO usec), to the microsecond
	RejectedCalls int64         // calls refused before executing (e.g. a wrong arity)
	FailedCalls   int64         // calls that executed and replied with an error
}

// PerCall is the mean execution time of one call, c.Total / c.Calls (0 without calls).
func (c CommandStat) PerCall() time.Duration {
	if c.Calls == 0 {
		return 0
	}
	return c.Total / time.Duration(c.Calls)
}

// CPU is the server's CPU time in both modes, CPUSys + CPUUser.
func (s Stats) CPU() time.Duration { return s.CPUSys + s.CPUUser }

// Command returns the counters of the named commands added up, e.g. Command("evalsha",
// "eval") for every script call however it was sent. Names are as in Stats.Commands.
func (s Stats) Command(names ...string) CommandStat {
	var sum CommandStat
	for _, name := range names {
		c := s.Commands[name]
		sum.Calls += c.Calls
		sum.Total += c.Total
		sum.RejectedCalls += c.RejectedCalls
		sum.FailedCalls += c.FailedCalls
	}
	return sum
}

// Sub returns the work done between before and s: every counter of s minus the same
// counter of before. A counter that went down (a CONFIG RESETSTAT in between) is taken
// as counted from zero, so the result is never negative. Percentiles do not subtract:
// Latency is s's, counted since the last CONFIG RESETSTAT, so reset before the work to
// read its percentiles alone.
func (s Stats) Sub(before Stats) Stats {
	d := Stats{CPUSys: max(s.CPUSys-before.CPUSys, 0), CPUUser: max(s.CPUUser-before.CPUUser, 0),
		Commands: make(map[string]CommandStat, len(s.Commands)), Errors: make(map[string]int64, len(s.Errors)),
		Latency: s.Latency}
	for name, c := range s.Commands {
		b := before.Commands[name]
		if c.Calls < b.Calls || c.Total < b.Total {
			b = CommandStat{}
		}
		delta := CommandStat{Calls: c.Calls - b.Calls, Total: c.Total - b.Total,
			RejectedCalls: max(c.RejectedCalls-b.RejectedCalls, 0), FailedCalls: max(c.FailedCalls-b.FailedCalls, 0)}
		if delta != (CommandStat{}) {
			d.Commands[name] = delta
		}
	}
	for name, n := range s.Errors {
		if b := before.Errors[name]; n >= b {
			n -= b
		}
		if n > 0 {
			d.Errors[name] = n
		}
	}
	return d
}

// ReadStats reads s with one INFO cpu commandstats errorstats latencystats. The INFO call
// itself is counted only by the next ReadStats.
func ReadStats(ctx context.Context, rdb redis.Cmdable) (Stats, error) {
	info, err := rdb.Info(ctx, "cpu", "commandstats", "errorstats", "latencystats").Result()
	if err != nil {
		return Stats{}, fmt.Errorf("redistest: INFO cpu commandstats errorstats latencystats: %w", err)
	}
	return ParseStats(info)
}

// ParseStats reads Stats from the text of INFO, which must hold the cpu section (the
// commandstats, errorstats and latencystats sections may be absent: then Commands, Errors
// and Latency are empty).
func ParseStats(info string) (Stats, error) {
	s := Stats{Commands: map[string]CommandStat{}, Errors: map[string]int64{}, Latency: map[string]map[string]time.Duration{}}
	fields := parseInfo(info)
	for name, dst := range map[string]*time.Duration{"used_cpu_sys": &s.CPUSys, "used_cpu_user": &s.CPUUser} {
		v, ok := fields[name]
		if !ok {
			return Stats{}, fmt.Errorf("redistest: INFO has no %s", name)
		}
		d, err := parseDecimal(v, time.Second)
		if err != nil {
			return Stats{}, fmt.Errorf("redistest: INFO %s:%s: %w", name, v, err)
		}
		*dst = d
	}
	for field, v := range fields {
		if name, ok := strings.CutPrefix(field, "cmdstat_"); ok {
			kv := parseList(v)
			var c CommandStat
			for key, dst := range map[string]*int64{"calls": &c.Calls, "rejected_calls": &c.RejectedCalls, "failed_calls": &c.FailedCalls} {
				if kv[key] == "" && key != "calls" { // Redis before 6.2 has no rejected_calls, failed_calls
					continue
				}
				n, err := strconv.ParseInt(kv[key], 10, 64)
				if err != nil {
					return Stats{}, fmt.Errorf("redistest: INFO %s:%s: %s: %w", field, v, key, err)
				}
				*dst = n
			}
			usec, err := strconv.ParseInt(kv["usec"], 10, 64)
			if err != nil {
				return Stats{}, fmt.Errorf("redistest: INFO %s:%s: usec: %w", field, v, err)
			}
			c.Total = time.Duration(usec) * time.Microsecond
			s.Commands[name] = c
		}
		if name, ok := strings.CutPrefix(field, "errorstat_"); ok {
			n, err := strconv.ParseInt(parseList(v)["count"], 10, 64)
			if err != nil {
				return Stats{}, fmt.Errorf("redistest: INFO %s:%s: count: %w", field, v, err)
			}
			s.Errors[name] = n
		}
		if name, ok := strings.CutPrefix(field, "latency_percentiles_usec_"); ok {
			ps := map[string]time.Duration{}
			for p, us := range parseList(v) {
				d, err := parseDecimal(us, time.Microsecond)
				if err != nil {
					return Stats{}, fmt.Errorf("redistest: INFO %s:%s: %s: %w", field, v, p, err)
				}
				ps[p] = d
			}
			s.Latency[name] = ps
		}
	}
	return s, nil
}

// parseList splits an INFO value of the form "k1=v1,k2=v2".
func parseList(v string) map[string]string {
	m := map[string]string{}
	for _, kv := range strings.Split(v, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

// parseDecimal reads a non-negative decimal number of units such as "12.345678" exactly,
// to the nanosecond (digits beyond that are dropped).
func parseDecimal(v string, unit time.Duration) (time.Duration, error) {
	whole, frac, _ := strings.Cut(v, ".")
	if whole == "" || strings.Trim(whole, "0123456789") != "" || strings.Trim(frac, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a non-negative decimal number", v)
	}
	n, err := strconv.ParseInt(whole, 10, 64)
	if err != nil {
		return 0, err
	}
	d := time.Duration(n) * unit
	scale := time.Duration(1)
	for _, digit := range frac[:min(len(frac), 9)] {
		scale *= 10
		d += unit * time.Duration(digit-'0') / scale // exact while unit/scale >= 1ns
	}
	return d, nil
}

// ServerCPUs returns the process id of the server rdb talks to (INFO server process_id)
// and the CPU cores that process may run on, as the kernel lists them in
// /proc/<pid>/status Cpus_allowed_list ("1", "0-1", "0,2-3"). It works only for a server
// on this Linux machine: elsewhere the error says why.
func ServerCPUs(ctx context.Context, rdb redis.Cmdable) (pid int, cpus string, err error) {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return 0, "", fmt.Errorf("redistest: INFO server: %w", err)
	}
	pid, err = strconv.Atoi(parseInfo(info)["process_id"])
	if err != nil {
		return 0, "", fmt.Errorf("redistest: INFO server process_id: %w", err)
	}
	cpus, err = ProcessCPUs(pid)
	return pid, cpus, err
}

// ProcessCPUs returns the CPU cores that process pid (0: this process) may run on, from
// /proc/<pid>/status Cpus_allowed_list ("1", "0-1", "0,2-3"). It works only on Linux.
func ProcessCPUs(pid int) (string, error) {
	path := "/proc/self/status"
	if pid != 0 {
		path = fmt.Sprintf("/proc/%d/status", pid)
	}
	status, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("redistest: CPU affinity of process %d: %w", pid, err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("redistest: %s has no Cpus_allowed_list", path)
}

// SlowlogDurations returns the execution times of the entries of the server's SLOWLOG
// whose command is one of names (lower case, as in Stats.Commands: "evalsha"), oldest
// first, to the microsecond, and how many entries the log held in all. To time every
// call, set slowlog-log-slower-than to 0 and slowlog-max-len above the number of calls,
// then SLOWLOG RESET, before the calls: if the log held slowlog-max-len entries, older
// ones were dropped.
func SlowlogDurations(ctx context.Context, rdb redis.Cmdable, names ...string) (durations []time.Duration, entries int, err error) {
	log, err := rdb.SlowLogGet(ctx, -1).Result() // -1: every entry (Redis 7)
	if err != nil {
		return nil, 0, fmt.Errorf("redistest: SLOWLOG GET -1: %w", err)
	}
	for i := len(log) - 1; i >= 0; i-- { // SLOWLOG GET lists the newest first
		if e := log[i]; len(e.Args) > 0 && slices.Contains(names, strings.ToLower(e.Args[0])) {
			durations = append(durations, e.Duration)
		}
	}
	return durations, len(log), nil
}

// DescribePinning returns the two header lines a benchmark prints about where it ran:
// the server's version, pid, pinning (to core cpu, or why not: unpinned, as
// StartServerPinned returned it) and the cores it may run on; and the cores this process
// may run on. A fact that cannot be read is replaced by the error that says why.
func DescribePinning(ctx context.Context, rdb redis.Cmdable, cpu int, unpinned error) (server, clientCPUs string) {
	version := "?"
	if info, err := rdb.Info(ctx, "server").Result(); err == nil {
		version = parseInfo(info)["redis_version"]
	}
	pid, serverCPUs, err := ServerCPUs(ctx, rdb)
	if err != nil {
		serverCPUs = err.Error()
	}
	pinning := fmt.Sprintf("pinned to CPU %d by taskset", cpu)
	if unpinned != nil {
		pinning = fmt.Sprintf("NOT pinned (%v)", unpinned)
	}
	clientCPUs, err = ProcessCPUs(0)
	if err != nil {
		clientCPUs = err.Error()
	}
	return fmt.Sprintf("redis-server %s (pid %d) %s: may run on CPUs %s", version, pid, pinning, serverCPUs), clientCPUs
}

// PrintBenchTable prints a benchmark's side-by-side table on stdout, after the rows'
// result lines, under name and indented by four spaces: testing prints a parent
// benchmark's b.Log only with -v, and benchstat takes no indented line for a
// "key: value" setting.
func PrintBenchTable(name, table string) {
	fmt.Printf("\n%s\n    %s\n\n", name, strings.ReplaceAll(table, "\n", "\n    "))
}
