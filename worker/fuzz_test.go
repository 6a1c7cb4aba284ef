package worker_test

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"unicode"

	"github.com/asynq-throttle/asynq-throttle/worker"
)

// FuzzParseRules checks ParseRules on any text: it never panics; what it accepts is valid
// and prints (Rule.String) back to the same rules; what it rejects it rejects with an
// error that starts with "worker: " and names the first rule that fails, by position and
// (quoted) text. More seeds are in testdata/fuzz/FuzzParseRules.
func FuzzParseRules(f *testing.F) {
	for _, s := range []string{
		"",
		";",
		" ; ;; ",
		"api:call tenant=5/2s type=20/1s; email:send tenant=100/1h",
		"llm:complete tenant=40000/1m tenant=1000000/24h cost=header:tokens",
		"x tenant=5/1m cost=header:batch",
		"x cost=header:batch tenant=5/1m",
		"x tenant=5/1s cost=header:",
		"x tenant=5/1s cost=tokens",
		"x tenant=5/1s cost=header:a cost=header:b",
		"x tenant=5/1s cost=header:a=b",
		"x tenant==5/1s",
		"x =5/1s",
		"x tenant=5//1s",
		"x tenant=/1s",
		"x tenant=5/",
		"x tenant=99999999999999999999/1s",
		"x tenant=9223372036854775807/1s",
		"x tenant=5/9223372036854775807ns",
		"x tenant=5/2562047h47m16.854s",
		"x tenant=5/-1s",
		"x tenant=-5/1s",
		"x tenant=5/1.5ms",
		"x tenant=5/0.5ms",
		"x tenant=5/1h0m0.5s",
		"x tenant=+5/1s",
		"x tenant=05/1m0s",
		"t\u00e9nant:\u4e2d tenant=5/1s",
		"x\u00a0tenant=5/1s",
		"x\ttenant=5/1s\ntype=1/1ms",
		"x tenant=5/1\u00b5s",
		"a tenant=1/1s; a type=1/1s",
		"tenant=5/1s",
		"x",
		"x cost=header:b",
		"report:build tenant=2/1m max-delay=30m overdue=drop",
		"x tenant=1/1s max-delay=1m max-delay=2m overdue=run overdue=archive",
		"x tenant=1/1s max-delay=0s",
		"x tenant=1/1s max-delay=-1s",
		"x tenant=1/1s max-delay=",
		"x tenant=1/1s overdue=later",
		"x overdue=run",
		"x tenant=5/1s tenant=3/1s",
		"x tenant=5/1s type=5/1s tenant=5/1000ms",
		"x tenant=5/1s type=5/1s",
		"x tenant=5/1s tenant=5/1h",
		"x tenant=1/1s mode=shadow",
		"x tenant=1/1s mode=enforce",
		"x tenant=1/1s mode=shadow mode=shadow",
		"x tenant=1/1s mode=",
		"x mode=shadow",
		"\xff tenant=1/1s",
		"x tenant=1/1s; \xff",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		rules, err := worker.ParseRules(s)
		if err != nil {
			checkParseError(t, s, err)
			return
		}
		var texts []string
		for i, r := range rules {
			if err := r.Validate(); err != nil {
				t.Fatalf("ParseRules(%q) rule %d %+v does not validate: %v", s, i+1, r, err)
			}
			if r.TaskType == "" || strings.ContainsAny(r.TaskType, "=;") || strings.IndexFunc(r.TaskType, unicode.IsSpace) >= 0 {
				t.Fatalf("ParseRules(%q) rule %d has task type %q", s, i+1, r.TaskType)
			}
			if r.CostFunc != nil || strings.IndexFunc(r.CostHeader, unicode.IsSpace) >= 0 || strings.Contains(r.CostHeader, ";") {
				t.Fatalf("ParseRules(%q) rule %d has cost header %q", s, i+1, r.CostHeader)
			}
			text := r.String()
			again, err := worker.ParseRules(text)
			if err != nil {
				t.Fatalf("ParseRules(%q) rule %d prints as %q, which does not parse: %v", s, i+1, text, err)
			}
			if len(again) != 1 || !reflect.DeepEqual(again[0], r) {
				t.Fatalf("ParseRules(%q) rule %d %+v prints as %q, which parses to %+v", s, i+1, r, text, again)
			}
			if again[0].String() != text {
				t.Fatalf("rule %q prints as %q after a round trip", text, again[0].String())
			}
			texts = append(texts, text)
		}
		again, err := worker.ParseRules(strings.Join(texts, "; "))
		if err != nil || !reflect.DeepEqual(again, rules) {
			t.Fatalf("ParseRules(%q) = %+v; its printed form %q parses to %+v, %v", s, rules, strings.Join(texts, "; "), again, err)
		}
	})
}

// checkParseError checks err from ParseRules(s): it starts with "worker: " and names the
// rule that fails, the first one whose ';'-separated prefix of s does not parse.
func checkParseError(t *testing.T, s string, err error) {
	t.Helper()
	msg := err.Error()
	if !strings.HasPrefix(msg, "worker: ") {
		t.Fatalf("ParseRules(%q) error %q does not start with \"worker: \"", s, msg)
	}
	parts := strings.Split(s, ";")
	for i := range parts {
		if _, perr := worker.ParseRules(strings.Join(parts[:i+1], ";")); perr == nil {
			continue
		}
		want := fmt.Sprintf("rule %d %q", i+1, strings.TrimSpace(parts[i]))
		if !strings.Contains(msg, want) {
			t.Fatalf("ParseRules(%q) error %q does not name the failing rule: want %s", s, msg, want)
		}
		return
	}
	t.Fatalf("ParseRules(%q) fails (%v) but every prefix of its rules parses", s, err)
}

// FuzzParseTenantLimits checks ParseTenantLimits on any text as FuzzParseRules checks
// ParseRules: no panic; what it accepts is valid, has only tenant= quotas, and prints
// (FormatTenantLimits) back to the same entries; what it rejects it rejects with an error
// that starts with "worker: " and names the first entry that fails. More seeds are in
// testdata/fuzz/FuzzParseTenantLimits.
func FuzzParseTenantLimits(f *testing.F) {
	for _, s := range []string{
		"",
		" ; ;",
		"tenant=50/1s weight=3",
		"api:call tenant=50/1s weight=3; email:send tenant=1000/1h",
		"tenant=10/1s; report:build tenant=1/1m",
		"weight=1000000",
		"weight=1000001",
		"weight=0",
		"weight=3 weight=4",
		"weight=x",
		"api:call",
		"api:call type=5/1s",
		"tenant=5/1s tenant=3/1s",
		"tenant=5/1s tenant=5/1h",
		"tenant=5/1s; tenant=6/1s",
		"a weight=2; a tenant=1/1s",
		"a tenant=1/1s cost=header:n",
		"a tenant=1/1s mode=shadow",
		"a tenant=1/1s max-delay=1m",
		"a tenant=1/1s overdue=run",
		"a user=1/1s",
		"a tenant=0/1s",
		"\xff weight=2",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		entries, err := worker.ParseTenantLimits(s)
		if err != nil {
			msg := err.Error()
			if !strings.HasPrefix(msg, "worker: ") {
				t.Fatalf("ParseTenantLimits(%q) error %q does not start with \"worker: \"", s, msg)
			}
			parts := strings.Split(s, ";")
			for i := range parts {
				if _, perr := worker.ParseTenantLimits(strings.Join(parts[:i+1], ";")); perr != nil {
					if want := fmt.Sprintf("entry %d %q", i+1, strings.TrimSpace(parts[i])); !strings.Contains(msg, want) {
						t.Fatalf("ParseTenantLimits(%q) error %q does not name the failing entry: want %s", s, msg, want)
					}
					return
				}
			}
			t.Fatalf("ParseTenantLimits(%q) fails (%v) but every prefix of its entries parses", s, err)
		}
		for i, e := range entries {
			if err := e.Validate(); err != nil {
				t.Fatalf("ParseTenantLimits(%q) entry %d %+v does not validate: %v", s, i+1, e, err)
			}
			if strings.ContainsAny(e.TaskType, "=;") || strings.IndexFunc(e.TaskType, unicode.IsSpace) >= 0 {
				t.Fatalf("ParseTenantLimits(%q) entry %d has task type %q", s, i+1, e.TaskType)
			}
		}
		text := worker.FormatTenantLimits(entries)
		again, err := worker.ParseTenantLimits(text)
		if err != nil || !reflect.DeepEqual(again, entries) {
			t.Fatalf("ParseTenantLimits(%q) = %+v; its printed form %q parses to %+v, %v", s, entries, text, again, err)
		}
		if worker.FormatTenantLimits(again) != text {
			t.Fatalf("entries %q print as %q after a round trip", text, worker.FormatTenantLimits(again))
		}
	})
}
