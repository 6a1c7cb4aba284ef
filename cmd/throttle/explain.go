package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

var explainCommand = command{
	name:    "explain",
	summary: "would a task of a type and tenant run now; if not, which quota denies it, until when, how many wait ahead",
	run:     runExplain,
}

const explainUsage = `Usage:
  throttle explain -type T -tenant X [-cost N] [-rules R] [-at RFC3339]

explain decides a task of type T for tenant X (of cost N, default 1) as a worker would,
with the rule, tenant quotas and weight the workers give it (the rules from -rules or
THROTTLE_RULES, with the overrides stored by throttle limits), and says whether it would
run now; if not, which quota denies it (or the pause that holds it), when it would get its
slot, and how many reservations are waiting ahead of it on that quota's log.

It consumes nothing. In one MULTI/EXEC it copies (COPY, Redis 6.2 or later) every key the
decision reads (the tenant's and the type's window logs, the pending: and costs: sets
beside each, the type's leases, fair and fairstate) to keys of a scratch prefix,
<THROTTLE_PREFIX>:explain:<random>, that keep the type's {hash tag} (so one slot on a
cluster), decides there with a throttle.Limiter of that prefix, and deletes the scratch
keys (each also expires after a minute, should explain be killed). The workers' keys are
only read, atomically; a decision a worker makes meanwhile is not in the copy.

The decision is the middleware's for a task arriving now: it may take a slot at once, or
reserve the earliest slot where every quota has room (at its fair rank on a type= quota).
A task the rule can never run (cost over a limit) is said so; under mode=shadow it would
run anyway, and explain says what the rule would have done.

Flags:
  -at      decide as of this RFC 3339 instant instead of now (the logs as they are)
  -cost    the task's cost (its cost= header), default 1
  -json    print JSON on stdout
  -rules   the workers' default rules, instead of THROTTLE_RULES
  -tenant  the tenant ('' is the tenant of untagged tasks); required
  -type    the task type; required
`

// workersClaimTimeout is worker.Config.ClaimTimeout's default, WakeLead + 2s: how long
// after its instant the workers let a reservation be claimed before it lapses. A decision
// lapses those past it, so explain decides with the same.
const workersClaimTimeout = worker.DefaultWakeLead + 2*time.Second

// explainJSON is what explain prints with -json.
type explainJSON struct {
	TaskType string    `json:"task_type"`
	Tenant   string    `json:"tenant"`
	Cost     int       `json:"cost"`
	At       time.Time `json:"at"` // the instant asked about
	// Throttled is false when the type has no rule: the task runs at once.
	Throttled  bool   `json:"throttled"`
	Rule       string `json:"rule,omitempty"` // the rule with the tenant's quotas
	Mode       string `json:"mode,omitempty"`
	RuleFrom   string `json:"rule_from,omitempty"`
	QuotasFrom string `json:"quotas_from,omitempty"`
	Weight     int    `json:"weight,omitempty"`
	// Allowed: it would run now. RunsAnyway: denied, but the rule is mode=shadow.
	Allowed    bool `json:"allowed"`
	RunsAnyway bool `json:"runs_anyway,omitempty"`
	// Never: its cost exceeds a limit, Quota's (Limit: its limit); the worker archives it.
	Never bool `json:"never,omitempty"`
	// Quota decided: the one that denies it, or, allowed, the one with the fewest slots
	// left. Used is its slots used in its window ending at DecidedAt (after the task, if
	// allowed), Limit its limit.
	Quota     string     `json:"quota,omitempty"`
	Used      int        `json:"used"`
	Limit     int        `json:"limit"`
	DecidedAt *time.Time `json:"decided_at,omitempty"`
	Paused    bool       `json:"paused"` // denied by a pause of Quota's log
	// RetryAfterMS is the wait from At until its slot (or the pause's end), RetryAt that
	// instant; Reserved that the slot would be held for it.
	RetryAfterMS int64      `json:"retry_after_ms"`
	RetryAt      *time.Time `json:"retry_at,omitempty"`
	Reserved     bool       `json:"reserved"`
	// WaitingAhead is the reservations on Quota's log whose slots come before its own.
	WaitingAhead int64 `json:"waiting_ahead"`
}

func runExplain(e *env, args []string) int {
	fs := e.flags("explain")
	var tf targetFlags
	tf.register(fs)
	var rules optString
	var at timeFlag
	fs.Var(&rules, "rules", "")
	fs.Var(&at, "at", "")
	cost := fs.Int("cost", 1, "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, explainUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "explain: %v\nRun 'throttle explain -h' for usage.", err)
	}
	if err := tf.check(); err != nil {
		return e.fail(exitUsage, "explain: %v", err)
	}
	switch {
	case len(pos) > 0:
		return e.fail(exitUsage, "explain: unexpected argument %q", pos[0])
	case !tf.taskType.set || tf.taskType.v == "":
		return e.fail(exitUsage, "explain: -type is required")
	case !tf.tenant.set:
		return e.fail(exitUsage, "explain: -tenant is required ('' for untagged tasks)")
	case *cost < 1:
		return e.fail(exitUsage, "explain: -cost %d: want at least 1", *cost)
	}
	now := ms(at.instant())
	key := throttle.Key{TaskType: tf.taskType.v, Tenant: tf.tenant.v}
	rs, code := e.rules(rules)
	if code != exitOK {
		return code
	}
	j := explainJSON{TaskType: key.TaskType, Tenant: key.Tenant, Cost: *cost, At: now}
	eff, ok := rs.effective(key)
	switch {
	case !ok && !rs.ruleKnown(key.TaskType):
		return e.fail(exitUsage, "explain: %s", unknownRules(key.TaskType))
	case !ok:
		j.Allowed = true
		return printExplain(e, j)
	}
	j.Throttled, j.Rule, j.Mode, j.RuleFrom, j.QuotasFrom = true, eff.Rule.String(), eff.Rule.Mode.String(), eff.RuleFrom, eff.QuotasFrom
	j.Weight = max(eff.Weight, 1)
	lim, code := e.limiter()
	if lim == nil {
		return code
	}
	req := throttle.Request{Key: key, Quotas: eff.Rule.Quotas, Cost: *cost, Weight: eff.Weight}
	if eff.Rule.Mode == worker.ModeEnforce { // a shadow rule's task is decided with no reservation
		req.Reservation = "explain:" + throttle.NewMember()
		req.ClaimTimeout = workersClaimTimeout
	}
	d, ahead, err := explainDecide(e, lim, req, now)
	switch {
	case errors.Is(err, throttle.ErrCostOverLimit):
		j.Never = true
		for _, q := range req.Quotas { // the first whose limit the cost exceeds (the Limiter's own check), as Quota and Limit
			if q.Limit.Events < max(req.Cost, 1) {
				j.Quota, j.Limit = q.String(), q.Limit.Events
				break
			}
		}
		return printExplain(e, j)
	case errors.Is(err, throttle.ErrInvalid): // sent nothing: -at outside 1970-2109, say
		return e.fail(exitUsage, "explain: %v", err)
	case err != nil:
		return e.fail(exitRedis, "explain: %v", err)
	}
	at2 := ms(d.At)
	j.Allowed, j.Quota, j.Used, j.Limit, j.DecidedAt, j.Paused = d.Allowed, d.Quota.String(), d.Count, d.Quota.Limit.Events, &at2, d.Paused
	if !d.Allowed {
		j.RunsAnyway = eff.Rule.Mode == worker.ModeShadow
		j.RetryAfterMS = d.RetryAfter.Milliseconds()
		r := ms(d.RetryAt())
		j.RetryAt, j.Reserved, j.WaitingAhead = &r, d.Reserved, ahead
	}
	return printExplain(e, j)
}

// explainDecide decides req at now on a copy of its keys under a scratch prefix, and
// returns the decision and, if it reserved a slot, the reservations ahead of it on the
// deciding quota's log. The scratch keys are deleted before it returns.
func explainDecide(e *env, lim *throttle.Limiter, req throttle.Request, now time.Time) (throttle.Decision, int64, error) {
	scratchPrefix := e.vars.Prefix + ":explain:" + throttle.NewMember()
	scratch, err := throttle.New(e.rdb, throttle.Config{Prefix: scratchPrefix})
	if err != nil {
		return throttle.Decision{}, 0, err
	}
	src := namesOf(lim, req.Key.TaskType).decisionKeys(lim, req.Key)
	dst := namesOf(scratch, req.Key.TaskType).decisionKeys(scratch, req.Key)
	defer func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(e.ctx), 5*time.Second)
		defer cancel()
		if err := e.rdb.Del(ctx, dst...).Err(); err != nil {
			fmt.Fprintf(e.stderr, "throttle: explain: could not delete the scratch keys %s:{...}: %v; they expire within a minute\n", scratchPrefix, err)
		}
	}()
	if _, err := e.rdb.TxPipelined(e.ctx, func(p redis.Pipeliner) error {
		for i := range src {
			p.Do(e.ctx, "COPY", src[i], dst[i], "REPLACE") // within the connection's database (go-redis's Copy names one)
			p.PExpire(e.ctx, dst[i], time.Minute)
		}
		return nil
	}); err != nil {
		if strings.Contains(err.Error(), "unknown command") {
			err = fmt.Errorf("%w (explain needs COPY: Redis 6.2 or later)", err)
		}
		return throttle.Decision{}, 0, fmt.Errorf("copy the keys to a scratch prefix: %w", err)
	}
	d, err := scratch.AllowAt(e.ctx, req, now)
	if err != nil || !d.Reserved {
		return d, 0, err
	}
	// The reservation is an entry "<cost>:<token>" of the pending: set beside the log,
	// scored at its instant; those at or before it, but its own, are ahead of it.
	names := namesOf(scratch, req.Key.TaskType)
	pending := names.pending(names.part(scratch, req.Key, d.Quota.Scope))
	until := d.RetryAt().UnixMilli()
	n, err := e.rdb.ZCount(e.ctx, pending, "-inf", fmt.Sprint(until)).Result()
	if err != nil {
		return d, 0, err
	}
	if _, err := e.rdb.ZScore(e.ctx, pending, fmt.Sprintf("%d:%s", max(req.Cost, 1), req.Reservation)).Result(); err == nil {
		n--
	}
	return d, max(n, 0), nil
}

// printExplain prints j, for people or as JSON.
func printExplain(e *env, j explainJSON) int {
	if e.json {
		return e.printJSON(j)
	}
	w := e.stdout
	fmt.Fprintf(w, "%s for tenant %q, cost %d, at %s: ", display(j.TaskType), j.Tenant, j.Cost, fmtTime(j.At))
	switch {
	case !j.Throttled:
		fmt.Fprintln(w, "would run now: the task type has no rule (not throttled)")
		return exitOK
	case j.Never:
		fmt.Fprintf(w, "would never run: cost %d exceeds the limit of %s; the worker archives it\n", j.Cost, j.Quota)
	case j.Allowed:
		fmt.Fprintf(w, "would run now\n  tightest quota: %s, %d of %d used after it\n", j.Quota, j.Used, j.Limit)
	default:
		verdict := "would not run now"
		if j.RunsAnyway {
			verdict = "would run anyway (mode=shadow); enforced, it would not run now"
		}
		fmt.Fprintln(w, verdict)
		if j.Paused {
			fmt.Fprintf(w, "  paused: its %s log is paused until %s (retry after %s): throttle pause, or an upstream 429 or 503\n",
				strings.SplitN(j.Quota, "=", 2)[0], fmtTime(*j.RetryAt), time.Duration(j.RetryAfterMS)*time.Millisecond)
		} else {
			fmt.Fprintf(w, "  denied by %s: %d of %d used in its window\n", j.Quota, j.Used, j.Limit)
			slot := "it would have room"
			if j.Reserved {
				slot = "it would get its slot"
			}
			fmt.Fprintf(w, "  %s at %s (retry after %s), with %s waiting ahead of it\n", slot, fmtTime(*j.RetryAt),
				time.Duration(j.RetryAfterMS)*time.Millisecond, count(int(j.WaitingAhead), "reservation"))
		}
	}
	fmt.Fprintf(w, "  rule: %s (%s; tenant quotas from %s; weight %d)\n", j.Rule, j.RuleFrom, j.QuotasFrom, j.Weight)
	fmt.Fprintln(w, "explain decided on a scratch copy of the keys: it consumed nothing")
	return exitOK
}
