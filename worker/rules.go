package worker

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Rule throttles every task of one type: each of its Quotas must have room before the
// task's handler runs.
type Rule struct {
	// TaskType is the asynq task type the rule applies to, e.g. "api:call".
	TaskType string
	// Quotas are decided together, all or nothing: a ScopeTenant quota is a limit for each
	// tenant, a ScopeType quota one limit for the whole type. At least one.
	Quotas []throttle.Quota
	// CostHeader, if set, names a task header whose value, a decimal integer >= 1, is the
	// number of slots the task takes in every quota (a batch size, a token count). A task
	// without the header costs 1. Rule text: "cost=header:<name>".
	CostHeader string
	// CostFunc, if set, computes the task's cost instead of CostHeader. An error from it
	// is final for the task (see New).
	CostFunc func(*asynq.Task) (int, error)
	// MaxDelay, if > 0, is the longest a task may be held back by the throttle: a denial
	// that makes it wait longer ends it as Overdue says. With reservations the whole wait
	// is known at the first denial. Rule text: "max-delay=<Go duration>".
	MaxDelay time.Duration
	// Overdue is what happens to a task that would wait longer than MaxDelay, or whose
	// reserved start is after its asynq Deadline. Rule text: "overdue=archive|run|drop".
	// Defaults to OverdueArchive.
	Overdue Overdue
	// Mode is ModeEnforce (the default) or ModeShadow, a dry run: every task is decided
	// and counted, and one the rule would hold back runs anyway (see ModeShadow). Rule
	// text: "mode=enforce|shadow".
	Mode Mode
}

// Mode says whether a rule holds tasks back or only reports what it would do.
type Mode uint8

const (
	// ModeEnforce throttles: a task over a quota waits for its slot.
	ModeEnforce Mode = iota
	// ModeShadow is a dry run, to roll out a quota safely: each task is decided by the
	// limiter at once (no wait in the handler, no reservation), an admission is logged in
	// the window logs as under ModeEnforce, so the logs hold what an enforced rule would
	// have admitted, and a task that would have been held back (denied, overdue, or
	// rejected for its cost) runs anyway: it writes nothing to the logs, and is counted
	// (OutcomeShadowDenied) and logged. The limiter being unreachable never holds a
	// shadowed task back either.
	ModeShadow
)

// String returns "enforce" or "shadow", the words of the rule text.
func (m Mode) String() string {
	switch m {
	case ModeEnforce:
		return "enforce"
	case ModeShadow:
		return "shadow"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// Overdue is the terminal outcome of a task that the throttle would hold back too long.
type Overdue uint8

const (
	// OverdueArchive archives the task (asynq.SkipRetry) with the reason as its last
	// error, so it can be inspected and run again by hand.
	OverdueArchive Overdue = iota
	// OverdueRun runs the task at once, over the limit: for work that must happen even
	// late more than it must respect the quota.
	OverdueRun
	// OverdueDrop drops the task (asynq.RevokeTask: neither run nor archived) and logs a
	// line naming it.
	OverdueDrop
)

// String returns "archive", "run" or "drop", the words of the rule text.
func (o Overdue) String() string {
	switch o {
	case OverdueArchive:
		return "archive"
	case OverdueRun:
		return "run"
	case OverdueDrop:
		return "drop"
	}
	return fmt.Sprintf("Overdue(%d)", uint8(o))
}

// ErrBadCost matches, under errors.Is, the error for a task whose cost cannot be read or is
// less than 1: it could never be decided, so the middleware returns it with
// asynq.SkipRetry.
var ErrBadCost = errors.New("worker: bad task cost")

// cost returns the number of slots task takes under r: CostFunc, else CostHeader, else 1.
func (r Rule) cost(task *asynq.Task) (int, error) {
	var n int
	switch {
	case r.CostFunc != nil:
		var err error
		if n, err = r.CostFunc(task); err != nil {
			return 0, fmt.Errorf("%w: CostFunc: %w", ErrBadCost, err)
		}
	case r.CostHeader != "":
		v, ok := task.Headers()[r.CostHeader]
		if !ok {
			return 1, nil
		}
		var err error
		if n, err = strconv.Atoi(v); err != nil {
			if errors.Is(err, strconv.ErrRange) {
				return 0, fmt.Errorf("%w: header %s=%q is out of range (an int)", ErrBadCost, r.CostHeader, v)
			}
			return 0, fmt.Errorf("%w: header %s=%q is not an integer", ErrBadCost, r.CostHeader, v)
		}
	default:
		return 1, nil
	}
	if n < 1 {
		return 0, fmt.Errorf("%w: cost %d is less than 1", ErrBadCost, n)
	}
	return n, nil
}

// String formats r as one THROTTLE_RULES rule: "api:call tenant=5/2s type=20/1s", with
// "cost=header:<name>" when CostHeader is set (a CostFunc has no text form), and
// "max-delay=", "overdue=" and "mode=shadow" when they are not the defaults.
func (r Rule) String() string {
	parts := []string{r.TaskType}
	for _, q := range r.Quotas {
		parts = append(parts, q.String())
	}
	if r.CostHeader != "" {
		parts = append(parts, "cost=header:"+r.CostHeader)
	}
	if r.MaxDelay > 0 {
		parts = append(parts, "max-delay="+r.MaxDelay.String())
	}
	if r.Overdue != OverdueArchive {
		parts = append(parts, "overdue="+r.Overdue.String())
	}
	if r.Mode != ModeEnforce {
		parts = append(parts, "mode="+r.Mode.String())
	}
	return strings.Join(parts, " ")
}

// Validate returns an error unless r names a task type and has at least one quota, each
// valid (throttle.Quota.Validate), no two of them at one scope with the same window (the
// larger would never decide), MaxDelay is not negative, and Overdue and Mode are known.
func (r Rule) Validate() error {
	if r.TaskType == "" {
		return fmt.Errorf("worker: rule %q: empty task type", r)
	}
	if len(r.Quotas) == 0 {
		return fmt.Errorf("worker: rule %q: no quota; want e.g. %q", r, r.TaskType+" tenant=5/2s")
	}
	for _, q := range r.Quotas {
		if err := q.Validate(); err != nil {
			return fmt.Errorf("worker: rule %q: %w", r, err)
		}
	}
	if err := checkWindows(r.Quotas); err != nil {
		return fmt.Errorf("worker: rule %q: %w", r, err)
	}
	if r.MaxDelay < 0 {
		return fmt.Errorf("worker: rule %q: negative MaxDelay %s", r, r.MaxDelay)
	}
	if r.Overdue > OverdueDrop {
		return fmt.Errorf("worker: rule %q: unknown Overdue %d", r, r.Overdue)
	}
	if r.Mode > ModeShadow {
		return fmt.Errorf("worker: rule %q: unknown Mode %d", r, r.Mode)
	}
	return nil
}

// checkWindows returns an error naming the first two quotas at one scope with the same
// window: of the two, only the smaller limit can ever decide, so the rule does not say
// what its author meant.
func checkWindows(quotas []throttle.Quota) error {
	for i, q := range quotas {
		for _, p := range quotas[:i] {
			if p.Scope == q.Scope && p.Limit.Window == q.Limit.Window {
				keep := p
				if q.Limit.Events < p.Limit.Events {
					keep = q
				}
				return fmt.Errorf("quotas %s and %s have the same scope and window, so only the smaller ever decides; keep one (%s)", p, q, keep)
			}
		}
	}
	return nil
}

// ParseRules reads rules in the THROTTLE_RULES form: rules separated by ';', each a task
// type followed by one or more space-separated quotas "scope=events/window", where scope
// is "tenant" (a limit for each tenant) or "type" (one limit for the whole type) and
// window is a Go duration, and optionally "cost=header:<name>" (Rule.CostHeader),
// "max-delay=<Go duration>" (Rule.MaxDelay), "overdue=archive|run|drop" (Rule.Overdue)
// and "mode=enforce|shadow" (Rule.Mode):
//
//	api:call tenant=5/2s type=20/1s; email:send tenant=100/1h
//	llm:complete tenant=40000/1m tenant=1000000/24h cost=header:tokens
//	report:build tenant=2/1m max-delay=30m overdue=drop
//	search:index tenant=10/1s mode=shadow
//
// Empty rules (a trailing ';') and extra spaces are ignored; an empty s gives no rules.
// The error names the rule (its 1-based position and text) and the offending part: a rule
// without quotas, a quota without '=', an unknown scope, a limit ParseLimit rejects, two
// quotas at one scope with the same window, an option given twice, or a task type given
// twice.
func ParseRules(s string) ([]Rule, error) {
	var rules []Rule
	seen := map[string]int{}
	for i, text := range strings.Split(s, ";") {
		fields := strings.Fields(text)
		if len(fields) == 0 {
			continue
		}
		where := fmt.Sprintf("rule %d %q", i+1, strings.TrimSpace(text))
		if err := spacedEquals(fields); err != nil {
			return nil, fmt.Errorf("worker: %s: %w", where, err)
		}
		r := Rule{TaskType: fields[0]}
		overdueSet, modeSet := false, false
		if strings.Contains(r.TaskType, "=") {
			return nil, fmt.Errorf("worker: %s: starts with quota %q; want a task type first, e.g. \"api:call tenant=5/2s\"", where, r.TaskType)
		}
		if len(fields) == 1 {
			return nil, fmt.Errorf("worker: %s: task type %q has no quota; want e.g. %q", where, r.TaskType, r.TaskType+" tenant=5/2s")
		}
		for _, f := range fields[1:] {
			if name, ok := strings.CutPrefix(f, "cost="); ok {
				header, ok := strings.CutPrefix(name, "header:")
				if !ok || header == "" || r.CostHeader != "" {
					return nil, fmt.Errorf("worker: %s: %q: want one cost=header:<name>, e.g. cost=header:tokens", where, f)
				}
				r.CostHeader = header
				continue
			}
			if v, ok := strings.CutPrefix(f, "max-delay="); ok {
				d, err := time.ParseDuration(v)
				if err != nil || d <= 0 || r.MaxDelay != 0 {
					return nil, fmt.Errorf("worker: %s: %q: want one max-delay=<positive Go duration>, e.g. max-delay=30m", where, f)
				}
				r.MaxDelay = d
				continue
			}
			if v, ok := strings.CutPrefix(f, "overdue="); ok {
				if overdueSet {
					return nil, fmt.Errorf("worker: %s: %q: overdue= is given twice", where, f)
				}
				overdueSet = true
				switch v {
				case "archive":
					r.Overdue = OverdueArchive
				case "run":
					r.Overdue = OverdueRun
				case "drop":
					r.Overdue = OverdueDrop
				default:
					return nil, fmt.Errorf("worker: %s: %q: want overdue=archive, overdue=run or overdue=drop", where, f)
				}
				continue
			}
			if v, ok := strings.CutPrefix(f, "mode="); ok {
				if modeSet {
					return nil, fmt.Errorf("worker: %s: %q: mode= is given twice", where, f)
				}
				modeSet = true
				switch v {
				case "enforce":
					r.Mode = ModeEnforce
				case "shadow":
					r.Mode = ModeShadow
				default:
					return nil, fmt.Errorf("worker: %s: %q: want mode=enforce or mode=shadow (a dry run)", where, f)
				}
				continue
			}
			q, err := parseQuota(f)
			if err != nil {
				return nil, fmt.Errorf("worker: %s: %w", where, err)
			}
			r.Quotas = append(r.Quotas, q)
		}
		if len(r.Quotas) == 0 {
			return nil, fmt.Errorf("worker: %s: task type %q has no quota; want e.g. %q", where, r.TaskType, r.TaskType+" tenant=5/2s")
		}
		if err := checkWindows(r.Quotas); err != nil {
			return nil, fmt.Errorf("worker: %s: %w", where, err)
		}
		if prev, ok := seen[r.TaskType]; ok {
			return nil, fmt.Errorf("worker: %s: task type %q already has rule %d; put all its quotas in one rule", where, r.TaskType, prev)
		}
		seen[r.TaskType] = i + 1
		rules = append(rules, r)
	}
	return rules, nil
}

// spacedEquals reports '=' with a space beside it: a field that is "=" or begins with it
// ("tenant = 5/1s", "weight =3"), or that ends with it before a field without one
// ("tenant= 5/1s"; a last "cost=" is an empty value, reported as such). The fields would
// otherwise read as a task type and a quota named "=".
func spacedEquals(fields []string) error {
	for i, f := range fields {
		from, to := i, i+1
		switch {
		case f == "=":
			from, to = max(i-1, 0), i+2
		case strings.HasPrefix(f, "="):
			from = max(i-1, 0)
		case strings.HasSuffix(f, "=") && i+1 < len(fields) && !strings.Contains(fields[i+1], "="):
			to = i + 2
		default:
			continue
		}
		return fmt.Errorf("%q: write name=value with no space around '=', e.g. tenant=5/2s or weight=3", strings.Join(fields[from:min(to, len(fields))], " "))
	}
	return nil
}

// parseQuota reads "scope=events/window".
func parseQuota(s string) (throttle.Quota, error) {
	scope, limit, ok := strings.Cut(s, "=")
	if !ok || scope == "" || limit == "" { // "tenant = 5/1s" splits into three fields
		return throttle.Quota{}, fmt.Errorf("quota %q: want scope=events/window, with no space around '=', e.g. tenant=5/2s", s)
	}
	var q throttle.Quota
	switch scope {
	case "tenant":
		q.Scope = throttle.ScopeTenant
	case "type":
		q.Scope = throttle.ScopeType
	case "weight": // valid in tenant limits (ParseTenantLimits), where a trial wrote it into a rule
		return throttle.Quota{}, fmt.Errorf("quota %q: unknown scope %q; want tenant or type (weight= belongs to a tier's "+
			"or a tenant's limits, as in throttle limits set tier pro 'tenant=50/1s weight=3', not to a rule)", s, scope)
	default:
		return throttle.Quota{}, fmt.Errorf("quota %q: unknown scope %q; want tenant or type", s, scope)
	}
	l, err := throttle.ParseLimit(limit)
	if err != nil {
		return throttle.Quota{}, fmt.Errorf("quota %q: %w", s, err)
	}
	q.Limit = l
	return q, nil
}
