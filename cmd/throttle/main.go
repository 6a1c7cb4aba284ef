// Command throttle is the admin CLI of asynq-throttle: it looks at and changes what the
// throttle does, in the Redis that the workers (cmd/worker) share.
//
// Usage:
//
//	throttle [-json] <command> [arguments]
//
// Commands (throttle -h lists them, throttle <command> -h explains one):
//
//	limits   show, set and delete the tiers and overrides that workers pick up at runtime
//	inspect  every throttle key, or a type's or a tenant's: used/limit per quota, oldest and newest entry, reservations, next slot, pause
//	explain  would a task of a type and tenant run now; if not, which quota denies it, until when, how many wait ahead
//	pause    stop every task of a tenant (or of a task type) on every worker until an instant
//	resume   lift a pause
//	reset    clear a tenant's window log of a task type, or every key of a task type (asks
//	         first); -wake then runs the type's tasks that wait for the throttle now
//
// It reads the same environment as cmd/worker: REDIS_ADDR (default 127.0.0.1:6379; a
// comma-separated list means Redis Cluster nodes, or Sentinels with REDIS_MASTER_NAME),
// REDIS_MASTER_NAME, REDIS_PASSWORD, REDIS_DB (package redisenv), THROTTLE_PREFIX (default
// "throttle", the workers' key prefix), THROTTLE_TENANT_HEADER (default "tenant", for
// reset -wake -tenant) and, to show what a tenant gets, THROTTLE_RULES (the workers'
// default rules; unset: unknown; inspect, explain and pause also take -rules).
//
// Output is for people; -json (before or after the command) prints one JSON object on
// stdout instead. Errors go to stderr as text, whatever -json says.
//
// Exit status:
//
//	0  done
//	1  Redis could not be reached, or a command failed
//	2  bad flags, arguments or environment
//	3  change rejected: invalid text or name, unknown tier, tier still in use; nothing was stored
//	4  not found: nothing is stored under that name to delete, no pause to resume, no key to reset
//	5  not confirmed: reset was not answered y or yes; nothing was deleted
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kelseyhightower/envconfig"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
)

// Exit statuses; the package doc lists them.
const (
	exitOK       = 0
	exitRedis    = 1 // Redis unreachable, or a command failed
	exitUsage    = 2 // bad flags, arguments or environment
	exitRejected = 3 // the change is invalid; nothing was stored
	exitNotFound = 4 // nothing stored under that name
	// exitNotConfirmed: reset was not confirmed; nothing was deleted.
	exitNotConfirmed = 5
)

func main() {
	// go-redis logs each failed dial on stderr; the command reports the failure itself.
	redisenv.QuietLogs()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := runIO(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// command is one subcommand. To add one, write its file (inspect.go, explain.go, ...)
// with a command value and list it in commands.
type command struct {
	name    string
	summary string // one line for throttle -h
	// run runs the subcommand with its arguments (after its name) and returns the exit
	// status. It parses its own flags with env.flags, which adds -json and -h.
	run func(env *env, args []string) int
}

// commands are the subcommands, in the order throttle -h lists them.
var commands = []command{
	limitsCommand,
	inspectCommand,
	explainCommand,
	pauseCommand,
	resumeCommand,
	resetCommand,
}

// env is what every subcommand gets: the context, the output, the -json flag and the
// environment, with the Redis client made on first use.
type env struct {
	ctx            context.Context
	stdin          io.Reader // reset's confirmation
	stdout, stderr io.Writer
	json           bool
	vars           vars
	rdb            redis.UniversalClient // nil until redis() is called
}

// vars are the environment variables of the command other than REDIS_*.
type vars struct {
	// Prefix is the workers' key prefix, throttle.Config.Prefix.
	Prefix string `envconfig:"THROTTLE_PREFIX" default:"throttle" desc:"Redis key prefix of the workers; no '{' or '}', and its last ':'-separated segment not 'enqueue' (producers' enqueue quotas live under <prefix>:enqueue:)"`
	// Rules are the workers' default rules, read only to show what a tenant gets.
	TenantHeader string `envconfig:"THROTTLE_TENANT_HEADER" default:"tenant" desc:"the task header that names the tenant, as the workers'; reset -wake -tenant reads it"`
	Rules        string `envconfig:"THROTTLE_RULES" desc:"the workers' default rules, to show what a tenant gets; unset: unknown"`

	Redis redisenv.Config `ignored:"true"`
}

// redisPingTimeout bounds the check that Redis answers.
const redisPingTimeout = 5 * time.Second

// run is runIO with nothing on stdin: a reset that asks is not confirmed.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runIO(ctx, args, strings.NewReader(""), stdout, stderr)
}

// runIO is the whole command: it parses the global flags, reads the environment, runs the
// subcommand and returns the exit status.
func runIO(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{ctx: ctx, stdin: stdin, stdout: stdout, stderr: stderr}
	defer e.close()
	fs := flag.NewFlagSet("throttle", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.BoolVar(&e.json, "json", false, "print JSON on stdout")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(stdout)
			return exitOK
		}
		fmt.Fprintf(stderr, "throttle: %v\nRun 'throttle -h' for usage.\n", err)
		return exitUsage
	}
	if fs.NArg() == 0 {
		usage(stderr)
		return exitUsage
	}
	name := fs.Arg(0)
	for _, c := range commands {
		if c.name != name {
			continue
		}
		if err := envconfig.Process("", &e.vars); err != nil {
			fmt.Fprintf(stderr, "throttle: %v\n", redisenv.EnvError(err))
			return exitUsage
		}
		if e.vars.Prefix == "" || strings.ContainsAny(e.vars.Prefix, "{}") {
			fmt.Fprintf(stderr, "throttle: THROTTLE_PREFIX=%q: must be non-empty, without '{' or '}'\n", e.vars.Prefix)
			return exitUsage
		}
		rc, err := redisenv.Load()
		if err != nil {
			fmt.Fprintf(stderr, "throttle: %v\n", err)
			return exitUsage
		}
		e.vars.Redis = rc
		return c.run(e, fs.Args()[1:])
	}
	fmt.Fprintf(stderr, "throttle: unknown command %q\nRun 'throttle -h' for usage.\n", name)
	return exitUsage
}

// usage prints the commands, the environment and the exit statuses.
func usage(w io.Writer) {
	fmt.Fprintf(w, "Usage: throttle [-json] <command> [arguments]\n\nThe admin CLI of asynq-throttle. Commands:\n\n")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s\t%s\n", c.name, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n'throttle <command> -h' explains a command. Environment, as for cmd/worker:\n\n")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  VARIABLE\tDEFAULT\tMEANING")
	_ = envconfig.Usagef("", &vars{}, tw, "{{range .}}  {{usage_key .}}\t{{usage_default .}}\t{{usage_description .}}\n{{end}}")
	fmt.Fprintln(tw, "  REDIS_ADDR\t127.0.0.1:6379\thost:port; a comma-separated list means Redis Cluster nodes, or Sentinels with REDIS_MASTER_NAME")
	fmt.Fprintln(tw, "  REDIS_MASTER_NAME\t\tSentinel master name")
	fmt.Fprintln(tw, "  REDIS_PASSWORD\t\tpassword of the Redis data nodes")
	fmt.Fprintln(tw, "  REDIS_DB\t0\tdatabase number (0 on a cluster)")
	_ = tw.Flush()
	fmt.Fprint(w, exitStatuses)
}

// exitStatuses is the part of every usage text that lists the exit statuses.
const exitStatuses = `
Exit status: 0 done; 1 Redis could not be reached or a command failed; 2 bad flags,
arguments or environment; 3 change rejected (invalid text or name, unknown tier, tier
still in use, a pause that would do nothing), nothing stored;
4 nothing stored under that name to delete (no pause to resume, no key to reset);
5 reset not confirmed, nothing deleted.
`

// flags returns a FlagSet for a subcommand, with -json (bound to e.json) and -h.
func (e *env) flags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.BoolVar(&e.json, "json", e.json, "print JSON on stdout")
	return fs
}

// parse parses args with fs, flags before, between or after the positional arguments
// ("--" ends the flags), and returns the positional ones. It returns flag.ErrHelp for -h.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), nil
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
}

// redisExit is the exit status for e.redis's error: exitUsage for a bad REDIS_* value
// that Redis's answer showed (redisenv.IsBadValue: no such database, a list of
// standalone servers, one node of a cluster, a REDIS_PASSWORD it refuses), else
// exitRedis.
func redisExit(err error) int {
	if redisenv.IsBadValue(err) {
		return exitUsage
	}
	return exitRedis
}

// redis returns the client of the environment's Redis, checking once that it answers.
// The error names REDIS_ADDR.
func (e *env) redis() (redis.UniversalClient, error) {
	if e.rdb != nil {
		return e.rdb, nil
	}
	rdb := e.vars.Redis.NewClient()
	ctx, cancel := context.WithTimeout(e.ctx, redisPingTimeout)
	defer cancel()
	if err := e.vars.Redis.Ping(ctx, rdb); err != nil { // for Sentinel it says what is wrong
		_ = rdb.Close()
		if redisenv.IsBadValue(err) {
			return nil, err // a bad value: Redis answered
		}
		return nil, fmt.Errorf("Redis at REDIS_ADDR=%q does not answer: %w", e.vars.Redis.Addr, err)
	}
	e.rdb = rdb
	return rdb, nil
}

func (e *env) close() {
	if e.rdb != nil {
		_ = e.rdb.Close()
	}
}

// fail prints err on stderr, prefixed by the command, and returns code. An error of the
// throttle package names it ("throttle: invalid request: ..."), which after the command's
// own name would read "throttle: pause: throttle: invalid request": that repeat, right
// after the command, is dropped; one deeper in a chain of errors stays.
func (e *env) fail(code int, format string, a ...any) int {
	msg := fmt.Sprintf(format, a...)
	if cmd, rest, ok := strings.Cut(msg, ": "); ok {
		if r, ok := strings.CutPrefix(rest, "throttle: "); ok {
			msg = cmd + ": " + r
		}
	}
	fmt.Fprintf(e.stderr, "throttle: %s\n", msg)
	return code
}

// display returns s as it is if it prints plainly (no spaces, quotes, control or
// non-printing characters), else quoted: tenants and task types are user data, and a
// newline or an escape sequence must not break a line of output.
func display(s string) string {
	if q := fmt.Sprintf("%q", s); s != "" && q == `"`+s+`"` && !strings.ContainsAny(s, " \"'") {
		return s
	}
	return fmt.Sprintf("%q", s)
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
