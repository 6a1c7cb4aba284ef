package main

import (
	"errors"
	"flag"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

var inspectCommand = command{
	name:    "inspect",
	summary: "every throttle key, or a type's or a tenant's: used/limit per quota, oldest and newest entry, reservations, next slot, pause",
	run:     runInspect,
}

const inspectUsage = `Usage:
  throttle inspect [-type T] [-tenant X] [-rules R] [-at RFC3339]

inspect reads the workers' keys in Redis (<THROTTLE_PREFIX>:{<task type>}:..., listed with
SCAN, on every master of a cluster) and prints, for each window log (a tenant's of a task
type, or a task type's own):

  ENTRIES       the log's entries: admissions and reservations, past and ahead, one per event
  QUOTA, USED   each quota of the rule on that log, and the slots used in its window ending
                now (the entries of the window, each counted by its cost): used/limit
  NEXT SLOT     the window's next free slot, reservations aside: now if a slot is free, else
                when the window's oldest entry leaves it; never before the end of a pause in
                force. Tasks holding reservations (RESERVATIONS) take slots first: for when a
                new task would run, ask throttle explain
  OLDEST/NEWEST the first and last entries and their kind (a reservation may lie ahead)
  RESERVATIONS  the reservations held by tasks waiting for a slot (throttle.Limiter.Reservations):
                the tenant's on its log, all of the type's on the type's log
  PAUSED UNTIL  the pause of the log, if any (throttle pause, or an upstream 429)

The quotas come from the workers' rules: THROTTLE_RULES (or -rules) with the overrides
stored by throttle limits, as the workers merge them; without them, only the entries are
shown. With -type, the logs of that type; with -tenant, that tenant's logs; with both, the
tenant's log of the type and the type's own log. Other keys of a type (leases, fair,
fairstate, lock:sweep) are listed below its logs. Enqueue-side quotas
(<prefix>:enqueue:{<type>}:...) are not shown, and their prefix is refused: README.md,
"Enqueue-side quota", says how to read them with redis-cli.

Flags:
  -at      inspect as of this RFC 3339 instant instead of now (the logs as they are)
  -json    print JSON on stdout
  -rules   the workers' default rules, instead of THROTTLE_RULES
  -tenant  only this tenant's logs ('' is the tenant of untagged tasks)
  -type    only this task type's logs
`

// inspectJSON is what inspect prints with -json.
type inspectJSON struct {
	Prefix string    `json:"prefix"`
	At     time.Time `json:"at"`
	// Defaults says whether the workers' default rules were given (-rules,
	// THROTTLE_RULES): without them only types with a type override have quotas.
	Defaults         bool       `json:"defaults"`
	OverridesVersion int64      `json:"overrides_version"`
	Types            []typeJSON `json:"types"`
}

// typeJSON is one task type's keys.
type typeJSON struct {
	TaskType string `json:"task_type"`
	Rule     string `json:"rule,omitempty"` // the type's own rule; absent if unknown
	RuleFrom string `json:"rule_from,omitempty"`
	// Reservations are those held on the type's logs, by every tenant.
	Reservations int       `json:"reservations"`
	Logs         []logJSON `json:"logs"`
	OtherKeys    []string  `json:"other_keys"`
}

// logJSON is one window log.
type logJSON struct {
	Key          string      `json:"key"`
	Scope        string      `json:"scope"`
	Tenant       *string     `json:"tenant,omitempty"` // absent for the type's log
	Entries      int64       `json:"entries"`
	Oldest       *entryJSON  `json:"oldest,omitempty"`
	Newest       *entryJSON  `json:"newest,omitempty"`
	QuotasFrom   string      `json:"quotas_from,omitempty"` // where the quotas come from; absent if unknown
	Quotas       []quotaJSON `json:"quotas"`
	Reservations int         `json:"reservations"`
	PausedUntil  *time.Time  `json:"paused_until,omitempty"`
	PauseInForce bool        `json:"pause_in_force"`
}

type entryJSON struct {
	At   time.Time `json:"at"`
	Kind string    `json:"kind"` // admission, reservation or released
	Cost int       `json:"cost"`
}

type quotaJSON struct {
	Quota    string `json:"quota"`
	Limit    int    `json:"limit"`
	WindowMS int64  `json:"window_ms"`
	Used     int64  `json:"used"` // slots used in the window ending at At
	// NextSlotAt is the window's next free slot, reservations aside: At if a slot is
	// free, else when the oldest entry of the window leaves it; and never before the end of
	// the log's pause in force. Tasks already holding reservations on the log come first
	// (throttle explain counts them).
	NextSlotAt time.Time `json:"next_slot_at"`
}

func runInspect(e *env, args []string) int {
	fs := e.flags("inspect")
	var tf targetFlags
	tf.register(fs)
	var rules optString
	var at timeFlag
	fs.Var(&rules, "rules", "")
	fs.Var(&at, "at", "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, inspectUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "inspect: %v\nRun 'throttle inspect -h' for usage.", err)
	}
	if err := tf.check(); err != nil {
		return e.fail(exitUsage, "inspect: %v", err)
	}
	if len(pos) > 0 {
		return e.fail(exitUsage, "inspect: unexpected argument %q; use -type and -tenant", pos[0])
	}
	if tf.taskType.set && tf.taskType.v == "" {
		return e.fail(exitUsage, "inspect: -type is empty")
	}
	now := ms(at.instant())
	rs, code := e.rules(rules)
	if code != exitOK {
		return code
	}
	lim, code := e.limiter()
	if lim == nil {
		return code
	}
	keys, err := inspectKeys(e, lim, tf)
	if err != nil {
		return e.fail(exitRedis, "inspect: %v", err)
	}
	j := inspectJSON{Prefix: e.vars.Prefix, At: now, Defaults: rs.known, OverridesVersion: rs.o.Version, Types: []typeJSON{}}
	byType := map[string][]parsedKey{}
	for _, k := range keys {
		byType[k.taskType] = append(byType[k.taskType], k)
	}
	for _, tt := range sortedKeys(byType) {
		t, err := inspectType(e, lim, rs, tt, byType[tt], now)
		if err != nil {
			return e.fail(exitRedis, "inspect %s: %v", display(tt), err)
		}
		j.Types = append(j.Types, t)
	}
	if e.json {
		return e.printJSON(j)
	}
	printInspect(e, j, tf)
	return exitOK
}

// inspectKeys lists the keys the flags select, parsed.
func inspectKeys(e *env, lim *throttle.Limiter, tf targetFlags) ([]parsedKey, error) {
	prefix := e.vars.Prefix
	var raw []string
	var err error
	switch {
	case tf.taskType.set && tf.tenant.set:
		key := throttle.Key{TaskType: tf.taskType.v, Tenant: tf.tenant.v}
		for _, k := range []string{lim.RedisKey(key, throttle.ScopeType), lim.RedisKey(key, throttle.ScopeTenant)} {
			var c int64
			if c, err = e.rdb.Exists(e.ctx, k).Result(); err != nil {
				return nil, err
			}
			if c == 1 {
				raw = append(raw, k)
			}
		}
	case tf.taskType.set:
		err = scanKeys(e.ctx, e.rdb, globEscape(namesOf(lim, tf.taskType.v).base)+"*", func(k string) { raw = append(raw, k) })
	case tf.tenant.set:
		esc := strings.TrimPrefix(lim.RedisKey(throttle.Key{TaskType: "x", Tenant: tf.tenant.v}, throttle.ScopeTenant), namesOf(lim, "x").base)
		err = scanKeys(e.ctx, e.rdb, globEscape(prefix)+":{*}:"+globEscape(esc), func(k string) { raw = append(raw, k) })
	default:
		err = scanKeys(e.ctx, e.rdb, globEscape(prefix)+":{*", func(k string) { raw = append(raw, k) })
	}
	if err != nil {
		return nil, err
	}
	var out []parsedKey
	for _, k := range raw {
		p, ok := parseKey(prefix, k)
		if !ok || tf.tenant.set && !tf.taskType.set && (p.scope != throttle.ScopeTenant || p.tenant != tf.tenant.v) {
			continue
		}
		out = append(out, p)
	}
	return out, nil
}

// inspectType reads the logs of taskType among keys.
func inspectType(e *env, lim *throttle.Limiter, rs ruleSet, taskType string, keys []parsedKey, now time.Time) (typeJSON, error) {
	t := typeJSON{TaskType: taskType, Logs: []logJSON{}, OtherKeys: []string{}}
	if eff, ok := rs.typeRule(taskType); ok {
		t.Rule, t.RuleFrom = eff.Rule.String(), eff.RuleFrom
	}
	by, total, err := reservationsByTenant(e.ctx, lim, taskType)
	if err != nil {
		return t, err
	}
	t.Reservations = total
	names := namesOf(lim, taskType)
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if (a.scope == throttle.ScopeType) != (b.scope == throttle.ScopeType) {
			return a.scope == throttle.ScopeType // the type's log first
		}
		return a.key < b.key
	})
	for _, k := range keys {
		if k.scope == 0 {
			t.OtherKeys = append(t.OtherKeys, k.key)
			continue
		}
		key := throttle.Key{TaskType: taskType, Tenant: k.tenant}
		l := logJSON{Key: k.key, Scope: k.scope.String(), Tenant: tenantPtr(key, k.scope), Quotas: []quotaJSON{}}
		if l.Entries, err = e.rdb.ZCount(e.ctx, k.key, "("+floorScore, "+inf").Result(); err != nil {
			return t, err
		}
		oldest, newest, err := oldestNewest(e.ctx, e.rdb, k.key)
		if err != nil {
			return t, err
		}
		if oldest != nil {
			l.Oldest = &entryJSON{At: oldest.at, Kind: oldest.kind, Cost: oldest.cost}
			l.Newest = &entryJSON{At: newest.at, Kind: newest.kind, Cost: newest.cost}
		}
		var quotas []throttle.Quota
		if k.scope == throttle.ScopeTenant {
			if eff, ok := rs.effective(key); ok {
				quotas, l.QuotasFrom = quotasAt(eff.Rule.Quotas, throttle.ScopeTenant), eff.QuotasFrom
			}
			l.Reservations = by[k.tenant]
		} else {
			if eff, ok := rs.typeRule(taskType); ok {
				quotas, l.QuotasFrom = quotasAt(eff.Rule.Quotas, throttle.ScopeType), eff.RuleFrom
			}
			l.Reservations = total
		}
		until, ok, err := lim.PausedUntil(e.ctx, key, k.scope)
		if err != nil {
			return t, err
		}
		if ok {
			u := ms(until)
			l.PausedUntil, l.PauseInForce = &u, u.After(now)
		}
		for _, q := range quotas {
			w := q.Limit.Window.Milliseconds()
			a, b := now.UnixMilli()-w, now.UnixMilli()
			used, err := slotsIn(e.ctx, e.rdb, k.key, names.costs(k.part), a, b)
			if err != nil {
				return t, err
			}
			qj := quotaJSON{Quota: q.String(), Limit: q.Limit.Events, WindowMS: w, Used: used, NextSlotAt: now}
			if used >= int64(q.Limit.Events) {
				first, err := firstAfter(e.ctx, e.rdb, k.key, a)
				if err != nil {
					return t, err
				}
				if first != nil {
					qj.NextSlotAt = first.at.Add(q.Limit.Window)
				}
			}
			if l.PauseInForce && l.PausedUntil.After(qj.NextSlotAt) {
				qj.NextSlotAt = *l.PausedUntil // the limiter denies everything on the log until then
			}
			l.Quotas = append(l.Quotas, qj)
		}
		t.Logs = append(t.Logs, l)
	}
	return t, nil
}

// printInspect prints j for people.
func printInspect(e *env, j inspectJSON, tf targetFlags) {
	fmt.Fprintf(e.stdout, "throttle keys (prefix %s) at %s, overrides version %d\n", j.Prefix, fmtTime(j.At), j.OverridesVersion)
	if !j.Defaults {
		fmt.Fprintln(e.stdout, "(THROTTLE_RULES is unset here: only task types with a type override show their quotas; give -rules)")
	}
	if len(j.Types) == 0 {
		what := "no key"
		switch {
		case tf.taskType.set && tf.tenant.set:
			what = fmt.Sprintf("no log of %s for tenant %q", display(tf.taskType.v), tf.tenant.v)
		case tf.taskType.set:
			what = "no key of task type " + display(tf.taskType.v)
		case tf.tenant.set:
			what = fmt.Sprintf("no log of tenant %q", tf.tenant.v)
		}
		fmt.Fprintf(e.stdout, "  (%s)\n", what)
		return
	}
	for _, t := range j.Types {
		rule := "no rule known"
		if t.Rule != "" {
			rule = "rule " + t.Rule + " (" + t.RuleFrom + ")"
		}
		fmt.Fprintf(e.stdout, "\n%s: %s; %s waiting\n", display(t.TaskType), rule, count(t.Reservations, "reservation"))
		if len(t.Logs) > 0 {
			tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "  LOG\tENTRIES\tOLDEST\tNEWEST\tRESERVATIONS\tPAUSED UNTIL\tQUOTA\tUSED\tNEXT SLOT")
			for _, l := range t.Logs {
				name := "type"
				if l.Tenant != nil {
					name = "tenant " + strconv.Quote(*l.Tenant)
				}
				pause := "-"
				if l.PausedUntil != nil {
					pause = fmtTime(*l.PausedUntil)
					if !l.PauseInForce {
						pause += " (over)"
					}
				}
				oldest, newest := "-", "-"
				if l.Oldest != nil {
					oldest = fmtTime(l.Oldest.At) + " " + l.Oldest.Kind
					newest = fmtTime(l.Newest.At) + " " + l.Newest.Kind
				}
				head := fmt.Sprintf("  %s\t%d\t%s\t%s\t%d\t%s", name, l.Entries, oldest, newest, l.Reservations, pause)
				if len(l.Quotas) == 0 {
					quota := "? (no rule known)"
					if l.QuotasFrom != "" {
						quota = "(none at this scope)"
					}
					fmt.Fprintf(tw, "%s\t%s\t-\t-\n", head, quota)
				}
				for i, q := range l.Quotas {
					next := "now"
					if q.NextSlotAt.After(j.At) {
						next = fmtTime(q.NextSlotAt)
					}
					if i > 0 {
						head = "  \t\t\t\t\t"
					}
					fmt.Fprintf(tw, "%s\t%s\t%d/%d\t%s\n", head, q.Quota, q.Used, q.Limit, next)
				}
			}
			_ = tw.Flush()
		}
		if len(t.OtherKeys) > 0 {
			fmt.Fprintf(e.stdout, "  other keys: %s\n", strings.Join(t.OtherKeys, ", "))
		}
	}
}
