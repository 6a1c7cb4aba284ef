package worker

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TenantLimits is one entry of a tier or of a tenant's override (see Overrides): what a
// tenant gets instead of a rule's defaults on one task type, or, with TaskType "", on
// every task type that has a rule. Only the tenant's own limits and its share can
// change: a ScopeType quota is one log shared by every tenant, so it belongs to the task
// type's rule.
type TenantLimits struct {
	// TaskType is the task type the entry applies to; "" for every task type that has a
	// rule (an entry naming the type wins over it).
	TaskType string
	// Quotas, if any, replace the rule's ScopeTenant quotas for the tenant (its ScopeType
	// quotas stay); all are ScopeTenant. None: the rule's (or a less specific entry's).
	Quotas []throttle.Quota
	// Weight, if > 0, is the tenant's share of the rule's ScopeType quotas, from 1 to
	// throttle.MaxWeight (see Config.WeightFunc): tenants with waiting tasks get that
	// type's slots in proportion to their weights. 0: the weight it would have had.
	Weight int
}

// String formats e as ParseTenantLimits reads it: "api:call tenant=50/1s weight=3", or
// "tenant=50/1s weight=3" for every task type.
func (e TenantLimits) String() string {
	var parts []string
	if e.TaskType != "" {
		parts = append(parts, e.TaskType)
	}
	for _, q := range e.Quotas {
		parts = append(parts, q.String())
	}
	if e.Weight > 0 {
		parts = append(parts, "weight="+strconv.Itoa(e.Weight))
	}
	return strings.Join(parts, " ")
}

// Validate returns an error unless e has a quota or a weight, every quota is a valid
// ScopeTenant quota (no two with the same window), and Weight is 0 or in
// [1, throttle.MaxWeight].
func (e TenantLimits) Validate() error {
	if len(e.Quotas) == 0 && e.Weight == 0 {
		return fmt.Errorf("worker: tenant limits %q: neither a tenant= quota nor a weight=", e)
	}
	for _, q := range e.Quotas {
		if q.Scope != throttle.ScopeTenant {
			return fmt.Errorf("worker: tenant limits %q: quota %s is not a tenant= quota", e, q)
		}
		if err := q.Validate(); err != nil {
			return fmt.Errorf("worker: tenant limits %q: %w", e, err)
		}
	}
	if err := checkWindows(e.Quotas); err != nil {
		return fmt.Errorf("worker: tenant limits %q: %w", e, err)
	}
	if e.Weight < 0 || e.Weight > throttle.MaxWeight {
		return fmt.Errorf("worker: tenant limits %q: weight %d is outside [1, %d]", e, e.Weight, throttle.MaxWeight)
	}
	return nil
}

// FormatTenantLimits joins entries as ParseTenantLimits reads them, separated by "; ".
func FormatTenantLimits(entries []TenantLimits) string {
	texts := make([]string, len(entries))
	for i, e := range entries {
		texts[i] = e.String()
	}
	return strings.Join(texts, "; ")
}

// ParseTenantLimits reads the text of a tier or of a tenant's override: entries separated
// by ';', each an optional task type followed by "tenant=events/window" quotas (as in
// ParseRules) and "weight=<1..1000000>", at least one of the two:
//
//	tenant=50/1s weight=3                          every task type with a rule
//	api:call tenant=50/1s weight=3; email:send tenant=1000/1h
//	tenant=10/1s; report:build tenant=1/1m         report:build's entry wins for it
//
// Empty entries and extra spaces are ignored; an empty s gives none. The error names the
// entry (its 1-based position and text) and the offending part: a "type=" quota (shared
// by every tenant: it belongs to the task type's rule), an option of the task type's rule
// (cost=, max-delay=, overdue=, mode=), a weight out of range or given twice, a quota
// ParseRules would reject, two quotas with the same window, an entry with neither quota
// nor weight, or a task type (or the every-type entry) given twice.
func ParseTenantLimits(s string) ([]TenantLimits, error) {
	var entries []TenantLimits
	seen := map[string]int{}
	for i, text := range strings.Split(s, ";") {
		fields := strings.Fields(text)
		if len(fields) == 0 {
			continue
		}
		where := fmt.Sprintf("entry %d %q", i+1, strings.TrimSpace(text))
		if err := spacedEquals(fields); err != nil {
			return nil, fmt.Errorf("worker: %s: %w", where, err)
		}
		var e TenantLimits
		if !strings.Contains(fields[0], "=") {
			e.TaskType, fields = fields[0], fields[1:]
		}
		for _, f := range fields {
			name, v, _ := strings.Cut(f, "=")
			switch name {
			case "weight":
				w, err := strconv.Atoi(v)
				if err != nil || w < 1 || w > throttle.MaxWeight || e.Weight != 0 {
					return nil, fmt.Errorf("worker: %s: %q: want one weight=<integer from 1 to %d>, e.g. weight=3", where, f, throttle.MaxWeight)
				}
				e.Weight = w
				continue
			case "type":
				return nil, fmt.Errorf("worker: %s: %q: a type= quota is shared by every tenant; set it in the task type's rule", where, f)
			case "cost", "max-delay", "overdue", "mode":
				return nil, fmt.Errorf("worker: %s: %q: %s= belongs to the task type's rule, not to a tier or a tenant", where, f, name)
			}
			q, err := parseQuota(f)
			if err != nil {
				return nil, fmt.Errorf("worker: %s: %w", where, err)
			}
			e.Quotas = append(e.Quotas, q)
		}
		if len(e.Quotas) == 0 && e.Weight == 0 {
			return nil, fmt.Errorf("worker: %s: neither a tenant= quota nor a weight=; want e.g. \"tenant=50/1s weight=3\"", where)
		}
		if err := checkWindows(e.Quotas); err != nil {
			return nil, fmt.Errorf("worker: %s: %w", where, err)
		}
		if prev, ok := seen[e.TaskType]; ok {
			what := fmt.Sprintf("task type %q", e.TaskType)
			if e.TaskType == "" {
				what = "the entry for every task type"
			}
			return nil, fmt.Errorf("worker: %s: %s is already entry %d; put it in one entry", where, what, prev)
		}
		seen[e.TaskType] = i + 1
		entries = append(entries, e)
	}
	return entries, nil
}
