package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

var limitsCommand = command{
	name:    "limits",
	summary: "show, set and delete the tiers and overrides that workers pick up at runtime",
	run:     runLimits,
}

const limitsUsage = `Usage:
  throttle limits show [-tenant X [-type T]] [-type T]
  throttle limits set type <task type> <rule>        e.g. set type api:call 'tenant=10/1s type=50/1s'
  throttle limits set tier <tier> <limits>           e.g. set tier pro 'tenant=50/1s weight=3'
  throttle limits set tenant <tenant> <limits>       e.g. set tenant acme 'api:call tenant=100/1s'
  throttle limits set tenant-tier <tenant> <tier>    e.g. set tenant-tier acme pro
  throttle limits delete type|tier|tenant|tenant-tier <name>

Overrides refine the workers' default rules (THROTTLE_RULES) while they run; every worker
checks for a change each second (worker.DefaultOverrideInterval) and puts it in force
without a restart. They live in one Redis hash, <THROTTLE_PREFIX>:overrides.

  type         replaces the default rule of a task type (or throttles a type that has none);
               <rule> is a THROTTLE_RULES rule without its task type
  tier         a named set of tenant limits; <limits> are entries separated by ';', each an
               optional task type (none: every type with a rule), tenant= quotas and a
               weight= (the tenant's share of the type= quotas, 1 to 1000000)
  tenant       a tenant's own limits, in the same form; they win over its tier's
  tenant-tier  puts a tenant in a tier

A change is validated before it is stored (the workers' parsers); a tier can be deleted
once no tenant is in it. show lists what is stored; with -tenant, what that tenant gets on
each task type (or on -type), given THROTTLE_RULES; with -type alone, that type's rule.
Flags may come anywhere; '--' ends them (for a tenant that starts with '-').

Flags:
  -json    print JSON on stdout
  -tenant  (show) the tenant whose limits to show
  -type    (show) the task type whose rule to show
`

// runLimits is the limits subcommand.
func runLimits(e *env, args []string) int {
	fs := e.flags("limits")
	var tenant, taskType optString
	fs.Var(&tenant, "tenant", "")
	fs.Var(&taskType, "type", "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, limitsUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "limits: %v\nRun 'throttle limits -h' for usage.", err)
	}
	if len(pos) == 0 {
		return e.fail(exitUsage, "limits: want show, set or delete\nRun 'throttle limits -h' for usage.")
	}
	verb, pos := pos[0], pos[1:]
	if verb != "show" && (tenant.set || taskType.set) {
		return e.fail(exitUsage, "limits %s: -tenant and -type are flags of show", verb)
	}
	switch verb {
	case "show":
		if len(pos) > 0 {
			return e.fail(exitUsage, "limits show: unexpected argument %q; use -tenant and -type", pos[0])
		}
		return limitsShow(e, tenant, taskType)
	case "set":
		if len(pos) < 3 {
			return e.fail(exitUsage, "limits set: want <kind> <name> <text>, e.g. set tier pro 'tenant=50/1s weight=3'")
		}
		return limitsChange(e, pos[0], pos[1], strings.Join(pos[2:], " "), false)
	case "delete":
		if len(pos) != 2 {
			return e.fail(exitUsage, "limits delete: want <kind> <name>, e.g. delete tier pro")
		}
		return limitsChange(e, pos[0], pos[1], "", true)
	}
	return e.fail(exitUsage, "limits: unknown action %q; want show, set or delete", verb)
}

// optString is a string flag that records whether it was set: "" is a tenant too.
type optString struct {
	v   string
	set bool
}

func (o *optString) String() string     { return o.v }
func (o *optString) Set(s string) error { o.v, o.set = s, true; return nil }

// store returns the override store of the environment's Redis.
func (e *env) store() (*worker.OverrideStore, int) {
	rdb, err := e.redis()
	if err != nil {
		return nil, e.fail(redisExit(err), "%v", err)
	}
	s, err := worker.NewOverrideStore(rdb, e.vars.Prefix)
	if err != nil {
		return nil, e.fail(exitUsage, "%v", err)
	}
	return s, exitOK
}

// limitsChange sets (or deletes) one override and prints the change.
func limitsChange(e *env, kindWord, name, text string, del bool) int {
	kind, verb := worker.OverrideKind(kindWord), "set"
	if del {
		verb = "delete"
	}
	if !isKind(kind) {
		return e.fail(exitUsage, "limits %s: unknown kind %q; want type, tier, tenant or tenant-tier", verb, kindWord)
	}
	if !del { // validate before reaching for Redis
		if _, err := worker.Canonical(kind, name, text); err != nil {
			return e.fail(exitRejected, "limits set: %v", err)
		}
	}
	s, code := e.store()
	if s == nil {
		return code
	}
	var c worker.Change
	var err error
	if del {
		c, err = s.Delete(e.ctx, kind, name)
	} else {
		c, err = s.Set(e.ctx, kind, name, text)
	}
	switch {
	case errors.Is(err, worker.ErrOverrideNotFound):
		return e.fail(exitNotFound, "limits delete: %v", err)
	case errors.Is(err, worker.ErrInvalidOverride), errors.Is(err, worker.ErrTierNotFound), errors.Is(err, worker.ErrTierInUse):
		return e.fail(exitRejected, "limits %s: %v", verb, err)
	case err != nil:
		return e.fail(exitRedis, "limits %s: %v", verb, err)
	}
	if !del && (kind == worker.OverrideTenant || kind == worker.OverrideTier) {
		noteRuleless(e, text)
	}
	if e.json {
		return e.printJSON(c)
	}
	if del {
		fmt.Fprintf(e.stdout, "deleted %s %s (version %d)\n", kind, display(name), c.Version)
	} else {
		fmt.Fprintf(e.stdout, "set %s %s: %s (version %d)\n", kind, display(name), c.Text, c.Version)
	}
	fmt.Fprintf(e.stdout, "workers put it in force within %s\n", worker.DefaultOverrideInterval)
	return exitOK
}

// noteRuleless notes on stderr each task type that an entry of text (a tier's or a
// tenant's limits, already validated) names but that has no rule, given THROTTLE_RULES and
// the type overrides: the middleware throttles only types with a rule (worker.Overrides),
// so such an entry does nothing until the type gets one. It says nothing when
// THROTTLE_RULES is unset, as the workers' rules are then unknown here.
func noteRuleless(e *env, text string) {
	entries, err := worker.ParseTenantLimits(text)
	if err != nil || e.vars.Rules == "" {
		return
	}
	rs, code := e.rules(optString{})
	if code != exitOK {
		return
	}
	for _, en := range entries {
		if _, ok := rs.typeRule(en.TaskType); en.TaskType != "" && !ok {
			fmt.Fprintf(e.stderr, "throttle: limits set: note: %s has no rule (THROTTLE_RULES, type overrides): its tasks run unthrottled, and this entry applies to them only once it has one\n", display(en.TaskType))
		}
	}
}

func isKind(k worker.OverrideKind) bool {
	for _, known := range worker.OverrideKinds {
		if k == known {
			return true
		}
	}
	return false
}

// storedJSON is what show prints with -json and neither -tenant nor -type.
type storedJSON struct {
	Key         string            `json:"key"`
	Version     int64             `json:"version"`
	Types       map[string]string `json:"types"`
	Tiers       map[string]string `json:"tiers"`
	Tenants     map[string]string `json:"tenants"`
	TenantTiers map[string]string `json:"tenant_tiers"`
}

// limitJSON is what one tenant gets on one task type.
type limitJSON struct {
	TaskType   string `json:"task_type"`
	Rule       string `json:"rule"`
	Mode       string `json:"mode"`
	Weight     int    `json:"weight"`
	RuleFrom   string `json:"rule_from"`
	QuotasFrom string `json:"quotas_from"`
	WeightFrom string `json:"weight_from"`
}

// effectiveJSON is what show prints with -json and -tenant or -type.
type effectiveJSON struct {
	Key     string `json:"key"`
	Version int64  `json:"version"`
	// Defaults says whether THROTTLE_RULES was known: false means the default rules
	// were not given to this command, so only types with an override are shown.
	Defaults bool        `json:"defaults"`
	Tenant   *string     `json:"tenant,omitempty"`
	Tier     string      `json:"tier,omitempty"`
	Limits   []limitJSON `json:"limits"`
}

// limitsShow prints what is stored, or what a tenant gets.
func limitsShow(e *env, tenant, taskType optString) int {
	var defaults []worker.Rule
	if e.vars.Rules != "" {
		var err error
		if defaults, err = worker.ParseRules(e.vars.Rules); err != nil {
			return e.fail(exitUsage, "THROTTLE_RULES=%q: %v", e.vars.Rules, err)
		}
	}
	s, code := e.store()
	if s == nil {
		return code
	}
	o, err := s.Load(e.ctx)
	if err != nil {
		return e.fail(exitRedis, "limits show: %v", err)
	}
	if !tenant.set && !taskType.set {
		return showStored(e, s.Key(), o)
	}
	return showEffective(e, s.Key(), o, defaults, tenant, taskType)
}

func showStored(e *env, key string, o *worker.Overrides) int {
	j := storedJSON{Key: key, Version: o.Version, Types: map[string]string{}, Tiers: map[string]string{},
		Tenants: map[string]string{}, TenantTiers: o.TenantTiers}
	for tt, r := range o.Types {
		j.Types[tt] = strings.TrimPrefix(r.String(), tt+" ")
	}
	for name, entries := range o.Tiers {
		j.Tiers[name] = worker.FormatTenantLimits(entries)
	}
	for t, entries := range o.Tenants {
		j.Tenants[t] = worker.FormatTenantLimits(entries)
	}
	if e.json {
		return e.printJSON(j)
	}
	fmt.Fprintf(e.stdout, "overrides in %s, version %d\n", key, o.Version)
	sections := []struct {
		title string
		m     map[string]string
	}{
		{"task type rules (replace THROTTLE_RULES)", j.Types},
		{"tiers", j.Tiers},
		{"tenant limits (win over their tier's)", j.Tenants},
		{"tenant tiers", j.TenantTiers},
	}
	for _, sec := range sections {
		fmt.Fprintf(e.stdout, "\n%s:\n", sec.title)
		if len(sec.m) == 0 {
			fmt.Fprintln(e.stdout, "  (none)")
			continue
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		for _, k := range sortedKeys(sec.m) {
			fmt.Fprintf(tw, "  %s\t%s\n", display(k), sec.m[k])
		}
		_ = tw.Flush()
	}
	return exitOK
}

// showEffective prints what tenant gets on taskType, or on every type with a rule; or,
// without a tenant, taskType's rule.
func showEffective(e *env, key string, o *worker.Overrides, defaults []worker.Rule, tenant, taskType optString) int {
	j := effectiveJSON{Key: key, Version: o.Version, Defaults: defaults != nil, Limits: []limitJSON{}}
	var types []string
	if taskType.set {
		types = []string{taskType.v}
	} else {
		seen := map[string]bool{}
		for _, r := range defaults {
			seen[r.TaskType] = true
		}
		for tt := range o.Types {
			seen[tt] = true
		}
		types = sortedKeys(seen)
	}
	if tenant.set {
		j.Tenant = &tenant.v
		j.Tier = o.TenantTiers[tenant.v]
	}
	for _, tt := range types {
		var eff worker.Effective
		var ok bool
		if tenant.set {
			eff, ok = o.Effective(defaults, throttle.Key{TaskType: tt, Tenant: tenant.v})
		} else {
			// A type's own rule: as for a tenant with no limits of its own and no tier.
			eff, ok = (&worker.Overrides{Types: o.Types}).Effective(defaults, throttle.Key{TaskType: tt})
		}
		if !ok {
			continue
		}
		l := limitJSON{TaskType: tt, Rule: eff.Rule.String(), Mode: eff.Rule.Mode.String(), Weight: eff.Weight,
			RuleFrom: eff.RuleFrom, QuotasFrom: eff.QuotasFrom, WeightFrom: eff.WeightFrom}
		if l.Weight == 0 {
			l.Weight, l.WeightFrom = 1, "default"
		}
		j.Limits = append(j.Limits, l)
	}
	if e.json {
		return e.printJSON(j)
	}
	who := "a tenant without limits of its own or a tier"
	if tenant.set {
		who = "tenant " + fmt.Sprintf("%q", tenant.v)
		if j.Tier != "" {
			who += " (tier " + j.Tier + ")"
		}
	}
	fmt.Fprintf(e.stdout, "what %s gets, overrides version %d:\n", who, o.Version)
	if !j.Defaults {
		fmt.Fprintln(e.stdout, "(THROTTLE_RULES is unset here: only task types with an override are known)")
	}
	if len(j.Limits) == 0 {
		what := "no task type has a rule"
		if taskType.set {
			what = "task type " + display(taskType.v) + " has no rule: not throttled"
		}
		fmt.Fprintf(e.stdout, "  (%s)\n", what)
		return exitOK
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  TASK TYPE\tRULE\tWEIGHT\tRULE FROM\tTENANT QUOTAS FROM\tWEIGHT FROM")
	for _, l := range j.Limits {
		fmt.Fprintf(tw, "  %s\t%s\t%d\t%s\t%s\t%s\n", display(l.TaskType), l.Rule, l.Weight, l.RuleFrom, l.QuotasFrom, l.WeightFrom)
	}
	_ = tw.Flush()
	return exitOK
}

// printJSON writes v as one JSON object on stdout.
func (e *env) printJSON(v any) int {
	enc := json.NewEncoder(e.stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return e.fail(exitRedis, "write JSON: %v", err)
	}
	return exitOK
}
