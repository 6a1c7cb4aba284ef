package worker_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// mustEntries parses tier or tenant text or fails t.
func mustEntries(t *testing.T, s string) []worker.TenantLimits {
	t.Helper()
	e, err := worker.ParseTenantLimits(s)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// TestOverrides_Effective resolves (type, tenant) pairs through every layer: a type
// override replaces a default rule and adds a rule for an unruled type; a tenant's own
// entry for the type wins over its every-type entry, which wins over its tier's entry for
// the type, which wins over the tier's every-type entry; quotas and weight are resolved
// each on their own; type= quotas always stay the rule's.
func TestOverrides_Effective(t *testing.T) {
	t.Parallel()
	defaults := mustRules(t, "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h; shadow:job tenant=1/1s mode=shadow")
	o := &worker.Overrides{
		Version: 7,
		Types:   map[string]worker.Rule{"email:send": mustRules(t, "email:send tenant=200/1h")[0], "new:type": mustRules(t, "new:type type=3/1s")[0]},
		Tiers: map[string][]worker.TenantLimits{
			"pro":  mustEntries(t, "tenant=50/1s weight=3; email:send tenant=1000/1h"),
			"free": mustEntries(t, "weight=1"),
		},
		Tenants:     map[string][]worker.TenantLimits{"acme": mustEntries(t, "api:call weight=9; tenant=70/1s")},
		TenantTiers: map[string]string{"acme": "pro", "globex": "pro", "initech": "free"},
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		taskType, tenant string
		want             worker.Effective
	}{
		{"api:call", "nobody", worker.Effective{Rule: mustRules(t, "api:call tenant=5/2s type=20/1s")[0],
			RuleFrom: worker.SourceDefault, QuotasFrom: worker.SourceDefault}},
		// globex: the tier's every-type entry, quotas and weight; type=20/1s stays.
		{"api:call", "globex", worker.Effective{Rule: mustRules(t, "api:call tenant=50/1s type=20/1s")[0], Weight: 3, Tier: "pro",
			RuleFrom: worker.SourceDefault, QuotasFrom: `tier "pro"`, WeightFrom: `tier "pro"`}},
		// The tier's entry for email:send wins for it; it sets no weight, the every-type entry does.
		{"email:send", "globex", worker.Effective{Rule: mustRules(t, "email:send tenant=1000/1h")[0], Weight: 3, Tier: "pro",
			RuleFrom: worker.SourceTypeOverride, QuotasFrom: `tier "pro"`, WeightFrom: `tier "pro"`}},
		// acme: its own api:call entry sets the weight, its every-type entry the quotas.
		{"api:call", "acme", worker.Effective{Rule: mustRules(t, "api:call tenant=70/1s type=20/1s")[0], Weight: 9, Tier: "pro",
			RuleFrom: worker.SourceDefault, QuotasFrom: worker.SourceTenant, WeightFrom: worker.SourceTenant}},
		// On email:send acme's own every-type quotas beat the tier's email:send entry; weight from the tier.
		{"email:send", "acme", worker.Effective{Rule: mustRules(t, "email:send tenant=70/1s")[0], Weight: 3, Tier: "pro",
			RuleFrom: worker.SourceTypeOverride, QuotasFrom: worker.SourceTenant, WeightFrom: `tier "pro"`}},
		// A type rule with no tenant quota gets the tenant's; the rule's type quota stays.
		{"new:type", "globex", worker.Effective{Rule: mustRules(t, "new:type tenant=50/1s type=3/1s")[0], Weight: 3, Tier: "pro",
			RuleFrom: worker.SourceTypeOverride, QuotasFrom: `tier "pro"`, WeightFrom: `tier "pro"`}},
		{"new:type", "initech", worker.Effective{Rule: mustRules(t, "new:type type=3/1s")[0], Weight: 1, Tier: "free",
			RuleFrom: worker.SourceTypeOverride, QuotasFrom: worker.SourceTypeOverride, WeightFrom: `tier "free"`}},
		// The mode is the rule's.
		{"shadow:job", "globex", worker.Effective{Rule: mustRules(t, "shadow:job tenant=50/1s mode=shadow")[0], Weight: 3, Tier: "pro",
			RuleFrom: worker.SourceDefault, QuotasFrom: `tier "pro"`, WeightFrom: `tier "pro"`}},
	}
	for _, tc := range tests {
		got, ok := o.Effective(defaults, throttle.Key{TaskType: tc.taskType, Tenant: tc.tenant})
		if !ok {
			t.Errorf("Effective(%s, %s): no rule", tc.taskType, tc.tenant)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Effective(%s, %s) =\n  %+v, want\n  %+v", tc.taskType, tc.tenant, got, tc.want)
		}
	}
	// No rule for the type, default or override: not throttled, whatever the tenant's entries.
	if got, ok := o.Effective(defaults, throttle.Key{TaskType: "other", Tenant: "acme"}); ok {
		t.Errorf("Effective(other, acme) = %+v, true; want no rule", got)
	}
	// The defaults are not changed by resolving.
	if got := defaults[0].String(); got != "api:call tenant=5/2s type=20/1s" {
		t.Errorf("default rule changed to %q", got)
	}
	// Without overrides: the defaults.
	if got, ok := (*worker.Overrides)(nil).Effective(defaults, throttle.Key{TaskType: "email:send", Tenant: "acme"}); !ok || got.Rule.String() != "email:send tenant=100/1h" || got.Weight != 0 {
		t.Errorf("nil Overrides: Effective = %+v, %v; want the default rule, weight 0", got, ok)
	}
}

func TestOverrides_Validate(t *testing.T) {
	t.Parallel()
	base := func() *worker.Overrides {
		return &worker.Overrides{Types: map[string]worker.Rule{}, Tiers: map[string][]worker.TenantLimits{"pro": mustEntries(t, "weight=2")},
			Tenants: map[string][]worker.TenantLimits{}, TenantTiers: map[string]string{}}
	}
	tests := []struct {
		name string
		edit func(*worker.Overrides)
		want string
	}{
		{"DanglingTier", func(o *worker.Overrides) { o.TenantTiers["acme"] = "gold" }, `worker: tenant "acme" is assigned to tier "gold", which does not exist`},
		{"BadTierName", func(o *worker.Overrides) { o.Tiers["a b"] = mustEntries(t, "weight=2") }, `worker: tier name "a b": want 1 to 64 letters`},
		{"EmptyTier", func(o *worker.Overrides) { o.Tiers["x"] = nil }, `worker: tier "x" has no entry`},
		{"TypeQuotaInTier", func(o *worker.Overrides) {
			o.Tiers["x"] = []worker.TenantLimits{{Quotas: []throttle.Quota{{Scope: throttle.ScopeType, Limit: throttle.PerSecond(1)}}}}
		}, `worker: tier "x": worker: tenant limits "type=1/1s": quota type=1/1s is not a tenant= quota`},
		{"RuleUnderOtherType", func(o *worker.Overrides) { o.Types["a"] = mustRules(t, "b tenant=1/1s")[0] }, `worker: override of task type "a" holds a rule of task type "b"`},
		{"TwoEntriesOneType", func(o *worker.Overrides) {
			o.Tenants["acme"] = []worker.TenantLimits{{TaskType: "a", Weight: 2}, {TaskType: "a", Weight: 3}}
		}, `worker: tenant "acme": worker: two entries for task type "a"`},
	}
	for _, tc := range tests {
		o := base()
		tc.edit(o)
		if err := o.Validate(); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want %s...", tc.name, err, tc.want)
		}
	}
	if err := base().Validate(); err != nil {
		t.Errorf("valid overrides: %v", err)
	}
}

func TestParseTenantLimits(t *testing.T) {
	t.Parallel()
	got, err := worker.ParseTenantLimits(" tenant=50/1000ms weight=3 ; api:call tenant=5/1s tenant=100/1h; email:send weight=7;")
	if err != nil {
		t.Fatal(err)
	}
	want := []worker.TenantLimits{
		{Quotas: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(50)}}, Weight: 3},
		{TaskType: "api:call", Quotas: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)}, {Scope: throttle.ScopeTenant, Limit: throttle.PerHour(100)}}},
		{TaskType: "email:send", Weight: 7},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseTenantLimits = %+v, want %+v", got, want)
	}
	if s := worker.FormatTenantLimits(got); s != "tenant=50/1s weight=3; api:call tenant=5/1s tenant=100/1h; email:send weight=7" {
		t.Errorf("FormatTenantLimits = %q", s)
	}
	for in, wantErr := range map[string]string{
		"api:call":                  `worker: entry 1 "api:call": neither a tenant= quota nor a weight=`,
		"a weight=2; a type=5/1s":   `worker: entry 2 "a type=5/1s": "type=5/1s": a type= quota is shared by every tenant; set it in the task type's rule`,
		"tenant=1/1s cost=header:n": `worker: entry 1 "tenant=1/1s cost=header:n": "cost=header:n": cost= belongs to the task type's rule, not to a tier or a tenant`,
		"tenant=1/1s mode=shadow":   `worker: entry 1 "tenant=1/1s mode=shadow": "mode=shadow": mode= belongs to the task type's rule`,
		"weight=0":                  `worker: entry 1 "weight=0": "weight=0": want one weight=<integer from 1 to 1000000>, e.g. weight=3`,
		"weight=2 weight=3":         `worker: entry 1 "weight=2 weight=3": "weight=3": want one weight=`,
		// Trial 5: "weight = 3" read as a task type "weight" and a quota "=".
		"weight = 3":                         `worker: entry 1 "weight = 3": "weight = 3": write name=value with no space around '=', e.g. tenant=5/2s or weight=3`,
		"tenant=5/1s tenant=3/1000ms":        `worker: entry 1 "tenant=5/1s tenant=3/1000ms": quotas tenant=5/1s and tenant=3/1s have the same scope and window, so only the smaller ever decides; keep one (tenant=3/1s)`,
		"weight=2; tenant=1/1s":              `worker: entry 2 "tenant=1/1s": the entry for every task type is already entry 1; put it in one entry`,
		"a weight=2; b weight=2; a weight=3": `worker: entry 3 "a weight=3": task type "a" is already entry 1; put it in one entry`,
		"a tenant=x/1s":                      `worker: entry 1 "a tenant=x/1s": quota "tenant=x/1s": throttle: limit "x/1s": events "x" is not an integer`,
	} {
		_, err := worker.ParseTenantLimits(in)
		if err == nil || !strings.HasPrefix(err.Error(), wantErr) {
			t.Errorf("ParseTenantLimits(%q) error = %v, want %s...", in, err, wantErr)
		}
	}
}

// TestOverrideStore: every kind is validated, normalized, stored under one hash with a
// version that each change increments, and read back by Load; a tenant can only be
// assigned to a tier that exists, a tier in use cannot be deleted, deleting what is not
// there says so, and a rejected change stores nothing.
func TestOverrideStore(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	ctx := context.Background()
	s, err := worker.NewOverrideStore(rdb, "tp")
	if err != nil {
		t.Fatal(err)
	}
	if s.Key() != "tp:overrides" || worker.OverridesKey("") != "throttle:overrides" {
		t.Fatalf("keys %q, %q", s.Key(), worker.OverridesKey(""))
	}
	if _, err := worker.NewOverrideStore(rdb, "a{b}"); err == nil {
		t.Error("NewOverrideStore accepted prefix a{b}")
	}
	wantErr := `worker: NewOverrideStore: producer: prefix "throttle:enqueue": its last ':'-separated segment is "enqueue", which enqueue quotas put after the workers' prefix ("<prefix>:enqueue:{<task type>}:..."): a worker's keys under it would be enqueue quotas' keys; choose another`
	if _, err := worker.NewOverrideStore(rdb, "throttle:enqueue"); err == nil || err.Error() != wantErr {
		t.Errorf("NewOverrideStore(throttle:enqueue) = %v\nwant %s", err, wantErr)
	}
	o, err := s.Load(ctx)
	if err != nil || o.Version != 0 || len(o.Types)+len(o.Tiers)+len(o.Tenants)+len(o.TenantTiers) != 0 {
		t.Fatalf("Load of nothing = %+v, %v; want empty at version 0", o, err)
	}
	set := func(kind worker.OverrideKind, name, text string, want worker.Change) {
		t.Helper()
		got, err := s.Set(ctx, kind, name, text)
		if err != nil || got != want {
			t.Fatalf("Set(%s, %q, %q) = %+v, %v; want %+v", kind, name, text, got, err, want)
		}
	}
	set(worker.OverrideType, "api:call", "tenant=10/1000ms  type=30/1s", worker.Change{Kind: "type", Name: "api:call", Text: "tenant=10/1s type=30/1s", Version: 1})
	set(worker.OverrideTier, "pro", "tenant=50/1s weight=3; email:send tenant=1000/60m", worker.Change{Kind: "tier", Name: "pro", Text: "tenant=50/1s weight=3; email:send tenant=1000/1h", Version: 2})
	set(worker.OverrideTenant, "acme corp", "weight=9", worker.Change{Kind: "tenant", Name: "acme corp", Text: "weight=9", Version: 3})
	set(worker.OverrideTenantTier, "acme corp", "pro", worker.Change{Kind: "tenant-tier", Name: "acme corp", Text: "pro", Version: 4})
	set(worker.OverrideTenantTier, "", "pro", worker.Change{Kind: "tenant-tier", Name: "", Text: "pro", Version: 5}) // the untagged tenant ""

	rejected := []struct {
		kind       worker.OverrideKind
		name, text string
		is         error
		want       string
	}{
		{worker.OverrideType, "api:call", "tenant=5/1s tenant=3/1s", worker.ErrInvalidOverride, "same scope and window"},
		{worker.OverrideType, "api:call", "tenant=5/1s; b tenant=1/1s", worker.ErrInvalidOverride, "one rule, without ';'"},
		{worker.OverrideType, "a b", "tenant=5/1s", worker.ErrInvalidOverride, `task type "a b": want a non-empty task type`},
		{worker.OverrideType, "api:call", "", worker.ErrInvalidOverride, "has no quota"},
		{worker.OverrideTier, "pro plus", "weight=2", worker.ErrInvalidOverride, `tier "pro plus": want 1 to 64 letters`},
		{worker.OverrideTier, "pro", "type=5/1s", worker.ErrInvalidOverride, "a type= quota is shared by every tenant"},
		{worker.OverrideTier, "pro", " ; ", worker.ErrInvalidOverride, "no entry"},
		{worker.OverrideTenant, "acme", "weight=-1", worker.ErrInvalidOverride, "want one weight="},
		{worker.OverrideTenantTier, "acme", "gold", worker.ErrTierNotFound, `tenant "acme" cannot be assigned to tier "gold", which does not exist`},
		{"tenants", "acme", "weight=2", worker.ErrInvalidOverride, `unknown kind "tenants"`},
		{worker.OverrideTenant, strings.Repeat("q", 1025), "weight=2", worker.ErrInvalidOverride,
			`1025 bytes, more than throttle.MaxTenantBytes (1024): its tasks are never decided`},
		{worker.OverrideTenantTier, strings.Repeat("q", 1025), "pro", worker.ErrInvalidOverride, "more than throttle.MaxTenantBytes"},
		{worker.OverrideTenant, "t\xff", "weight=2", worker.ErrInvalidOverride, `tenant "t\xff": not valid UTF-8`},
		{worker.OverrideType, "e\xff", "tenant=5/1s", worker.ErrInvalidOverride, `type "e\xff": not valid UTF-8`},
	}
	for _, r := range rejected {
		_, err := s.Set(ctx, r.kind, r.name, r.text)
		if !errors.Is(err, r.is) || !strings.Contains(err.Error(), r.want) {
			t.Errorf("Set(%s, %q, %q) = %v; want %v containing %q", r.kind, r.name, r.text, err, r.is, r.want)
		}
	}
	if _, err := s.Delete(ctx, worker.OverrideTier, "pro"); !errors.Is(err, worker.ErrTierInUse) ||
		!strings.Contains(err.Error(), `tier "pro" still has tenants "", "acme corp"`) {
		t.Errorf("Delete(tier pro) = %v; want ErrTierInUse naming both tenants", err)
	}
	if _, err := s.Delete(ctx, worker.OverrideTenant, "globex"); !errors.Is(err, worker.ErrOverrideNotFound) {
		t.Errorf("Delete(tenant globex) = %v; want ErrOverrideNotFound", err)
	}
	if v, err := s.Version(ctx); err != nil || v != 5 {
		t.Fatalf("after rejected changes Version = %d, %v; want 5 (nothing stored)", v, err)
	}

	o, err = s.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := &worker.Overrides{
		Version:     5,
		Types:       map[string]worker.Rule{"api:call": mustRules(t, "api:call tenant=10/1s type=30/1s")[0]},
		Tiers:       map[string][]worker.TenantLimits{"pro": mustEntries(t, "tenant=50/1s weight=3; email:send tenant=1000/1h")},
		Tenants:     map[string][]worker.TenantLimits{"acme corp": mustEntries(t, "weight=9")},
		TenantTiers: map[string]string{"acme corp": "pro", "": "pro"},
	}
	if !reflect.DeepEqual(o, want) {
		t.Errorf("Load = %+v, want %+v", o, want)
	}
	raw, err := rdb.HGetAll(ctx, "tp:overrides").Result()
	if err != nil {
		t.Fatal(err)
	}
	wantRaw := map[string]string{"version": "5", "type:api:call": "tenant=10/1s type=30/1s",
		"tier:pro": "tenant=50/1s weight=3; email:send tenant=1000/1h", "tenant:acme corp": "weight=9",
		"tenant-tier:acme corp": "pro", "tenant-tier:": "pro"}
	if !reflect.DeepEqual(raw, wantRaw) {
		t.Errorf("hash = %q, want %q", raw, wantRaw)
	}

	for _, d := range []struct {
		kind worker.OverrideKind
		name string
	}{{worker.OverrideTenantTier, "acme corp"}, {worker.OverrideTenantTier, ""}, {worker.OverrideTier, "pro"}} {
		if _, err := s.Delete(ctx, d.kind, d.name); err != nil {
			t.Fatalf("Delete(%s %q): %v", d.kind, d.name, err)
		}
	}
	if c, err := s.Delete(ctx, worker.OverrideType, "api:call"); err != nil || c != (worker.Change{Kind: "type", Name: "api:call", Deleted: true, Version: 9}) {
		t.Errorf("Delete(type api:call) = %+v, %v; want deleted at version 9", c, err)
	}
	o, err = s.Load(ctx)
	if err != nil || o.Version != 9 || len(o.Types) != 0 || len(o.Tiers) != 0 || len(o.TenantTiers) != 0 || len(o.Tenants) != 1 {
		t.Errorf("after deletions Load = %+v, %v; want only acme corp's entry, version 9", o, err)
	}
	// A field written by hand that does not parse, or names a missing tier, fails Load
	// with the field; a field of an unknown kind is ignored.
	rdb.HSet(ctx, "tp:overrides", "pause:x", "whatever")
	if _, err := s.Load(ctx); err != nil {
		t.Errorf("Load with a field of an unknown kind: %v", err)
	}
	rdb.HSet(ctx, "tp:overrides", "tenant-tier:zed", "gold")
	if _, err := s.Load(ctx); err == nil || err.Error() != `worker: overrides tp:overrides: worker: tenant "zed" is assigned to tier "gold", which does not exist` {
		t.Errorf("Load with a dangling tier = %v", err)
	}
	rdb.HSet(ctx, "tp:overrides", "tier:gold", "type=1/1s")
	if _, err := s.Load(ctx); err == nil || !strings.HasPrefix(err.Error(), `worker: overrides tp:overrides: field "tier:gold"="type=1/1s": worker: entry 1 "type=1/1s"`) {
		t.Errorf("Load with a bad tier = %v", err)
	}
}

// TestOverrideStore_concurrentChanges: 8 goroutines each make 25 changes at once; every
// change gets its own version (WATCH/MULTI retries), so the version ends at 200.
func TestOverrideStore_concurrentChanges(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	s, err := worker.NewOverrideStore(rdb, "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := s.Set(ctx, worker.OverrideTier, "pro", "weight=2"); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 8)
	versions := make(chan int64, 200)
	for g := range 8 {
		go func() {
			for i := range 25 {
				tenant := string(rune('a'+g)) + strings.Repeat("x", i)
				c, err := s.Set(ctx, worker.OverrideTenantTier, tenant, "pro")
				if err != nil {
					errs <- err
					return
				}
				versions <- c.Version
			}
			errs <- nil
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(versions)
	seen := map[int64]bool{}
	for v := range versions {
		seen[v] = true
	}
	if len(seen) != 200 {
		t.Errorf("200 changes got %d distinct versions", len(seen))
	}
	if v, err := s.Version(ctx); err != nil || v != 201 {
		t.Errorf("Version = %d, %v; want 201", v, err)
	}
}
