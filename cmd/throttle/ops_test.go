package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// t0 is the instant the tests of inspect, explain and reset set their logs up at (with
// AllowAt): every value they expect follows from it. Keys outlive their entries by their
// windows from the moment they are written, so the tests read them well within that.
var t0 = time.Date(2026, 3, 4, 10, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

func rfc(t time.Time) string { return t.Format(time.RFC3339Nano) }

// cliIn runs the command in-process with stdin and returns its exit status, stdout and
// stderr.
func cliIn(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := runIO(context.Background(), args, strings.NewReader(stdin), &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// decode runs args (with -json) and decodes stdout into v, failing t unless the exit
// status is exitOK and stderr is empty.
func decode(t *testing.T, v any, args ...string) {
	t.Helper()
	code, out, errOut := cli(t, append(args, "-json")...)
	if code != exitOK || errOut != "" {
		t.Fatalf("throttle %q: exit %d, stderr %q, stdout %s", args, code, errOut, out)
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("throttle %q: %v in %s", args, err, out)
	}
}

// allow decides one event at instant when, failing t on an error.
func allow(t *testing.T, lim *throttle.Limiter, req throttle.Request, when time.Time) throttle.Decision {
	t.Helper()
	d, err := lim.AllowAt(context.Background(), req, when)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// snapshot returns every key of rdb with its type, value and TTL, to show that a command
// changed nothing.
func snapshot(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		typ := rdb.Type(ctx, k).Val()
		var v any
		switch typ {
		case "zset":
			v = rdb.ZRangeWithScores(ctx, k, 0, -1).Val()
		case "hash":
			v = rdb.HGetAll(ctx, k).Val()
		default:
			v = rdb.Dump(ctx, k).Val()
		}
		ttl := rdb.PTTL(ctx, k).Val()
		fmt.Fprintf(&b, "%s %s %v ttl>0:%v\n", k, typ, v, ttl > 0)
	}
	return b.String()
}

func ptr[T any](v T) *T { return &v }

// TestExplain drives explain against logs set up at explicit instants with AllowAt and
// matches its JSON exactly: a tenant over "tenant=2/10s" (two admissions), the same with
// two reservations ahead, a pause, an admission, a cost over the limit, a type without a
// rule and a shadow rule. Every call leaves the keys exactly as they were, and no scratch
// key behind.
func TestExplain(t *testing.T) {
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_RULES", "ex:call tenant=2/10s; sh:call tenant=1/10s mode=shadow")
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	q := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 2, Window: 10 * time.Second}}}
	acme := throttle.Key{TaskType: "ex:call", Tenant: "acme"}
	allow(t, lim, throttle.Request{Key: acme, Quotas: q}, at(0))
	allow(t, lim, throttle.Request{Key: acme, Quotas: q}, at(time.Second))

	explain := func(want explainJSON, args ...string) {
		t.Helper()
		before := snapshot(t, rdb)
		var got explainJSON
		decode(t, &got, append([]string{"explain"}, args...)...)
		if !jsonEqual(got, want) {
			g, _ := json.Marshal(got)
			w, _ := json.Marshal(want)
			t.Errorf("explain %q:\n got  %s\n want %s", args, g, w)
		}
		if after := snapshot(t, rdb); after != before {
			t.Errorf("explain %q changed the keys:\nbefore\n%s\nafter\n%s", args, before, after)
		}
	}
	base := explainJSON{TaskType: "ex:call", Tenant: "acme", Cost: 1, Throttled: true, Rule: "ex:call tenant=2/10s", Mode: "enforce",
		RuleFrom: "default rule", QuotasFrom: "default rule", Weight: 1, Quota: "tenant=2/10s", Limit: 2}

	// Denied by tenant=2/10s: the oldest admission leaves the window at 10s.
	want := base
	want.At, want.Used, want.DecidedAt = at(2*time.Second), 2, ptr(at(2*time.Second))
	want.RetryAfterMS, want.RetryAt, want.Reserved = 8000, ptr(at(10*time.Second)), true
	explain(want, "-type", "ex:call", "-tenant", "acme", "-at", rfc(at(2*time.Second)))
	wantRun(t, []string{"explain", "-type", "ex:call", "-tenant", "acme", "-at", rfc(at(2 * time.Second))}, exitOK,
		`ex:call for tenant "acme", cost 1, at 2026-03-04T10:00:02.000Z: would not run now
  denied by tenant=2/10s: 2 of 2 used in its window
  it would get its slot at 2026-03-04T10:00:10.000Z (retry after 8s), with 0 reservations waiting ahead of it
  rule: ex:call tenant=2/10s (default rule; tenant quotas from default rule; weight 1)
explain decided on a scratch copy of the keys: it consumed nothing
`, "")

	// Another tenant runs now.
	want = base
	want.Tenant, want.At, want.Allowed, want.Used, want.DecidedAt = "globex", at(2*time.Second), true, 1, ptr(at(2*time.Second))
	explain(want, "-type", "ex:call", "-tenant", "globex", "-at", rfc(at(2*time.Second)))

	// Two tasks reserved the slots at 10s and 11s: a third would get 20s, 2 ahead of it.
	for i, tok := range []string{"R1", "R2"} {
		d := allow(t, lim, throttle.Request{Key: acme, Quotas: q, Reservation: tok}, at(2*time.Second))
		if !d.Reserved || !d.RetryAt().Equal(at(time.Duration(10+i)*time.Second)) {
			t.Fatalf("setup: %s: %+v; want reserved for %ds", tok, d, 10+i)
		}
	}
	want = base
	want.At, want.Used, want.DecidedAt = at(3*time.Second), 2, ptr(at(3*time.Second))
	want.RetryAfterMS, want.RetryAt, want.Reserved, want.WaitingAhead = 17000, ptr(at(20*time.Second)), true, 2
	explain(want, "-type", "ex:call", "-tenant", "acme", "-at", rfc(at(3*time.Second)))

	// Cost 3 can never fit 2/10s, the quota named.
	want = explainJSON{TaskType: "ex:call", Tenant: "acme", Cost: 3, At: at(3 * time.Second), Throttled: true, Rule: "ex:call tenant=2/10s",
		Mode: "enforce", RuleFrom: "default rule", QuotasFrom: "default rule", Weight: 1, Never: true, Quota: "tenant=2/10s", Limit: 2}
	explain(want, "-type", "ex:call", "-tenant", "acme", "-cost", "3", "-at", rfc(at(3*time.Second)))

	// Paused until 30s: denied by the pause, whatever the window says.
	if err := lim.PauseAt(context.Background(), acme, throttle.ScopeTenant, at(30*time.Second), at(3*time.Second)); err != nil {
		t.Fatal(err)
	}
	want = base
	want.At, want.Used, want.DecidedAt, want.Paused = at(5*time.Second), 2, ptr(at(5*time.Second)), true
	want.RetryAfterMS, want.RetryAt = 25000, ptr(at(30*time.Second))
	explain(want, "-type", "ex:call", "-tenant", "acme", "-at", rfc(at(5*time.Second)))

	// No rule: runs at once. A shadow rule: decided without a reservation, runs anyway.
	explain(explainJSON{TaskType: "none:call", Tenant: "acme", Cost: 1, At: at(0), Allowed: true}, "-type", "none:call", "-tenant", "acme", "-at", rfc(at(0)))
	sq := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: 10 * time.Second}}}
	allow(t, lim, throttle.Request{Key: throttle.Key{TaskType: "sh:call", Tenant: "acme"}, Quotas: sq}, at(0))
	explain(explainJSON{TaskType: "sh:call", Tenant: "acme", Cost: 1, At: at(4 * time.Second), Throttled: true, Rule: "sh:call tenant=1/10s mode=shadow",
		Mode: "shadow", RuleFrom: "default rule", QuotasFrom: "default rule", Weight: 1, RunsAnyway: true, Quota: "tenant=1/10s", Used: 1, Limit: 1,
		DecidedAt: ptr(at(4 * time.Second)), RetryAfterMS: 6000, RetryAt: ptr(at(10 * time.Second))},
		"-type", "sh:call", "-tenant", "acme", "-at", rfc(at(4*time.Second)))

	if n := len(rdb.Keys(context.Background(), "*explain*").Val()); n != 0 {
		t.Errorf("%d scratch keys left behind", n)
	}
	// -rules replaces THROTTLE_RULES; without either the rule is unknown.
	want = base
	want.Rule, want.Quota, want.Limit = "ex:call tenant=5/10s", "tenant=5/10s", 5
	want.At, want.Allowed, want.Used, want.DecidedAt = at(40*time.Second), true, 1, ptr(at(40*time.Second))
	explain(want, "-type", "ex:call", "-tenant", "acme", "-rules", "ex:call tenant=5/10s", "-at", rfc(at(40*time.Second)))
	setEnv(t, "REDIS_ADDR", srv.Addr)
	wantRun(t, []string{"explain", "-type", "ex:call", "-tenant", "acme"}, exitUsage, "",
		"throttle: explain: the rule of ex:call is unknown: THROTTLE_RULES is unset and no type override is stored; give the workers' rules with -rules or THROTTLE_RULES\n")
}

// TestInspect sets up two tenants' logs and the type's at explicit instants (an admission
// of cost 2, a reservation ahead, a pause) and matches inspect's JSON exactly, for every
// key, one tenant, and one type and tenant.
func TestInspect(t *testing.T) {
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_RULES", "in:call tenant=3/10s tenant=5/1m type=10/1s")
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	rules := []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 3, Window: 10 * time.Second}},
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 5, Window: time.Minute}},
		{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 10, Window: time.Second}},
	}
	acme := throttle.Key{TaskType: "in:call", Tenant: "acme"}
	globex := throttle.Key{TaskType: "in:call", Tenant: "globex"}
	// In time order: the type's log decides a call stamped before its latest write at that
	// write's instant.
	allow(t, lim, throttle.Request{Key: acme, Quotas: rules}, at(0))
	for i := 1; i <= 3; i++ {
		allow(t, lim, throttle.Request{Key: globex, Quotas: rules}, at(time.Duration(100*i)*time.Millisecond))
	}
	allow(t, lim, throttle.Request{Key: acme, Quotas: rules, Cost: 2}, at(time.Second))
	// globex's 4th reserves a slot at least 10.1s (when its first leaves the window) and
	// at most 11s (the limiter's bounded search may place it later, never earlier).
	d := allow(t, lim, throttle.Request{Key: globex, Quotas: rules, Reservation: "G4", Holder: "7:defaultG4"}, at(1500*time.Millisecond))
	reserved := d.RetryAt()
	if !d.Reserved || reserved.Before(at(10100*time.Millisecond)) || reserved.After(at(11*time.Second)) {
		t.Fatalf("setup: globex's 4th: %+v; want reserved for 10.1s to 11s", d)
	}
	if err := lim.PauseAt(context.Background(), acme, throttle.ScopeTenant, at(30*time.Second), at(1500*time.Millisecond)); err != nil {
		t.Fatal(err)
	}

	// At 1.9s the type's log holds what its 1s window needs: acme's cost 2 at 1s (the
	// write at 1.5s trimmed what was at or before 0.5s) and globex's reservation.
	now := at(1900 * time.Millisecond)
	typeLog := logJSON{Key: "throttle:{in:call}:type", Scope: "type", Entries: 2,
		Oldest: &entryJSON{At: at(time.Second), Kind: "admission", Cost: 2}, Newest: &entryJSON{At: reserved, Kind: "reservation", Cost: 1},
		QuotasFrom: "default rule", Quotas: []quotaJSON{{Quota: "type=10/1s", Limit: 10, WindowMS: 1000, Used: 2, NextSlotAt: now}}, Reservations: 1}
	acmeLog := logJSON{Key: "throttle:{in:call}:tenant:acme", Scope: "tenant", Tenant: ptr("acme"), Entries: 2,
		Oldest: &entryJSON{At: at(0), Kind: "admission", Cost: 1}, Newest: &entryJSON{At: at(time.Second), Kind: "admission", Cost: 2},
		QuotasFrom: "default rule", Quotas: []quotaJSON{
			// The pause until 30s comes after either window's next free slot (10s, now).
			{Quota: "tenant=3/10s", Limit: 3, WindowMS: 10000, Used: 3, NextSlotAt: at(30 * time.Second)},
			{Quota: "tenant=5/1m", Limit: 5, WindowMS: 60000, Used: 3, NextSlotAt: at(30 * time.Second)}},
		PausedUntil: ptr(at(30 * time.Second)), PauseInForce: true}
	globexLog := logJSON{Key: "throttle:{in:call}:tenant:globex", Scope: "tenant", Tenant: ptr("globex"), Entries: 4,
		Oldest: &entryJSON{At: at(100 * time.Millisecond), Kind: "admission", Cost: 1}, Newest: &entryJSON{At: reserved, Kind: "reservation", Cost: 1},
		QuotasFrom: "default rule", Quotas: []quotaJSON{
			{Quota: "tenant=3/10s", Limit: 3, WindowMS: 10000, Used: 3, NextSlotAt: at(10100 * time.Millisecond)},
			{Quota: "tenant=5/1m", Limit: 5, WindowMS: 60000, Used: 3, NextSlotAt: now}},
		Reservations: 1}
	inspect := func(want inspectJSON, args ...string) {
		t.Helper()
		before := snapshot(t, rdb)
		var got inspectJSON
		decode(t, &got, append([]string{"inspect", "-at", rfc(want.At)}, args...)...)
		if !jsonEqual(got, want) {
			g, _ := json.MarshalIndent(got, "", " ")
			w, _ := json.MarshalIndent(want, "", " ")
			t.Errorf("inspect %q:\n got  %s\n want %s", args, g, w)
		}
		if after := snapshot(t, rdb); after != before {
			t.Errorf("inspect %q changed the keys", args)
		}
	}
	others := []string{"throttle:{in:call}:costs:tenant:acme", "throttle:{in:call}:costs:type", "throttle:{in:call}:fair",
		"throttle:{in:call}:fairstate", "throttle:{in:call}:leases", "throttle:{in:call}:pending:tenant:globex", "throttle:{in:call}:pending:type"}
	inspect(inspectJSON{Prefix: "throttle", At: now, Defaults: true, Types: []typeJSON{{TaskType: "in:call",
		Rule: "in:call tenant=3/10s tenant=5/1m type=10/1s", RuleFrom: "default rule", Reservations: 1,
		Logs: []logJSON{typeLog, acmeLog, globexLog}, OtherKeys: others}}})
	inspect(inspectJSON{Prefix: "throttle", At: now, Defaults: true, Types: []typeJSON{{TaskType: "in:call",
		Rule: "in:call tenant=3/10s tenant=5/1m type=10/1s", RuleFrom: "default rule", Reservations: 1,
		Logs: []logJSON{acmeLog}, OtherKeys: []string{}}}}, "-tenant", "acme")
	inspect(inspectJSON{Prefix: "throttle", At: now, Defaults: true, Types: []typeJSON{{TaskType: "in:call",
		Rule: "in:call tenant=3/10s tenant=5/1m type=10/1s", RuleFrom: "default rule", Reservations: 1,
		Logs: []logJSON{typeLog, globexLog}, OtherKeys: []string{}}}}, "-type", "in:call", "-tenant", "globex")
	inspect(inspectJSON{Prefix: "throttle", At: now, Defaults: true, Types: []typeJSON{}}, "-tenant", "initech")
	// At 40s acme's pause is over: it no longer holds NEXT SLOT back; 10s's window is empty,
	// the minute's holds 3 of 5.
	later := at(40 * time.Second)
	acmeLater := acmeLog
	acmeLater.Quotas = []quotaJSON{
		{Quota: "tenant=3/10s", Limit: 3, WindowMS: 10000, Used: 0, NextSlotAt: later},
		{Quota: "tenant=5/1m", Limit: 5, WindowMS: 60000, Used: 3, NextSlotAt: later}}
	acmeLater.PauseInForce = false
	inspect(inspectJSON{Prefix: "throttle", At: later, Defaults: true, Types: []typeJSON{{TaskType: "in:call",
		Rule: "in:call tenant=3/10s tenant=5/1m type=10/1s", RuleFrom: "default rule", Reservations: 1,
		Logs: []logJSON{acmeLater}, OtherKeys: []string{}}}}, "-tenant", "acme")

	wantRun(t, []string{"inspect", "-at", rfc(now), "-tenant", "acme"}, exitOK, `throttle keys (prefix throttle) at 2026-03-04T10:00:01.900Z, overrides version 0

in:call: rule in:call tenant=3/10s tenant=5/1m type=10/1s (default rule); 1 reservation waiting
  LOG            ENTRIES  OLDEST                              NEWEST                              RESERVATIONS  PAUSED UNTIL              QUOTA         USED  NEXT SLOT
  tenant "acme"  2        2026-03-04T10:00:00.000Z admission  2026-03-04T10:00:01.000Z admission  0             2026-03-04T10:00:30.000Z  tenant=3/10s  3/3   2026-03-04T10:00:30.000Z
                                                                                                                                          tenant=5/1m   3/5   2026-03-04T10:00:30.000Z
`, "")
}

// TestPauseResume pauses with the CLI and observes the pause in a limiter's decisions: a
// tenant's log until an explicit -until (denied, retry-after exactly up to it; another
// tenant runs), a shorter pause that leaves the longer one in force, resume (admitted
// again; resuming again is exit 4), a type pause with -for, and the pauses that would do
// nothing, refused (exit 3) with nothing written.
func TestPauseResume(t *testing.T) {
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_RULES", "pr:call tenant=5/1s type=50/1s; tt:call type=5/1s; sh:call tenant=5/1s mode=shadow")
	ctx := context.Background()
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	quotas := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)}, {Scope: throttle.ScopeType, Limit: throttle.PerSecond(50)}}
	acme, globex := throttle.Key{TaskType: "pr:call", Tenant: "acme"}, throttle.Key{TaskType: "pr:call", Tenant: "globex"}
	until := time.Now().Add(time.Hour).Truncate(time.Second).UTC()
	var p pauseJSON
	decode(t, &p, "pause", "-type", "pr:call", "-tenant", "acme", "-until", rfc(until))
	wantP := pauseJSON{Key: "throttle:{pr:call}:tenant:acme", TaskType: "pr:call", Tenant: ptr("acme"), Scope: "tenant", Until: until, InForce: until}
	if !jsonEqual(p, wantP) {
		t.Errorf("pause -json = %+v, want %+v", p, wantP)
	}
	probe := until.Add(-2500 * time.Millisecond)
	if d := allow(t, lim, throttle.Request{Key: acme, Quotas: quotas}, probe); d.Allowed || !d.Paused || d.RetryAfter != 2500*time.Millisecond ||
		!d.RetryAt().Equal(until) || d.Quota != quotas[0] {
		t.Errorf("acme 2.5s before the pause's end: %+v; want denied, paused by tenant=5/1s, retry after 2.5s", d)
	}
	if d := allow(t, lim, throttle.Request{Key: globex, Quotas: quotas}, probe); !d.Allowed {
		t.Errorf("globex during acme's pause: %+v; want admitted", d)
	}
	// A shorter pause leaves the longer one in force.
	code, out, errOut := cli(t, "pause", "-type", "pr:call", "-tenant", "acme", "-for", "10m")
	if code != exitOK || errOut != "" || !strings.HasPrefix(out, `paused pr:call for tenant "acme" until `+fmtTime(until)+" (") ||
		!strings.Contains(out, "\na pause until "+fmtTime(until)+" was already in force: the later end stays\n") {
		t.Errorf("pause -for 10m under a 1h pause: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	wantRun(t, []string{"resume", "-type", "pr:call", "-tenant", "acme"}, exitOK,
		`resumed pr:call for tenant "acme": the pause until `+fmtTime(until)+" (in force) is lifted; workers decide its tasks by their quotas again (the tasks it denied come back within a minute; a task that got a 429 waits for its Retry-After)\n", "")
	if d := allow(t, lim, throttle.Request{Key: acme, Quotas: quotas}, probe); !d.Allowed {
		t.Errorf("acme after resume: %+v; want admitted", d)
	}
	wantRun(t, []string{"resume", "-type", "pr:call", "-tenant", "acme"}, exitNotFound, "", "throttle: resume: pr:call for tenant \"acme\" is not paused\n")

	// The type's log, for 1h from now: every tenant is paused.
	before := time.Now()
	p = pauseJSON{}
	decode(t, &p, "pause", "-type", "pr:call", "-for", "1h")
	after := time.Now()
	if p.Key != "throttle:{pr:call}:type" || p.Tenant != nil || p.Scope != "type" || !p.InForce.Equal(p.Until) ||
		p.Until.Before(ms(before.Add(time.Hour))) || p.Until.After(after.Add(time.Hour)) {
		t.Errorf("pause -type -for 1h = %+v; want the type's log, until 1h after the call", p)
	}
	if d := allow(t, lim, throttle.Request{Key: globex, Quotas: quotas}, probe); d.Allowed || !d.Paused || d.Quota != quotas[1] || !d.RetryAt().Equal(p.Until) {
		t.Errorf("globex during the type's pause: %+v; want paused by type=50/1s until %s", d, p.Until)
	}
	var r resumeJSON
	decode(t, &r, "resume", "-type", "pr:call")
	if wantR := (resumeJSON{Key: "throttle:{pr:call}:type", TaskType: "pr:call", Scope: "type", Resumed: true, WasUntil: &p.Until}); !jsonEqual(r, wantR) {
		t.Errorf("resume -json = %+v, want %+v", r, wantR)
	}

	// Pauses that would do nothing: refused, nothing written.
	wantRun(t, []string{"pause", "-type", "tt:call", "-tenant", "acme", "-for", "1m"}, exitRejected, "",
		`throttle: pause: the rule "tt:call type=5/1s" (default rule) has no tenant= quota for tenant "acme": its tasks are not decided on the tenant's log, so the pause would do nothing; pause the task type (no -tenant) instead`+"\n")
	wantRun(t, []string{"pause", "-type", "none:call", "-for", "1m"}, exitRejected, "",
		"throttle: pause: task type none:call has no rule: its tasks are not throttled, so a pause would do nothing\n")
	// A shadow rule's tasks run whatever the limiter says (trial 4 was told they would be
	// denied, and saw them run).
	wantRun(t, []string{"pause", "-type", "sh:call", "-tenant", "acme", "-for", "1m"}, exitRejected, "",
		`throttle: pause: the rule "sh:call tenant=5/1s mode=shadow" (default rule) is a dry run: its tasks run whatever the limiter decides, so the pause would do nothing; set mode=enforce to pause them`+"\n")
	for _, k := range []throttle.Key{{TaskType: "tt:call", Tenant: "acme"}, {TaskType: "none:call"}, {TaskType: "sh:call", Tenant: "acme"}} {
		for _, s := range []throttle.Scope{throttle.ScopeTenant, throttle.ScopeType} {
			if _, ok, err := lim.PausedUntil(ctx, k, s); err != nil || ok {
				t.Errorf("%+v at %s: paused %v (%v) after a refused pause", k, s, ok, err)
			}
		}
	}
	// Bad flags.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"pause", "-tenant", "acme", "-for", "1m"}, "throttle: pause: -type is required\n"},
		{[]string{"pause", "-type", "pr:call"}, "throttle: pause: give one of -for and -until\n"},
		{[]string{"pause", "-type", "pr:call", "-for", "1m", "-until", rfc(until)}, "throttle: pause: give one of -for and -until\n"},
		{[]string{"pause", "-type", "pr:call", "-for", "-1s"}, "throttle: pause: -for -1s: want a positive duration\n"},
		{[]string{"pause", "-type", "pr:call", "-until", "2020-01-01T00:00:00Z"}, "throttle: pause: -until 2020-01-01T00:00:00Z is not in the future\n"},
		{[]string{"pause", "-type", "pr:call", "-until", "tomorrow"}, "throttle: pause: invalid value \"tomorrow\" for flag -until: want an RFC 3339 instant, e.g. 2026-12-01T12:00:00Z\nRun 'throttle pause -h' for usage.\n"},
		{[]string{"pause", "-type", "pr:call", "-for", "5x"}, "throttle: pause: invalid value \"5x\" for flag -for: want a duration such as 90s, 5m or 1h30m\nRun 'throttle pause -h' for usage.\n"},
		{[]string{"resume", "-tenant", "acme"}, "throttle: resume: -type is required\n"},
		// Past what the limiter's scores hold (throttle.MaxTime): bad arguments (exit 2), not a
		// Redis failure, refused as the flag is read.
		{[]string{"pause", "-type", "pr:call", "-until", "2300-01-01T00:00:00Z"},
			"throttle: pause: invalid value \"2300-01-01T00:00:00Z\" for flag -until: want an instant from 1970-01-01T00:00:00Z to before 2109-05-15T07:35:11.104Z (throttle.MaxTime)\nRun 'throttle pause -h' for usage.\n"},
		{[]string{"pause", "-type", "pr:call", "-tenant", "acme", "-until", "2109-05-15T07:35:11.104Z"},
			"throttle: pause: invalid value \"2109-05-15T07:35:11.104Z\" for flag -until: want an instant from 1970-01-01T00:00:00Z to before 2109-05-15T07:35:11.104Z (throttle.MaxTime)\nRun 'throttle pause -h' for usage.\n"},
		{[]string{"explain", "-type", "pr:call", "-tenant", "acme", "-at", "1969-12-31T23:59:59Z"},
			"throttle: explain: invalid value \"1969-12-31T23:59:59Z\" for flag -at: want an instant from 1970-01-01T00:00:00Z to before 2109-05-15T07:35:11.104Z (throttle.MaxTime)\nRun 'throttle explain -h' for usage.\n"},
		// Names no task can have: a pause there would pause nothing.
		{[]string{"pause", "-type", "pr:call", "-tenant", "caf\xe9", "-for", "5s"},
			"throttle: pause: -tenant \"caf\\xe9\" is not valid UTF-8, which no task's tenant can be\n"},
		{[]string{"resume", "-type", "pr\xe9"}, "throttle: resume: -type \"pr\\xe9\" is not valid UTF-8, which no task's type can be\n"},
		{[]string{"reset", "-type", "pr:call", "-tenant", strings.Repeat("t", 1025)},
			"throttle: reset: -tenant of 1025 bytes: at most throttle.MaxTenantBytes (1024)\n"},
		{[]string{"inspect", "-tenant", strings.Repeat("t", 1100)},
			"throttle: inspect: -tenant of 1100 bytes: at most throttle.MaxTenantBytes (1024)\n"},
		{[]string{"inspect", "-type", "pr:call", "-at", "2300-01-01T00:00:00Z"},
			"throttle: inspect: invalid value \"2300-01-01T00:00:00Z\" for flag -at: want an instant from 1970-01-01T00:00:00Z to before 2109-05-15T07:35:11.104Z (throttle.MaxTime)\nRun 'throttle inspect -h' for usage.\n"},
	} {
		wantRun(t, tc.args, exitUsage, "", tc.want)
	}
}

// TestReset: answering n (or nothing) deletes nothing (exit 5); -yes releases the tenant's
// reservations, then deletes its log and the sets beside it, leaving the other tenant's and
// the type's consistent; a type reset deletes every key of the type and no other type's;
// a reset with nothing to delete is exit 4.
func TestReset(t *testing.T) {
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	setEnv(t, "REDIS_ADDR", srv.Addr)
	ctx := context.Background()
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	quotas := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Minute}},
		{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 10, Window: time.Minute}}}
	acme, globex := throttle.Key{TaskType: "rs:call", Tenant: "acme"}, throttle.Key{TaskType: "rs:call", Tenant: "globex"}
	other := throttle.Key{TaskType: "keep:call", Tenant: "acme"}
	now := time.Now()
	allow(t, lim, throttle.Request{Key: acme, Quotas: quotas}, now)
	if d := allow(t, lim, throttle.Request{Key: acme, Quotas: quotas, Reservation: "A2"}, now); !d.Reserved {
		t.Fatalf("setup: acme's second: %+v; want a reservation", d)
	}
	allow(t, lim, throttle.Request{Key: globex, Quotas: quotas}, now)
	allow(t, lim, throttle.Request{Key: other, Quotas: quotas}, now)
	keys := func(match string) []string {
		t.Helper()
		k, err := rdb.Keys(ctx, match).Result()
		if err != nil {
			t.Fatal(err)
		}
		sort.Strings(k)
		return k
	}
	acmeKeys := []string{"throttle:{rs:call}:pending:tenant:acme", "throttle:{rs:call}:tenant:acme"}
	if got := keys("throttle:{rs:call}:*tenant:acme"); !jsonEqual(got, acmeKeys) {
		t.Fatalf("setup: acme's keys %q, want %q", got, acmeKeys)
	}
	all := keys("*")
	prompt := `reset rs:call for tenant "acme": delete 2 keys, after releasing 1 reservation:
  throttle:{rs:call}:pending:tenant:acme
  throttle:{rs:call}:tenant:acme
Delete them? [y/N] `
	for _, answer := range []string{"n\n", "", "nope\n"} {
		code, out, errOut := cliIn(t, answer, "reset", "-type", "rs:call", "-tenant", "acme")
		end := ""
		if !strings.HasSuffix(answer, "\n") {
			end = "\n"
		}
		if wantErr := prompt + end + "throttle: reset: not confirmed; nothing deleted\n"; code != exitNotConfirmed || out != "" || errOut != wantErr {
			t.Errorf("reset answered %q: exit %d, stdout %q, stderr %q; want 5 and %q", answer, code, out, errOut, wantErr)
		}
		if got := keys("*"); !jsonEqual(got, all) {
			t.Errorf("reset answered %q: keys %q, want all still there: %q", answer, got, all)
		}
	}
	code, out, errOut := cliIn(t, "y\n", "reset", "-type", "rs:call", "-tenant", "acme")
	if code != exitOK || errOut != prompt || out != "reset rs:call for tenant \"acme\": deleted 2 keys, released 1 reservation\n" {
		t.Errorf("reset answered y: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if got := keys("throttle:{rs:call}:*tenant:acme"); len(got) != 0 {
		t.Errorf("after the reset, acme's keys %q are left", got)
	}
	n := 0
	if err := lim.Reservations(ctx, "rs:call", func(throttle.Reservation) bool { n++; return true }); err != nil || n != 0 {
		t.Errorf("reservations of rs:call after the reset: %d (%v), want 0", n, err)
	}
	// acme's log starts over: one admission fits its tenant=1/1m; the type's log counts
	// globex's and acme's first admissions, and no longer the released reservation.
	if d := allow(t, lim, throttle.Request{Key: acme, Quotas: quotas}, now); !d.Allowed {
		t.Errorf("acme after its reset: %+v; want admitted", d)
	}
	if got := admissionsIn(t, rdb, "throttle:{rs:call}:type"); got != 3 {
		t.Errorf("the type's log holds %d entries, want 3 admissions (acme, globex, acme again)", got)
	}

	var rj resetJSON
	decode(t, &rj, "reset", "-type", "rs:call", "-yes")
	if got := keys("throttle:{rs:call}:*"); len(got) != 0 {
		t.Errorf("after reset -type, keys %q are left", got)
	}
	if len(rj.Deleted) == 0 || rj.Tenant != nil || rj.TaskType != "rs:call" || rj.Released != 0 {
		t.Errorf("reset -type -json = %+v", rj)
	}
	for _, k := range rj.Deleted {
		if !strings.HasPrefix(k, "throttle:{rs:call}:") {
			t.Errorf("reset -type rs:call deleted %q", k)
		}
	}
	if got := keys("throttle:{keep:call}:*"); len(got) != 2 {
		t.Errorf("keep:call's keys %q; want its 2 logs untouched", got)
	}
	wantRun(t, []string{"reset", "-type", "rs:call", "-yes"}, exitNotFound, "", "throttle: reset: nothing to reset: no key of task type rs:call\n")
	wantRun(t, []string{"reset", "-tenant", "acme"}, exitUsage, "", "throttle: reset: -type is required\n")
}

// admissionsIn counts the entries of a window log above its sentinels.
func admissionsIn(t *testing.T, rdb *redis.Client, key string) int64 {
	t.Helper()
	n, err := rdb.ZCount(context.Background(), key, "("+floorScore, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOps_usage: each new command explains itself with -h, and bad flags are exit 2,
// before Redis is reached (this REDIS_ADDR is never dialed).
func TestOps_usage(t *testing.T) {
	setEnv(t, "REDIS_ADDR", "127.0.0.1:1")
	for name, first := range map[string]string{"inspect": "throttle inspect", "explain": "throttle explain", "pause": "throttle pause",
		"resume": "throttle pause", "reset": "throttle reset"} {
		code, out, _ := cli(t, name, "-h")
		if code != exitOK || !strings.HasPrefix(out, "Usage:\n  "+first+" ") || !strings.Contains(out, "5 reset not confirmed") {
			t.Errorf("throttle %s -h: exit %d, stdout:\n%s", name, code, out)
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"explain", "-type", "x"}, "throttle: explain: -tenant is required ('' for untagged tasks)\n"},
		{[]string{"explain", "-tenant", "a"}, "throttle: explain: -type is required\n"},
		{[]string{"explain", "-type", "x", "-tenant", "a", "-cost", "0"}, "throttle: explain: -cost 0: want at least 1\n"},
		{[]string{"explain", "-type", "x", "-tenant", strings.Repeat("t", 2000)}, "throttle: explain: -tenant of 2000 bytes: at most throttle.MaxTenantBytes (1024)\n"},
		{[]string{"explain", "-type", "x", "-tenant", "a", "extra"}, "throttle: explain: unexpected argument \"extra\"\n"},
		{[]string{"inspect", "-type", ""}, "throttle: inspect: -type is empty\n"},
		{[]string{"inspect", "-at", "now"}, "throttle: inspect: invalid value \"now\" for flag -at: want an RFC 3339 instant, e.g. 2026-12-01T12:00:00Z\nRun 'throttle inspect -h' for usage.\n"},
		{[]string{"reset", "-type", "x", "extra"}, "throttle: reset: unexpected argument \"extra\"\n"},
	} {
		wantRun(t, tc.args, exitUsage, "", tc.want)
	}
}
