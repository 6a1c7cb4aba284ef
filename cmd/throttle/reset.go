package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"sort"
	"strings"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

var resetCommand = command{
	name:    "reset",
	summary: "clear a tenant's window log of a task type, or every key of a task type (asks first)",
	run:     runReset,
}

const resetUsage = `Usage:
  throttle reset -type T -tenant X [-wake] [-yes]    X's window log of T, with its pending: and costs: sets
  throttle reset -type T [-wake] [-yes]              every key of T: all its logs, leases, fair queue, locks

reset forgets what the throttle counted, so the tasks decided next find room: use it
after a quota was set far too low, or to start a test over. With -tenant it first
releases the tenant's reservations of T (throttle.Limiter.Release, so that the type's log
and the leases stay consistent), then deletes the tenant's log and the two sets beside
it; a pause of that log goes with it. Without -tenant it deletes every key of T
("<prefix>:{T}:*"). Tasks waiting for a reservation that was deleted are decided afresh
when they come back, at the instants asynq holds for them: after a quota was raised, a
rule made mode=shadow or deleted, they still come back one window's worth at a time.
With -wake, reset then moves them back to their queues at once (asynq's Inspector,
RunTask): every task of T (of tenant X, by THROTTLE_TENANT_HEADER, with -tenant) in the
retry state whose last error is a throttle denial or pause, and every deferred copy
("<id>:deferred:<n>", scheduled) of T; they are decided afresh under the rules in force.
A task that got an upstream 429 itself (worker.Backpressure) keeps its Retry-After. It
lists what it will delete and asks for confirmation on stdin (y or yes), unless -yes.

What it forgets includes the window's admissions, those made for a slot up to MaxWait
(2s) ahead too, whose tasks wait in their handlers and still start then: until MaxWait
plus one window after a reset, a window can hold up to twice the limit (those admitted
before it, and a full window after it), so an upstream API with the same limit may
answer 429 once.

Flags:
  -json    print JSON on stdout
  -tenant  the tenant whose log to clear ('' is the tenant of untagged tasks)
  -type    the task type
  -wake    then run T's tasks that wait for the throttle now (see above)
  -yes     do not ask
`

// resetJSON is what reset prints with -json.
type resetJSON struct {
	TaskType string   `json:"task_type"`
	Tenant   *string  `json:"tenant,omitempty"` // absent: every key of the type
	Deleted  []string `json:"deleted"`
	Released int      `json:"released"`        // reservations released first (with -tenant)
	Woken    *int     `json:"woken,omitempty"` // with -wake: tasks moved back to their queues
}

func runReset(e *env, args []string) int {
	fs := e.flags("reset")
	var tf targetFlags
	tf.register(fs)
	yes := fs.Bool("yes", false, "")
	wake := fs.Bool("wake", false, "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, resetUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "reset: %v\nRun 'throttle reset -h' for usage.", err)
	}
	if err := tf.check(); err != nil {
		return e.fail(exitUsage, "reset: %v", err)
	}
	switch {
	case len(pos) > 0:
		return e.fail(exitUsage, "reset: unexpected argument %q", pos[0])
	case !tf.taskType.set || tf.taskType.v == "":
		return e.fail(exitUsage, "reset: -type is required")
	}
	key, scope := tf.key()
	lim, code := e.limiter()
	if lim == nil {
		return code
	}
	rdb := e.rdb
	names := namesOf(lim, key.TaskType)
	var keys, tokens []string
	if scope == throttle.ScopeTenant {
		part := names.part(lim, key, throttle.ScopeTenant)
		for _, k := range []string{names.log(part), names.pending(part), names.costs(part)} {
			n, err := rdb.Exists(e.ctx, k).Result()
			if err != nil {
				return e.fail(exitRedis, "reset: %v", err)
			}
			if n == 1 {
				keys = append(keys, k)
			}
		}
		err = lim.Reservations(e.ctx, key.TaskType, func(r throttle.Reservation) bool {
			if r.Key.Tenant == key.Tenant {
				tokens = append(tokens, r.Token)
			}
			return true
		})
	} else {
		err = scanKeys(e.ctx, rdb, globEscape(names.base)+"*", func(k string) { keys = append(keys, k) })
	}
	if err != nil {
		return e.fail(exitRedis, "reset: %v", err)
	}
	sort.Strings(keys)
	target := what(key, scope)
	if scope == throttle.ScopeType {
		target = "every key of task type " + display(key.TaskType)
	}
	if len(keys) == 0 && len(tokens) == 0 && !*wake {
		return e.fail(exitNotFound, "reset: nothing to reset: no key of %s", strings.TrimPrefix(target, "every key of "))
	}
	if !*yes {
		fmt.Fprintf(e.stderr, "reset %s: delete %s", target, count(len(keys), "key"))
		if len(tokens) > 0 {
			fmt.Fprintf(e.stderr, ", after releasing %s", count(len(tokens), "reservation"))
		}
		if *wake {
			fmt.Fprint(e.stderr, ", then run its waiting tasks now")
		}
		fmt.Fprintln(e.stderr, ":")
		for i, k := range keys {
			if i == 20 {
				fmt.Fprintf(e.stderr, "  ... and %d more\n", len(keys)-i)
				break
			}
			fmt.Fprintf(e.stderr, "  %s\n", display(k))
		}
		fmt.Fprint(e.stderr, "Delete them? [y/N] ")
		answer, _ := bufio.NewReader(e.stdin).ReadString('\n')
		if !strings.HasSuffix(answer, "\n") {
			fmt.Fprintln(e.stderr) // end the prompt's line
		}
		if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
			return e.fail(exitNotConfirmed, "reset: not confirmed; nothing deleted")
		}
	}
	released := 0
	for _, tok := range tokens {
		ok, err := lim.Release(e.ctx, key.TaskType, tok)
		if err != nil {
			return e.fail(exitRedis, "reset: released %d of %d reservations, then: %v; nothing deleted", released, len(tokens), err)
		}
		if ok {
			released++
		}
	}
	// Every key of a task type shares its hash tag, so one DEL per batch works on a cluster.
	for i := 0; i < len(keys); i += 500 {
		if err := rdb.Del(e.ctx, keys[i:min(i+500, len(keys))]...).Err(); err != nil {
			return e.fail(exitRedis, "reset: deleted %d of %d keys, then: %v", i, len(keys), err)
		}
	}
	j := resetJSON{TaskType: key.TaskType, Tenant: tenantPtr(key, scope), Deleted: keys, Released: released}
	if j.Deleted == nil {
		j.Deleted = []string{}
	}
	woke := ""
	if *wake {
		n, err := wakeWaiting(e, key, scope)
		if err != nil {
			return e.fail(exitRedis, "reset: deleted %s, released %s, ran %s now, then: %v", count(len(keys), "key"),
				count(released, "reservation"), count(n, "waiting task"), err)
		}
		j.Woken = &n
		woke = ", ran " + count(n, "waiting task") + " now"
		if n == 0 && len(keys) == 0 && len(tokens) == 0 { // a mistyped type, say
			return e.fail(exitNotFound, "reset: nothing to reset: no key of %s and no task of it waiting", strings.TrimPrefix(target, "every key of "))
		}
	}
	if e.json {
		return e.printJSON(j)
	}
	fmt.Fprintf(e.stdout, "reset %s: deleted %s, released %s%s\n", target, count(len(keys), "key"), count(released, "reservation"), woke)
	return exitOK
}

// wakePage is how many tasks of a queue's retry or scheduled set one Inspector list reads.
const wakePage = 500

// wakeWaiting moves key's task type's tasks that wait for the throttle back to their
// queues (Inspector.RunTask) and returns how many: in every queue, the retry tasks whose
// last error is the middleware's denial or pause of that type (a *throttle.DeniedError's
// text, which a pause's wraps) and the scheduled deferred copies ("<id>:deferred:<n>",
// worker's copies of tasks that had no retry left); with ScopeTenant, only those whose
// tenant header (THROTTLE_TENANT_HEADER) is key.Tenant. A task that moved on its own
// between the list and RunTask is skipped. The error is the Inspector's.
func wakeWaiting(e *env, key throttle.Key, scope throttle.Scope) (int, error) {
	insp := asynq.NewInspectorFromRedisClient(e.rdb)
	queues, err := insp.Queues()
	if err != nil {
		return 0, err
	}
	denial := "throttle: " + quote.Name(key.TaskType) + " for tenant "
	ours := func(ti *asynq.TaskInfo) bool {
		return ti.Type == key.TaskType && (scope == throttle.ScopeType || ti.Headers[e.vars.TenantHeader] == key.Tenant)
	}
	woken := 0
	for _, q := range queues {
		var ids []string
		for _, list := range []func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error){insp.ListRetryTasks, insp.ListScheduledTasks} {
			for page := 1; ; page++ {
				tasks, err := list(q, asynq.PageSize(wakePage), asynq.Page(page))
				if err != nil {
					return woken, err
				}
				for _, ti := range tasks {
					if ours(ti) && (ti.State == asynq.TaskStateRetry && strings.Contains(ti.LastErr, denial) ||
						ti.State == asynq.TaskStateScheduled && strings.Contains(ti.ID, ":deferred:")) {
						ids = append(ids, ti.ID)
					}
				}
				if len(tasks) < wakePage {
					break
				}
			}
		}
		for _, id := range ids {
			switch err := insp.RunTask(q, id); {
			case errors.Is(err, asynq.ErrTaskNotFound):
			case err != nil:
				return woken, err
			default:
				woken++
			}
		}
	}
	return woken, nil
}
