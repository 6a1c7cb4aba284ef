package worker

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Overrides refine the default rules (Config.Rules, THROTTLE_RULES) at runtime: a rule per
// task type that replaces the default one (or throttles a type that has none), named
// tiers of tenant limits, tenants assigned to tiers, and each tenant's own limits.
// OverrideStore keeps them in Redis, where every worker's middleware picks them up (see
// Config.Overrides).
//
// For a task of type T and tenant X, the rule is Types[T], else the default rule of T;
// a type with neither is not throttled, whatever its tenants' limits say. Then X's
// ScopeTenant quotas and weight come, each on its own, from the first of these that sets
// them: X's entry for T (Tenants[X]), X's entry for every type, the entry for T of X's
// tier (Tiers[TenantTiers[X]]), that tier's entry for every type, the rule. A weight set
// nowhere is Config.WeightFunc's, else 1.
type Overrides struct {
	// Version counts the changes stored (OverrideStore); 0 when none was ever stored.
	Version int64
	// Types maps a task type to the rule that replaces its default rule; each rule's
	// TaskType is its key.
	Types map[string]Rule
	// Tiers maps a tier name (see ValidTierName) to its entries.
	Tiers map[string][]TenantLimits
	// Tenants maps a tenant to its own entries, which win over its tier's.
	Tenants map[string][]TenantLimits
	// TenantTiers maps a tenant to the name of its tier, one of Tiers.
	TenantTiers map[string]string
}

// tierNameRE is what ValidTierName accepts.
var tierNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// ValidTierName returns an error unless name is 1 to 64 ASCII letters, digits, '_', '.'
// or '-', starting with a letter or digit: "pro", "free", "enterprise-2026".
func ValidTierName(name string) error {
	if err := checkTierName(name); err != nil {
		return fmt.Errorf("worker: tier name %s: %w", quote.Quote(name), err)
	}
	return nil
}

// checkTierName is ValidTierName without the name in its error, for a caller whose error
// names the tier already (Overrides.add's callers name the field or the override).
func checkTierName(name string) error {
	if !tierNameRE.MatchString(name) {
		return errors.New("want 1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, e.g. pro")
	}
	return nil
}

// Validate returns an error, naming the entry, unless every rule of Types is valid
// (Rule.Validate) and keyed by its task type, every tier has a valid name and at least one
// valid entry (TenantLimits.Validate), no two entries of a tier or tenant name one task
// type, and every tenant's tier is in Tiers.
func (o *Overrides) Validate() error {
	for tt, r := range o.Types {
		if r.TaskType != tt {
			return fmt.Errorf("worker: override of task type %q holds a rule of task type %q", tt, r.TaskType)
		}
		if err := r.Validate(); err != nil {
			return fmt.Errorf("worker: override of task type %q: %w", tt, err)
		}
	}
	for name, entries := range o.Tiers {
		if err := ValidTierName(name); err != nil {
			return err
		}
		if len(entries) == 0 {
			return fmt.Errorf("worker: tier %q has no entry", name)
		}
		if err := validEntries(entries); err != nil {
			return fmt.Errorf("worker: tier %q: %w", name, err)
		}
	}
	for tenant, entries := range o.Tenants {
		if err := validEntries(entries); err != nil {
			return fmt.Errorf("worker: tenant %s: %w", quote.Quote(tenant), err)
		}
	}
	for tenant, tier := range o.TenantTiers {
		if _, ok := o.Tiers[tier]; !ok {
			return fmt.Errorf("worker: tenant %s is assigned to tier %s, which does not exist", quote.Quote(tenant), quote.Quote(tier))
		}
	}
	return nil
}

func validEntries(entries []TenantLimits) error {
	seen := map[string]bool{}
	for _, e := range entries {
		if err := e.Validate(); err != nil {
			return err
		}
		if seen[e.TaskType] {
			return fmt.Errorf("worker: two entries for task type %q", e.TaskType)
		}
		seen[e.TaskType] = true
	}
	return nil
}

// Effective is what a task of one task type and tenant is decided with, and where each
// part comes from.
type Effective struct {
	// Rule is the rule the task is decided by: its ScopeTenant quotas are the tenant's.
	Rule Rule
	// Weight is the tenant's share of the rule's ScopeType quotas set by a tier or the
	// tenant's entries; 0 when none does (Config.WeightFunc, else 1).
	Weight int
	// Tier is the tenant's tier, "" if none.
	Tier string
	// RuleFrom is SourceDefault or SourceTypeOverride.
	RuleFrom string
	// QuotasFrom says where the ScopeTenant quotas come from: RuleFrom's value,
	// SourceTenant, or the tier, as `tier "pro"`.
	QuotasFrom string
	// WeightFrom says where Weight comes from: SourceTenant or `tier "pro"`; "" when 0.
	WeightFrom string
}

// Sources named by Effective. A tier is named by its name too: `tier "pro"`.
const (
	SourceDefault      = "default rule"    // Config.Rules (THROTTLE_RULES)
	SourceTypeOverride = "type override"   // Overrides.Types
	SourceTenant       = "tenant override" // the tenant's own entries, Overrides.Tenants
)

// Effective returns what a task of key's type and tenant is decided with, given the
// default rules (valid, as New requires), and false if its type has no rule (it runs
// unthrottled). o may be nil: the defaults alone. It merges the whole set on each call;
// the middleware merges it once per change.
func (o *Overrides) Effective(defaults []Rule, key throttle.Key) (Effective, bool) {
	return compileLimits(defaults, o).resolve(key)
}

// limitSet is the immutable snapshot of the rules and overrides that the middleware
// decides by: compiled once per change, read by every task without locks.
type limitSet struct {
	version  int64 // Overrides.Version; -1: no overrides read yet
	rules    map[string]Rule
	ruleFrom map[string]string
	tenants  map[string]*tenantPlan // only tenants with entries or a tier
}

// tenantPlan is one tenant's merged entries: by task type, and for every other type.
type tenantPlan struct {
	tier   string
	byType map[string]planEntry
	any    planEntry
}

// planEntry is the tenant's quotas and weight on one task type, with their sources.
type planEntry struct {
	quotas     []throttle.Quota // nil: the rule's
	quotasFrom string
	weight     int // 0: none
	weightFrom string
}

// compileLimits merges defaults and o (nil: none) into a limitSet. It assumes both are
// valid: New validates the defaults, parseOverrides the overrides.
func compileLimits(defaults []Rule, o *Overrides) *limitSet {
	s := &limitSet{version: -1, rules: map[string]Rule{}, ruleFrom: map[string]string{}, tenants: map[string]*tenantPlan{}}
	for _, r := range defaults {
		s.rules[r.TaskType], s.ruleFrom[r.TaskType] = r, SourceDefault
	}
	if o == nil {
		return s
	}
	s.version = o.Version
	for tt, r := range o.Types {
		s.rules[tt], s.ruleFrom[tt] = r, SourceTypeOverride
	}
	tenants := map[string]bool{}
	for t := range o.Tenants {
		tenants[t] = true
	}
	for t := range o.TenantTiers {
		tenants[t] = true
	}
	for t := range tenants {
		tier := o.TenantTiers[t]
		s.tenants[t] = mergePlan(tier, o.Tenants[t], o.Tiers[tier])
	}
	return s
}

// mergePlan merges a tenant's own entries and its tier's, most specific first: its own for
// the type, its own for every type, the tier's for the type, the tier's for every type.
func mergePlan(tier string, own, tiers []TenantLimits) *tenantPlan {
	p := &tenantPlan{tier: tier, byType: map[string]planEntry{}}
	find := func(entries []TenantLimits, tt string) (TenantLimits, bool) {
		i := slices.IndexFunc(entries, func(e TenantLimits) bool { return e.TaskType == tt })
		if i < 0 {
			return TenantLimits{}, false
		}
		return entries[i], true
	}
	tierSource := "tier " + strconv.Quote(tier)
	merge := func(tt string) planEntry {
		var pe planEntry
		layers := []struct {
			entries []TenantLimits
			tt      string
			source  string
		}{{own, tt, SourceTenant}, {own, "", SourceTenant}, {tiers, tt, tierSource}, {tiers, "", tierSource}}
		for _, l := range layers {
			e, ok := find(l.entries, l.tt)
			if !ok {
				continue
			}
			if pe.quotas == nil && len(e.Quotas) > 0 {
				pe.quotas, pe.quotasFrom = e.Quotas, l.source
			}
			if pe.weight == 0 && e.Weight > 0 {
				pe.weight, pe.weightFrom = e.Weight, l.source
			}
		}
		return pe
	}
	for _, e := range slices.Concat(own, tiers) {
		if e.TaskType != "" {
			p.byType[e.TaskType] = merge(e.TaskType)
		}
	}
	p.any = merge("")
	return p
}

// resolve returns what a task of key is decided with, and false if its type has no rule.
func (s *limitSet) resolve(key throttle.Key) (Effective, bool) {
	r, ok := s.rules[key.TaskType]
	if !ok {
		return Effective{}, false
	}
	e := Effective{Rule: r, RuleFrom: s.ruleFrom[key.TaskType]}
	e.QuotasFrom = e.RuleFrom
	p := s.tenants[key.Tenant]
	if p == nil {
		return e, true
	}
	e.Tier = p.tier
	pe, ok := p.byType[key.TaskType]
	if !ok {
		pe = p.any
	}
	if pe.quotas != nil {
		e.Rule.Quotas = withTenantQuotas(r.Quotas, pe.quotas)
		e.QuotasFrom = pe.quotasFrom
	}
	e.Weight, e.WeightFrom = pe.weight, pe.weightFrom
	return e, true
}

// withTenantQuotas returns tenant's quotas followed by the ScopeType quotas of quotas: a
// new slice, so the rule's own is never changed.
func withTenantQuotas(quotas, tenant []throttle.Quota) []throttle.Quota {
	out := make([]throttle.Quota, 0, len(tenant)+len(quotas))
	out = append(out, tenant...)
	for _, q := range quotas {
		if q.Scope != throttle.ScopeTenant {
			out = append(out, q)
		}
	}
	return out
}

// taskTypes returns the task types that have a rule, sorted.
func (s *limitSet) taskTypes() []string {
	types := make([]string, 0, len(s.rules))
	for tt := range s.rules {
		types = append(types, tt)
	}
	slices.Sort(types)
	return types
}
