package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"sort"
	"strings"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

var resetCommand = command{
	name:    "reset",
	summary: "clear a tenant's window log of a task type, or every key of a task type (asks first)",
	run:     runReset,
}

const resetUsage = `Usage:
  throttle reset -type T -tenant X [-yes]    X's window log of T, with its pending: and costs: sets
  throttle reset -type T [-yes]              every key of T: all its logs, leases, fair queue, locks

reset forgets what the throttle counted, so the tasks decided next find room: use it
after a quota was set far too low, or to start a test over. With -tenant it first
releases the tenant's reservations of T (throttle.Limiter.Release, so that the type's log
and the leases stay consistent), then deletes the tenant's log and the two sets beside
it; a pause of that log goes with it. Without -tenant it deletes every key of T
("<prefix>:{T}:*"). Tasks waiting for a reservation that was deleted are decided afresh
when they come back. It lists what it will delete and asks for confirmation on stdin
(y or yes), unless -yes.

What it forgets includes the window's admissions: in the window around a reset, up to
twice the limit can run (those admitted before it, and a full window after it), so an
upstream API with the same limit may answer 429 once.

Flags:
  -json    print JSON on stdout
  -tenant  the tenant whose log to clear ('' is the tenant of untagged tasks)
  -type    the task type
  -yes     do not ask
`

// resetJSON is what reset prints with -json.
type resetJSON struct {
	TaskType string   `json:"task_type"`
	Tenant   *string  `json:"tenant,omitempty"` // absent: every key of the type
	Deleted  []string `json:"deleted"`
	Released int      `json:"released"` // reservations released first (with -tenant)
}

func runReset(e *env, args []string) int {
	fs := e.flags("reset")
	var tf targetFlags
	tf.register(fs)
	yes := fs.Bool("yes", false, "")
	pos, err := parse(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(e.stdout, resetUsage+exitStatuses)
		return exitOK
	}
	if err != nil {
		return e.fail(exitUsage, "reset: %v\nRun 'throttle reset -h' for usage.", err)
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
	if len(keys) == 0 && len(tokens) == 0 {
		return e.fail(exitNotFound, "reset: nothing to reset: no key of %s", strings.TrimPrefix(target, "every key of "))
	}
	if !*yes {
		fmt.Fprintf(e.stderr, "reset %s: delete %s", target, count(len(keys), "key"))
		if len(tokens) > 0 {
			fmt.Fprintf(e.stderr, ", after releasing %s", count(len(tokens), "reservation"))
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
	if e.json {
		return e.printJSON(j)
	}
	fmt.Fprintf(e.stdout, "reset %s: deleted %s, released %s\n", target, count(len(keys), "key"), count(released, "reservation"))
	return exitOK
}
