package worker_test

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

func TestParseRules(t *testing.T) {
	t.Parallel()
	tenant := func(n int, w time.Duration) throttle.Quota {
		return throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: n, Window: w}}
	}
	typ := func(n int, w time.Duration) throttle.Quota {
		return throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: n, Window: w}}
	}
	tests := []struct {
		in   string
		want []worker.Rule
	}{
		{in: "", want: nil},
		{in: " ; ;", want: nil},
		{in: "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h", want: []worker.Rule{
			{TaskType: "api:call", Quotas: []throttle.Quota{tenant(5, 2*time.Second), typ(20, time.Second)}},
			{TaskType: "email:send", Quotas: []throttle.Quota{tenant(100, time.Hour)}},
		}},
		{in: "  report   tenant=10/1s  tenant=500/1h ;", want: []worker.Rule{
			{TaskType: "report", Quotas: []throttle.Quota{tenant(10, time.Second), tenant(500, time.Hour)}},
		}},
		// One window at two scopes is two logs: both decide.
		{in: "x tenant=5/1s type=3/1s mode=shadow", want: []worker.Rule{
			{TaskType: "x", Quotas: []throttle.Quota{tenant(5, time.Second), typ(3, time.Second)}, Mode: worker.ModeShadow},
		}},
		{in: "x tenant=5/1s mode=enforce", want: []worker.Rule{
			{TaskType: "x", Quotas: []throttle.Quota{tenant(5, time.Second)}, Mode: worker.ModeEnforce},
		}},
	}
	for _, tc := range tests {
		got, err := worker.ParseRules(tc.in)
		if err != nil {
			t.Errorf("ParseRules(%q): %v", tc.in, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseRules(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestParseRules_errorsNameTheRule(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want []string // substrings of the error
	}{
		{in: "api:call", want: []string{`rule 1 "api:call"`, "has no quota"}},
		{in: "api:call tenant=5/2s; email:send", want: []string{`rule 2 "email:send"`, "has no quota"}},
		{in: "tenant=5/2s", want: []string{`rule 1 "tenant=5/2s"`, "want a task type first"}},
		{in: "api:call tenant", want: []string{`quota "tenant"`, "scope=events/window"}},
		{in: "api:call user=5/2s", want: []string{`quota "user=5/2s"`, `unknown scope "user"`}},
		{in: "api:call weight=3 tenant=1/1s", want: []string{`quota "weight=3"`, `unknown scope "weight"`, `weight= belongs to a tier's or a tenant's limits`}},
		// Spaces around '=' split a quota: each piece says how to write it (trial 4 got
		// `unknown scope ""` for "=").
		{in: "api:call =5/2s", want: []string{`"api:call =5/2s": write name=value with no space around '='`}},
		{in: "api:call tenant= 5/2s", want: []string{`"tenant= 5/2s": write name=value with no space around '='`}},
		{in: "api:call tenant = 5/2s", want: []string{`"tenant = 5/2s": write name=value with no space around '='`}},
		{in: "api:call tenant=5", want: []string{`quota "tenant=5"`, "events/window"}},
		{in: "api:call tenant=x/2s", want: []string{`quota "tenant=x/2s"`, `events "x" is not an integer`}},
		{in: "api:call tenant=99999999999999999999/1s", want: []string{`events "99999999999999999999" is too large (less than 2^42, 4398046511104)`}},
		{in: "api:call tenant=9007199254740992/1s", want: []string{`quota "tenant=9007199254740992/1s"`, "events must be less than 2^42"}},
		{in: "api:call tenant=0/2s", want: []string{`quota "tenant=0/2s"`, "events must be at least 1"}},
		{in: "api:call tenant=-3/2s", want: []string{"events must be at least 1"}},
		{in: "api:call tenant=5/2", want: []string{`window "2" is not a Go duration`}},
		{in: "api:call tenant=5/0s", want: []string{"window must be at least 1ms"}},
		{in: "api:call tenant=5/1.5ms", want: []string{"not a whole number of milliseconds"}},
		{in: "a tenant=1/1s; b type=1/1s; a type=2/1s", want: []string{`rule 3 "a type=2/1s"`, "already has rule 1"}},
		{in: "a tenant=1/1s max-delay=soon", want: []string{`"max-delay=soon"`, "want one max-delay=<positive Go duration>"}},
		{in: "a tenant=1/1s max-delay=0s", want: []string{`"max-delay=0s"`, "positive Go duration"}},
		{in: "a tenant=1/1s max-delay=1m max-delay=2m", want: []string{`"max-delay=2m"`, "want one max-delay"}},
		{in: "a tenant=1/1s overdue=maybe", want: []string{`"overdue=maybe"`, "want overdue=archive, overdue=run or overdue=drop"}},
		{in: "a tenant=1/1s overdue=run overdue=drop", want: []string{`"overdue=drop"`, "given twice"}},
		{in: "a tenant=1/1s mode=dry", want: []string{`rule 1 "a tenant=1/1s mode=dry"`, `"mode=dry"`, "want mode=enforce or mode=shadow"}},
		{in: "a tenant=1/1s mode=shadow mode=enforce", want: []string{`"mode=enforce"`, "mode= is given twice"}},
		// Two quotas at one scope with one window: only the smaller could ever decide.
		{in: "a type=9/1m; b tenant=5/1s tenant=3/1s", want: []string{
			`worker: rule 2 "b tenant=5/1s tenant=3/1s": quotas tenant=5/1s and tenant=3/1s have the same scope and window, so only the smaller ever decides; keep one (tenant=3/1s)`}},
		{in: "a tenant=2/1s type=7/1m tenant=4/1000ms", want: []string{`quotas tenant=2/1s and tenant=4/1s have the same scope and window`, "keep one (tenant=2/1s)"}},
		{in: "a type=2/1h type=2/60m", want: []string{`quotas type=2/1h and type=2/1h have the same scope and window`}},
	}
	for _, tc := range tests {
		_, err := worker.ParseRules(tc.in)
		if err == nil {
			t.Errorf("ParseRules(%q): no error", tc.in)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("ParseRules(%q) error %q does not contain %q", tc.in, err, w)
			}
		}
	}
}

func TestRule_String_roundTrips(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"api:call tenant=5/2s type=20/1s",
		"llm:complete tenant=40000/1m cost=header:tokens",
		"report:build tenant=2/1m max-delay=30m0s overdue=drop",
		"x tenant=1/1s overdue=run",
		"x tenant=1/1s type=1/1s mode=shadow",
	} {
		rules, err := worker.ParseRules(in)
		if err != nil {
			t.Fatal(err)
		}
		if got := rules[0].String(); got != in {
			t.Errorf("String() = %q, want %q", got, in)
		}
	}
	rules, err := worker.ParseRules("report:build tenant=2/1m max-delay=30m overdue=drop")
	if err != nil {
		t.Fatal(err)
	}
	if r := rules[0]; r.MaxDelay != 30*time.Minute || r.Overdue != worker.OverdueDrop {
		t.Errorf("MaxDelay %v, Overdue %v; want 30m and drop", r.MaxDelay, r.Overdue)
	}
}

// TestRule_Validate_sameWindow: a Rule built in code with two quotas at one scope and one
// window is rejected by Validate (and so by New), naming the rule and both quotas.
func TestRule_Validate_sameWindow(t *testing.T) {
	t.Parallel()
	r := worker.Rule{TaskType: "x", Quotas: []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)},
		{Scope: throttle.ScopeType, Limit: throttle.PerSecond(5)},
		{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(3)},
	}}
	want := `worker: rule "x tenant=5/1s type=5/1s tenant=3/1s": quotas tenant=5/1s and tenant=3/1s have the same scope and window, so only the smaller ever decides; keep one (tenant=3/1s)`
	if err := r.Validate(); err == nil || err.Error() != want {
		t.Errorf("Validate() = %v, want %s", err, want)
	}
	rdb := redistest.Start(t)
	if _, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: []worker.Rule{r}, Redis: rdb}); err == nil || err.Error() != want {
		t.Errorf("New() = %v, want %s", err, want)
	}
	r.Quotas = r.Quotas[:2]
	if err := r.Validate(); err != nil {
		t.Errorf("Validate() of one window at two scopes: %v", err)
	}
	if err := (worker.Rule{TaskType: "x", Quotas: r.Quotas, Mode: 7}).Validate(); err == nil || !strings.Contains(err.Error(), "unknown Mode 7") {
		t.Errorf("Validate() of Mode 7 = %v, want unknown Mode 7", err)
	}
}
