package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestMain silences go-redis's log of failed dials, as main does.
func TestMain(m *testing.M) {
	redisenv.QuietLogs()
	os.Exit(m.Run())
}

// setEnv clears every variable the command reads, then sets pairs (name, value, ...),
// for this test only. Tests that call it cannot run in parallel (t.Setenv).
func setEnv(t *testing.T, pairs ...string) {
	t.Helper()
	for _, name := range []string{"REDIS_ADDR", "REDIS_MASTER_NAME", "REDIS_PASSWORD", "REDIS_DB", "THROTTLE_PREFIX", "THROTTLE_RULES"} {
		t.Setenv(name, "")
		os.Unsetenv(name)
	}
	for i := 0; i+1 < len(pairs); i += 2 {
		t.Setenv(pairs[i], pairs[i+1])
	}
}

// cli runs the command in-process with args and returns its exit status, stdout and stderr.
func cli(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// wantRun runs args and fails t unless the exit status, stdout and stderr are exactly the
// ones given.
func wantRun(t *testing.T, args []string, code int, stdout, stderr string) {
	t.Helper()
	gotCode, gotOut, gotErr := cli(t, args...)
	if gotCode != code || gotOut != stdout || gotErr != stderr {
		t.Errorf("throttle %q:\nexit %d, want %d\nstdout %q\nwant   %q\nstderr %q\nwant   %q", args, gotCode, code, gotOut, stdout, gotErr, stderr)
	}
}

func TestRun_usageAndEnvironment(t *testing.T) {
	setEnv(t)
	code, out, _ := cli(t, "-h")
	if code != exitOK || !strings.Contains(out, "\n  limits   show, set and delete") || !strings.Contains(out, "\n  explain  would a task") || !strings.Contains(out, "THROTTLE_PREFIX") ||
		!strings.Contains(out, "REDIS_ADDR") || !strings.Contains(out, "3 change rejected") {
		t.Errorf("throttle -h: exit %d, stdout:\n%s", code, out)
	}
	code, out, _ = cli(t, "limits", "-h")
	if code != exitOK || !strings.HasPrefix(out, "Usage:\n  throttle limits show") || !strings.Contains(out, "4 nothing stored under that name") {
		t.Errorf("throttle limits -h: exit %d, stdout:\n%s", code, out)
	}
	wantRun(t, []string{"nosuch"}, exitUsage, "", "throttle: unknown command \"nosuch\"\nRun 'throttle -h' for usage.\n")
	wantRun(t, []string{"-x"}, exitUsage, "", "throttle: flag provided but not defined: -x\nRun 'throttle -h' for usage.\n")
	wantRun(t, []string{"limits"}, exitUsage, "", "throttle: limits: want show, set or delete\nRun 'throttle limits -h' for usage.\n")
	wantRun(t, []string{"limits", "list"}, exitUsage, "", "throttle: limits: unknown action \"list\"; want show, set or delete\n")
	wantRun(t, []string{"limits", "set", "tier", "pro"}, exitUsage, "", "throttle: limits set: want <kind> <name> <text>, e.g. set tier pro 'tenant=50/1s weight=3'\n")
	wantRun(t, []string{"limits", "set", "tiers", "pro", "weight=2"}, exitUsage, "", "throttle: limits set: unknown kind \"tiers\"; want type, tier, tenant or tenant-tier\n")
	wantRun(t, []string{"limits", "delete", "tier"}, exitUsage, "", "throttle: limits delete: want <kind> <name>, e.g. delete tier pro\n")
	wantRun(t, []string{"limits", "set", "-tenant", "x", "tier", "pro", "weight=2"}, exitUsage, "", "throttle: limits set: -tenant and -type are flags of show\n")
	wantRun(t, []string{"limits", "show", "extra"}, exitUsage, "", "throttle: limits show: unexpected argument \"extra\"; use -tenant and -type\n")
	// Validated before Redis is reached: this REDIS_ADDR is never dialed.
	setEnv(t, "REDIS_ADDR", "127.0.0.1:1")
	wantRun(t, []string{"limits", "set", "tier", "pro", "tenant=5/1s", "tenant=3/1s"}, exitRejected, "",
		`throttle: limits set: worker: invalid override: tier "pro": entry 1 "tenant=5/1s tenant=3/1s": quotas tenant=5/1s and tenant=3/1s have the same scope and window, so only the smaller ever decides; keep one (tenant=3/1s)`+"\n")
	wantRun(t, []string{"limits", "set", "type", "api:call", "type=5/1s mode=dry"}, exitRejected, "",
		`throttle: limits set: worker: invalid override: type "api:call": rule 1 "api:call type=5/1s mode=dry": "mode=dry": want mode=enforce or mode=shadow (a dry run)`+"\n")
	wantRun(t, []string{"limits", "set", "tier", "pro plus", "weight=2"}, exitRejected, "",
		`throttle: limits set: worker: invalid override: tier "pro plus": want 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, e.g. pro`+"\n")
	// A tier name too long to print whole is cut, and printed once.
	wantRun(t, []string{"limits", "set", "tier", strings.Repeat("t", 300), "weight=2"}, exitRejected, "",
		`throttle: limits set: worker: invalid override: tier "`+strings.Repeat("t", 64)+`"...(300 bytes): want 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, e.g. pro`+"\n")
	setEnv(t, "REDIS_ADDR", "localhost")
	wantRun(t, []string{"limits", "show"}, exitUsage, "", "throttle: redisenv: REDIS_ADDR=\"localhost\": \"localhost\" is not host:port: missing port in address\n")
	setEnv(t, "THROTTLE_PREFIX", "a{b}")
	wantRun(t, []string{"limits", "show"}, exitUsage, "", "throttle: THROTTLE_PREFIX=\"a{b}\": must be non-empty, without '{' or '}'\n")
	setEnv(t, "THROTTLE_RULES", "x tenant=1")
	srv := redistest.StartServer(t)
	setEnv(t, "THROTTLE_RULES", "x tenant=1", "REDIS_ADDR", srv.Addr)
	wantRun(t, []string{"limits", "show", "-tenant", "acme"}, exitUsage, "",
		`throttle: THROTTLE_RULES="x tenant=1": worker: rule 1 "x tenant=1": quota "tenant=1": throttle: limit "1": want events/window, e.g. 5/2s`+"\n")
	// A bad value Redis's answer shows (redisenv.IsBadValue) is a bad variable too, not an
	// outage: a trial saw exit 1 for one node of a cluster, which cmd/worker refuses with 2.
	setEnv(t, "THROTTLE_RULES", "", "REDIS_ADDR", srv.Addr, "REDIS_DB", "99")
	for _, args := range [][]string{{"limits", "show"}, {"inspect", "-type", "x"}} {
		code, _, errOut := cli(t, args...)
		if want := `throttle: redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="` + srv.Addr + `" has no database 99`; code != exitUsage || !strings.HasPrefix(errOut, want) {
			t.Errorf("throttle %q with REDIS_DB=99: exit %d, stderr %q; want %d and %q...", args, code, errOut, exitUsage, want)
		}
	}
}

func TestRun_redisDownExits1(t *testing.T) {
	srv := redistest.StartServer(t)
	srv.Stop()
	setEnv(t, "REDIS_ADDR", srv.Addr)
	for _, args := range [][]string{{"limits", "show"}, {"limits", "set", "tier", "pro", "weight=2"}, {"limits", "delete", "tier", "pro"}} {
		code, out, errOut := cli(t, args...)
		if want := `throttle: Redis at REDIS_ADDR="` + srv.Addr + `" does not answer: `; code != exitRedis || out != "" || !strings.HasPrefix(errOut, want) {
			t.Errorf("throttle %q with Redis down: exit %d, stdout %q, stderr %q; want 1 and %q...", args, code, out, errOut, want)
		}
	}
}

// TestLimits_setShowDelete drives every action against a redis-server and checks the exact
// output, human and JSON, and the exit status of each rejection.
// TestLimits_showWeight: a tenant's weight shows on every task type, under a rule of
// type= quotas alone as under one with a tenant= quota. (A note used to say that under a
// type=-only rule it took no slots from tenants whose tier adds tenant= quotas; the script
// now moves those too, under the quotas their leases record.)
func TestLimits_showWeight(t *testing.T) {
	srv := redistest.StartServer(t)
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_RULES", "w2:call type=8/1s; w3:call tenant=5/1s type=8/1s")
	if code, _, errOut := cli(t, "limits", "set", "tenant", "heavy", "weight=3"); code != exitOK {
		t.Fatalf("limits set: exit %d: %s", code, errOut)
	}
	wantRun(t, []string{"limits", "show", "-tenant", "heavy"}, exitOK, `what tenant "heavy" gets, overrides version 1:
  TASK TYPE  RULE                           WEIGHT  RULE FROM     TENANT QUOTAS FROM  WEIGHT FROM
  w2:call    w2:call type=8/1s              3       default rule  default rule        tenant override
  w3:call    w3:call tenant=5/1s type=8/1s  3       default rule  default rule        tenant override
`, "")
	wantRun(t, []string{"limits", "show", "-tenant", "light"}, exitOK, `what tenant "light" gets, overrides version 1:
  TASK TYPE  RULE                           WEIGHT  RULE FROM     TENANT QUOTAS FROM  WEIGHT FROM
  w2:call    w2:call type=8/1s              1       default rule  default rule        default
  w3:call    w3:call tenant=5/1s type=8/1s  1       default rule  default rule        default
`, "")
}

func TestLimits_setShowDelete(t *testing.T) {
	srv := redistest.StartServer(t)
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_PREFIX", "tp")
	const after = "workers put it in force within 1s\n"
	wantRun(t, []string{"limits", "set", "tier", "pro", "tenant=50/1000ms", "weight=3;", "email:send", "tenant=1000/60m"}, exitOK,
		"set tier pro: tenant=50/1s weight=3; email:send tenant=1000/1h (version 1)\n"+after, "")
	wantRun(t, []string{"limits", "set", "tenant-tier", "acme", "gold"}, exitRejected, "",
		`throttle: limits set: worker: tier not found: tenant "acme" cannot be assigned to tier "gold", which does not exist; store the tier first`+"\n")
	wantRun(t, []string{"limits", "set", "tenant-tier", "acme", "pro"}, exitOK, "set tenant-tier acme: pro (version 2)\n"+after, "")
	wantRun(t, []string{"limits", "set", "tenant", "--", "-odd\nname", "api:call weight=9"}, exitOK, "set tenant \"-odd\\nname\": api:call weight=9 (version 3)\n"+after, "")
	wantRun(t, []string{"limits", "set", "type", "api:call", "tenant=10/1s type=50/1s"}, exitOK, "set type api:call: tenant=10/1s type=50/1s (version 4)\n"+after, "")
	code, out, errOut := cli(t, "limits", "set", "tenant-tier", "globex", "pro", "-json")
	var c struct {
		Kind, Name, Text string
		Version          int64
	}
	if err := json.Unmarshal([]byte(out), &c); err != nil || code != exitOK || errOut != "" ||
		c.Kind != "tenant-tier" || c.Name != "globex" || c.Text != "pro" || c.Version != 5 {
		t.Errorf("set -json: exit %d, stdout %q (%+v, %v), stderr %q", code, out, c, err, errOut)
	}

	wantRun(t, []string{"limits", "show"}, exitOK, `overrides in tp:overrides, version 5

task type rules (replace THROTTLE_RULES):
  api:call  tenant=10/1s type=50/1s

tiers:
  pro  tenant=50/1s weight=3; email:send tenant=1000/1h

tenant limits (win over their tier's):
  "-odd\nname"  api:call weight=9

tenant tiers:
  acme    pro
  globex  pro
`, "")
	code, out, _ = cli(t, "-json", "limits", "show")
	var stored storedJSON
	if err := json.Unmarshal([]byte(out), &stored); err != nil || code != exitOK {
		t.Fatalf("show -json: exit %d, %v: %s", code, err, out)
	}
	want := storedJSON{Key: "tp:overrides", Version: 5, Types: map[string]string{"api:call": "tenant=10/1s type=50/1s"},
		Tiers: map[string]string{"pro": "tenant=50/1s weight=3; email:send tenant=1000/1h"}, Tenants: map[string]string{"-odd\nname": "api:call weight=9"},
		TenantTiers: map[string]string{"acme": "pro", "globex": "pro"}}
	if !jsonEqual(stored, want) {
		t.Errorf("show -json = %+v, want %+v", stored, want)
	}

	// What a tenant gets, given the workers' THROTTLE_RULES.
	t.Setenv("THROTTLE_RULES", "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h; s:call tenant=1/1s mode=shadow")
	wantRun(t, []string{"limits", "show", "-tenant", "acme"}, exitOK, `what tenant "acme" (tier pro) gets, overrides version 5:
  TASK TYPE   RULE                              WEIGHT  RULE FROM      TENANT QUOTAS FROM  WEIGHT FROM
  api:call    api:call tenant=50/1s type=50/1s  3       type override  tier "pro"          tier "pro"
  email:send  email:send tenant=1000/1h         3       default rule   tier "pro"          tier "pro"
  s:call      s:call tenant=50/1s mode=shadow   3       default rule   tier "pro"          tier "pro"
`, "")
	code, out, _ = cli(t, "limits", "show", "-json", "-tenant", "-odd\nname", "-type", "api:call")
	var eff effectiveJSON
	if err := json.Unmarshal([]byte(out), &eff); err != nil || code != exitOK {
		t.Fatalf("show -tenant -type -json: exit %d, %v: %s", code, err, out)
	}
	odd := "-odd\nname"
	wantEff := effectiveJSON{Key: "tp:overrides", Version: 5, Defaults: true, Tenant: &odd, Limits: []limitJSON{{TaskType: "api:call",
		Rule: "api:call tenant=10/1s type=50/1s", Mode: "enforce", Weight: 9, RuleFrom: "type override", QuotasFrom: "type override", WeightFrom: "tenant override"}}}
	if !jsonEqual(eff, wantEff) {
		t.Errorf("show -tenant -type -json = %s, want %+v", out, wantEff)
	}
	wantRun(t, []string{"limits", "show", "-type", "nosuch"}, exitOK,
		"what a tenant without limits of its own or a tier gets, overrides version 5:\n  (task type nosuch has no rule: not throttled)\n", "")
	wantRun(t, []string{"limits", "show", "-type", "email:send"}, exitOK, `what a tenant without limits of its own or a tier gets, overrides version 5:
  TASK TYPE   RULE                      WEIGHT  RULE FROM     TENANT QUOTAS FROM  WEIGHT FROM
  email:send  email:send tenant=100/1h  1       default rule  default rule        default
`, "")

	wantRun(t, []string{"limits", "delete", "tier", "pro"}, exitRejected, "",
		`throttle: limits delete: worker: tier in use: tier "pro" still has tenants "acme", "globex"; assign them elsewhere or delete their tenant-tier first`+"\n")
	wantRun(t, []string{"limits", "delete", "tenant", "acme"}, exitNotFound, "", `throttle: limits delete: worker: override not found: no tenant override "acme" is stored`+"\n")
	wantRun(t, []string{"limits", "delete", "tenant-tier", "acme"}, exitOK, "deleted tenant-tier acme (version 6)\n"+after, "")
	wantRun(t, []string{"limits", "delete", "tenant-tier", "globex"}, exitOK, "deleted tenant-tier globex (version 7)\n"+after, "")
	code, out, _ = cli(t, "limits", "delete", "tier", "pro", "-json")
	if code != exitOK || out != "{\n  \"kind\": \"tier\",\n  \"name\": \"pro\",\n  \"deleted\": true,\n  \"version\": 8\n}\n" {
		t.Errorf("delete -json: exit %d, stdout %q", code, out)
	}
}

// jsonEqual compares a and b by their JSON encodings.
func jsonEqual(a, b any) bool {
	ja, err1 := json.Marshal(a)
	jb, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && bytes.Equal(ja, jb)
}

// TestLimits_setNotesRulelessType: a tenant's or a tier's entry for a task type that has no
// rule (THROTTLE_RULES, type overrides) is stored, with a note that it does nothing until
// the type has one; a type override gives it one; without THROTTLE_RULES nothing is noted.
func TestLimits_setNotesRulelessType(t *testing.T) {
	srv := redistest.StartServer(t)
	setEnv(t, "REDIS_ADDR", srv.Addr, "THROTTLE_RULES", "api:call tenant=5/2s")
	const after = "workers put it in force within 1s\n"
	const note = "throttle: limits set: note: foo:call has no rule (THROTTLE_RULES, type overrides): its tasks run unthrottled, and this entry applies to them only once it has one\n"
	wantRun(t, []string{"limits", "set", "tenant", "acme", "foo:call tenant=100/1s; api:call tenant=9/1s"}, exitOK,
		"set tenant acme: foo:call tenant=100/1s; api:call tenant=9/1s (version 1)\n"+after, note)
	wantRun(t, []string{"limits", "set", "tier", "pro", "tenant=50/1s; foo:call weight=2"}, exitOK,
		"set tier pro: tenant=50/1s; foo:call weight=2 (version 2)\n"+after, note)
	wantRun(t, []string{"limits", "set", "type", "foo:call", "tenant=10/1s"}, exitOK, "set type foo:call: tenant=10/1s (version 3)\n"+after, "")
	wantRun(t, []string{"limits", "set", "tenant", "acme", "foo:call tenant=100/1s"}, exitOK,
		"set tenant acme: foo:call tenant=100/1s (version 4)\n"+after, "")
	setEnv(t, "REDIS_ADDR", srv.Addr)
	wantRun(t, []string{"limits", "set", "tenant", "globex", "bar:call tenant=1/1s"}, exitOK,
		"set tenant globex: bar:call tenant=1/1s (version 5)\n"+after, "")
}
