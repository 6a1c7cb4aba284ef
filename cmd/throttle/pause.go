package main

import (
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

var pauseCommand = command{
	name:    "pause",
	summary: "stop every task of a tenant (or of a task type) on every worker until an instant",
	run:     runPause,
}

var resumeCommand = command{
	name:    "resume",
	summary: "lift a pause",
	run:     runResume,
}

const pauseUsage = `Usage:
  throttle pause -type T [-tenant X] (-for D | -until RFC3339) [-rules R]
  throttle resume -type T [-tenant X]

pause does by hand what a handler's worker.Backpressure does when the API it calls
answers 429 or 503: every worker denies the tasks decided on the paused window log until
the pause's end (throttle.Limiter.Pause), and re-queues them for then, or for a minute
later if that is sooner (worker.PauseRecheck), without counting a failure or spending a
retry. With -tenant it pauses that tenant's log of task type T;
without, T's own log (every tenant). A pause never shortens one in force: the later end
stays, and pause prints it. resume lifts it at once (throttle.Limiter.Resume); the
tasks the pause denied come back within a minute. A task whose own 429 made the pause
(worker.Backpressure) is not one of them: it waits for its Retry-After (at most 1h).

A task is decided only on the logs of its rule's quotas: a tenant pause does nothing if
T's rule has no tenant= quota, a type pause nothing if it has no type= quota, and
neither under a mode=shadow rule (its tasks run anyway). When the
rule is known (-rules, THROTTLE_RULES, or a type override stored by throttle limits),
pause refuses such a pause (exit 3); when it is not, it says it could not check.

Flags:
  -for     how long, a Go duration from now (30s, 5m)
  -json    print JSON on stdout
  -rules   the workers' default rules, instead of THROTTLE_RULES
  -tenant  the tenant to pause ('' is the tenant of untagged tasks); none: the task type
  -type    the task type
  -until   the pause's end, an RFC 3339 instant (2026-12-01T12:00:00Z)
`

// pauseJSON is what pause prints with -json.
type pauseJSON struct {
	Key      string    `json:"key"`
	TaskType string    `json:"task_type"`
	Tenant   *string   `json:"tenant,omitempty"` // absent: the type's log
	Scope    string    `json:"scope"`
	Until    time.Time `json:"until"`        // the end asked for
	InForce  time.Time `json:"paused_until"` // the end in force: Until, or a later one already there
}

func runPause(e *env, args []string) int {
	fs := e.flags("pause")
	var tf targetFlags
	tf.register(fs)
	var rules optString
	var until timeFlag
	var d time.Duration
	fs.Var(&rules, "rules", "")
	fs.Var(&until, "until", "")
	fs.Var((*durationFlag)(&d), "for", "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, pauseUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "pause: %v\nRun 'throttle pause -h' for usage.", err)
	}
	if err := tf.check(); err != nil {
		return e.fail(exitUsage, "pause: %v", err)
	}
	forSet := false
	fs.Visit(func(f *flag.Flag) { forSet = forSet || f.Name == "for" })
	now := time.Now()
	switch {
	case len(pos) > 0:
		return e.fail(exitUsage, "pause: unexpected argument %q", pos[0])
	case !tf.taskType.set || tf.taskType.v == "":
		return e.fail(exitUsage, "pause: -type is required")
	case forSet == until.set:
		return e.fail(exitUsage, "pause: give one of -for and -until")
	case forSet && d <= 0:
		return e.fail(exitUsage, "pause: -for %s: want a positive duration", d)
	case until.set && !until.t.After(now):
		return e.fail(exitUsage, "pause: -until %s is not in the future", until.t.Format(time.RFC3339Nano))
	}
	end := until.t
	if forSet {
		end = now.Add(d)
	}
	key, scope := tf.key()
	rs, code := e.rules(rules)
	if code != exitOK {
		return code
	}
	if msg := pauseEffect(rs, key, scope); msg != "" {
		return e.fail(exitRejected, "pause: %s", msg)
	}
	if !rs.ruleKnown(key.TaskType) {
		fmt.Fprintf(e.stderr, "throttle: pause: note: %s; so this pause could not be checked against it\n", unknownRules(key.TaskType))
	}
	lim, code := e.limiter()
	if lim == nil {
		return code
	}
	if err := lim.Pause(e.ctx, key, scope, end); errors.Is(err, throttle.ErrInvalid) { // an end outside 1970-2109
		return e.fail(exitUsage, "pause: %v", err)
	} else if err != nil {
		return e.fail(exitRedis, "pause: %v", err)
	}
	inForce, _, err := lim.PausedUntil(e.ctx, key, scope)
	if err != nil {
		return e.fail(exitRedis, "pause: %v", err)
	}
	j := pauseJSON{Key: lim.RedisKey(key, scope), TaskType: key.TaskType, Tenant: tenantPtr(key, scope), Scope: scope.String(),
		Until: ms(end), InForce: ms(inForce)}
	if e.json {
		return e.printJSON(j)
	}
	fmt.Fprintf(e.stdout, "paused %s until %s (%s from now)\n", what(key, scope), fmtTime(j.InForce), j.InForce.Sub(now).Round(time.Millisecond))
	if j.InForce.After(j.Until) {
		fmt.Fprintf(e.stdout, "a pause until %s was already in force: the later end stays\n", fmtTime(j.InForce))
	}
	fmt.Fprintln(e.stdout, "every worker denies its tasks until then, re-queueing them for then or a minute later, whichever is sooner; 'throttle resume' lifts it")
	return exitOK
}

// pauseEffect returns why a pause of key's log at scope would do nothing under the known
// rules, or "" if it would do something or the rule is unknown.
func pauseEffect(rs ruleSet, key throttle.Key, scope throttle.Scope) string {
	if !rs.ruleKnown(key.TaskType) {
		return ""
	}
	eff, ok := rs.effective(key)
	if scope == throttle.ScopeType {
		eff, ok = rs.typeRule(key.TaskType)
	}
	if !ok {
		return fmt.Sprintf("task type %s has no rule: its tasks are not throttled, so a pause would do nothing", display(key.TaskType))
	}
	if eff.Rule.Mode == worker.ModeShadow { // the middleware runs a denied task anyway
		return fmt.Sprintf("the rule %q (%s) is a dry run: its tasks run whatever the limiter decides, so the pause would do nothing; set mode=enforce to pause them",
			eff.Rule.String(), eff.RuleFrom)
	}
	if len(quotasAt(eff.Rule.Quotas, scope)) > 0 {
		return ""
	}
	if scope == throttle.ScopeTenant {
		return fmt.Sprintf("the rule %q (%s) has no tenant= quota for tenant %q: its tasks are not decided on the tenant's log, so the pause would do nothing; pause the task type (no -tenant) instead",
			eff.Rule.String(), eff.RuleFrom, key.Tenant)
	}
	return fmt.Sprintf("the rule %q (%s) has no type= quota: its tasks are not decided on the type's log, so the pause would do nothing; pause each tenant with -tenant instead",
		eff.Rule.String(), eff.RuleFrom)
}

// resumeJSON is what resume prints with -json.
type resumeJSON struct {
	Key      string     `json:"key"`
	TaskType string     `json:"task_type"`
	Tenant   *string    `json:"tenant,omitempty"`
	Scope    string     `json:"scope"`
	Resumed  bool       `json:"resumed"`             // there was a pause (in force or over) and it was lifted
	WasUntil *time.Time `json:"was_until,omitempty"` // its end
}

func runResume(e *env, args []string) int {
	fs := e.flags("resume")
	var tf targetFlags
	tf.register(fs)
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, pauseUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "resume: %v\nRun 'throttle resume -h' for usage.", err)
	}
	if err := tf.check(); err != nil {
		return e.fail(exitUsage, "resume: %v", err)
	}
	switch {
	case len(pos) > 0:
		return e.fail(exitUsage, "resume: unexpected argument %q", pos[0])
	case !tf.taskType.set || tf.taskType.v == "":
		return e.fail(exitUsage, "resume: -type is required")
	}
	key, scope := tf.key()
	lim, code := e.limiter()
	if lim == nil {
		return code
	}
	was, had, err := lim.PausedUntil(e.ctx, key, scope)
	if err != nil {
		return e.fail(exitRedis, "resume: %v", err)
	}
	resumed, err := lim.Resume(e.ctx, key, scope)
	if err != nil {
		return e.fail(exitRedis, "resume: %v", err)
	}
	j := resumeJSON{Key: lim.RedisKey(key, scope), TaskType: key.TaskType, Tenant: tenantPtr(key, scope), Scope: scope.String(), Resumed: resumed}
	if had && resumed {
		w := ms(was)
		j.WasUntil = &w
	}
	if !resumed {
		return e.fail(exitNotFound, "resume: %s is not paused", what(key, scope))
	}
	if e.json {
		return e.printJSON(j)
	}
	state := "in force"
	if j.WasUntil != nil && !j.WasUntil.After(time.Now()) {
		state = "already over"
	}
	until := ""
	if j.WasUntil != nil {
		until = " until " + fmtTime(*j.WasUntil) + " (" + state + ")"
	}
	fmt.Fprintf(e.stdout, "resumed %s: the pause%s is lifted; workers decide its tasks by their quotas again (the tasks it denied come back within a minute; a task that got a 429 waits for its Retry-After)\n", what(key, scope), until)
	return exitOK
}
