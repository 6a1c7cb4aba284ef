// Package redisenv reads the Redis connection settings that every command of this module
// (cmd/worker, cmd/enqueue, cmd/demo) takes from the environment, so that they all reach
// the same Redis given the same variables:
//
//	REDIS_ADDR         host:port; a comma-separated list means Redis Cluster nodes, or
//	                   Sentinel addresses when REDIS_MASTER_NAME is set. Defaults to
//	                   "127.0.0.1:6379".
//	REDIS_MASTER_NAME  Sentinel master name. Defaults to empty: no Sentinel.
//	REDIS_PASSWORD     password of the Redis data nodes. Defaults to empty: no AUTH.
//	REDIS_DB           database number, >= 0. Defaults to 0. Redis Cluster has only 0.
//
// A command builds one client with Config.NewClient and shares it with asynq through
// asynq.NewClientFromRedisClient, NewServerFromRedisClient and NewInspectorFromRedisClient;
// Config.Ping checks it at start and says what is wrong in the variables' terms: for
// Sentinel, which of addresses, name and master; a REDIS_DB the server does not have
// (ErrNoSuchDB) rather than an unreachable Redis.
package redisenv

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"
	"github.com/redis/go-redis/v9"
)

// Config is the Redis connection read from the environment by Load. Its zero value is
// not valid: use Load, or fill Addr and call Validate.
type Config struct {
	// Addr is one host:port, or a comma-separated list of them (spaces around commas
	// are ignored): Redis Cluster nodes, or Sentinel addresses when MasterName is set.
	// Defaults to "127.0.0.1:6379".
	Addr string `envconfig:"REDIS_ADDR" default:"127.0.0.1:6379"`
	// MasterName is the Sentinel master name; when set, Addr lists Sentinels.
	// Defaults to empty: Addr lists Redis nodes.
	MasterName string `envconfig:"REDIS_MASTER_NAME"`
	// Password authenticates to the Redis data nodes (not to Sentinels).
	// Defaults to empty: no AUTH.
	Password string `envconfig:"REDIS_PASSWORD"`
	// DB is the database selected after connecting; at least 0. Defaults to 0, the only
	// database Redis Cluster has.
	DB int `envconfig:"REDIS_DB" default:"0"`
}

// Load reads Config from REDIS_ADDR, REDIS_MASTER_NAME, REDIS_PASSWORD and REDIS_DB,
// applies the defaults of unset variables, and validates the result with Validate.
// An error names the variable and quotes its offending text, as in
// `redisenv: REDIS_DB="abc": not an integer`.
func Load() (Config, error) {
	var c Config
	if err := envconfig.Process("", &c); err != nil {
		return Config{}, fmt.Errorf("redisenv: %w", EnvError(err))
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// EnvError turns an error of envconfig.Process into one that names the variable, quotes
// its text and says in words what is wrong, as in `WORKER_CONCURRENCY="ten": not an
// integer`, so every command reports a malformed environment alike. An error that is not
// an *envconfig.ParseError is returned as it is; for a type with its own Decode method the
// problem is that method's error.
func EnvError(err error) error {
	var pe *envconfig.ParseError
	if !errors.As(err, &pe) {
		return err
	}
	var ne *strconv.NumError
	problem := pe.Err.Error()
	switch {
	case pe.TypeName == "time.Duration":
		problem = "not a Go duration such as 1s, 500ms or 2m"
	case pe.TypeName == "bool":
		problem = "not a boolean (true or false)"
	case errors.As(pe.Err, &ne) && errors.Is(ne.Err, strconv.ErrRange):
		problem = "integer out of range"
	case strings.HasPrefix(pe.TypeName, "int"):
		problem = "not an integer"
	}
	return fmt.Errorf("%s=%q: %s", pe.KeyName, pe.Value, problem)
}

// Validate reports the first problem of c: an address in Addr that is not host:port with
// a non-empty host and a numeric port in 1-65535 (error names REDIS_ADDR and quotes its
// text), a negative DB, or a DB other than 0 for a Redis Cluster (several addresses and
// no MasterName), which has only database 0.
func (c Config) Validate() error {
	addrs := c.Addrs()
	for _, a := range addrs {
		if err := checkAddr(a); err != nil {
			return fmt.Errorf("redisenv: REDIS_ADDR=%q: %w", c.Addr, err)
		}
	}
	if c.DB < 0 {
		return fmt.Errorf("redisenv: REDIS_DB=\"%d\": must be at least 0", c.DB)
	}
	if c.DB != 0 && c.MasterName == "" && len(addrs) > 1 {
		return fmt.Errorf("redisenv: REDIS_DB=\"%d\": Redis Cluster (REDIS_ADDR lists %d nodes) has only database 0",
			c.DB, len(addrs))
	}
	return nil
}

// ErrNoSuchDB matches, under errors.Is, the error of Config.Ping when the Redis server has
// no database REDIS_DB: a bad value of the variable, not an outage.
var ErrNoSuchDB = errors.New("redisenv: REDIS_DB names a database the Redis server does not have")

// ErrNotCluster matches, under errors.Is, the error of Config.Ping when REDIS_ADDR lists
// several addresses (a Redis Cluster) without REDIS_MASTER_NAME but the Redis there is not
// in cluster mode: a bad value, not an outage.
var ErrNotCluster = errors.New("redisenv: REDIS_ADDR lists several addresses of a Redis that is not a cluster")

// ErrClusterNode matches, under errors.Is, the error of Config.Ping when REDIS_ADDR gives
// one address, of a Redis Cluster node: a single-node client would send every key there,
// and each key of a slot another node serves would fail with MOVED.
var ErrClusterNode = errors.New("redisenv: REDIS_ADDR gives one node of a Redis Cluster")

// ErrAuth matches, under errors.Is, the error of Config.Ping when the Redis answered but
// refused the connection's credentials: NOAUTH (it requires a password and REDIS_PASSWORD
// is empty) or WRONGPASS (REDIS_PASSWORD is not its password).
var ErrAuth = errors.New("redisenv: the Redis refused REDIS_PASSWORD")

// IsBadValue reports whether err, from Config.Ping, is a bad REDIS_* value that Redis's
// answer showed (ErrNoSuchDB, ErrNotCluster, ErrClusterNode, ErrAuth), not an outage: a
// command reports it as a bad variable.
func IsBadValue(err error) bool {
	return errors.Is(err, ErrNoSuchDB) || errors.Is(err, ErrNotCluster) || errors.Is(err, ErrClusterNode) || errors.Is(err, ErrAuth)
}

// pingError is Ping's error for a bad REDIS_* value that Redis's reply shows: kind
// (ErrNoSuchDB, ErrNotCluster, ErrClusterNode) under errors.Is, and Redis's own error
// under errors.As.
type pingError struct {
	msg  string
	err  error // Redis's
	kind error
}

// Error is the message, naming the variable at fault.
func (e *pingError) Error() string { return e.msg }

// Unwrap is the Redis error behind it.
func (e *pingError) Unwrap() error { return e.err }

// Is reports whether target is its kind (ErrNoSuchDB, ErrNotCluster, ...).
func (e *pingError) Is(target error) bool { return target == e.kind }

// checkAddr reports why a is not host:port.
func checkAddr(a string) error {
	if a == "" {
		return errors.New("empty address")
	}
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) {
			return fmt.Errorf("%q is not host:port: %s", a, ae.Err)
		}
		return fmt.Errorf("%q is not host:port: %v", a, err)
	}
	if host == "" {
		return fmt.Errorf("%q is not host:port: missing host", a)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("%q is not host:port: port %q is not a number in 1-65535", a, port)
	}
	return nil
}

// Addrs returns the addresses listed in Addr, split at commas, spaces trimmed. Empty
// entries are kept, so that Validate reports them.
func (c Config) Addrs() []string {
	addrs := strings.Split(c.Addr, ",")
	for i, a := range addrs {
		addrs[i] = strings.TrimSpace(a)
	}
	return addrs
}

// UniversalOptions returns the go-redis options for c: Addrs, MasterName, Password and DB
// set, everything else at go-redis defaults. redis.NewUniversalClient then picks a
// Sentinel-backed client when MasterName is set, a cluster client for several addresses,
// and a single-node client otherwise. It does not validate c.
func (c Config) UniversalOptions() *redis.UniversalOptions {
	return &redis.UniversalOptions{
		Addrs:      c.Addrs(),
		MasterName: c.MasterName,
		Password:   c.Password,
		DB:         c.DB,
	}
}

// ClusterStateReloadInterval is how often NewClient's Redis Cluster client reloads the
// slot map (CLUSTER SLOTS) when no MOVED reply makes it reload sooner. go-redis's default
// is 60s, and a killed primary sends no MOVED: its client kept sending its slots' commands
// to the dead address for 55s after a kill whose replica was promoted in 2.6s (throttle's
// TestLimiter_ClusterPrimaryKilled). At 1s it costs one CLUSTER SLOTS a second per client.
const ClusterStateReloadInterval = time.Second

// NewClient returns a client for c, made as redis.NewUniversalClient would from
// c.UniversalOptions, but for a Redis Cluster with ClusterStateReloadInterval. It does
// not connect until first used, and does not validate c (Load does). The caller closes
// it; asynq does not close a client passed to its *FromRedisClient constructors.
func (c Config) NewClient() redis.UniversalClient {
	o := c.UniversalOptions()
	if c.MasterName == "" && len(o.Addrs) > 1 {
		co := o.Cluster()
		co.ClusterStateReloadInterval = ClusterStateReloadInterval
		return redis.NewClusterClient(co)
	}
	return redis.NewUniversalClient(o)
}

// sentinelAskTimeout bounds each question Ping asks a Sentinel.
const sentinelAskTimeout = time.Second

// Ping sends PING through rdb, a client made by c.NewClient, and returns nil if Redis
// answers. A connection first selects database c.DB, so a DB the server does not have
// fails every command with "ERR DB index is out of range": Ping reports that as an
// ErrNoSuchDB error naming REDIS_DB and quoting its value,
//
//	redisenv: REDIS_DB="99": the Redis at REDIS_ADDR="127.0.0.1:6379" has no database 99 (ERR DB index is out of range); ...
//
// which a command reports as a bad variable (exit status 2). So is a Redis that refuses
// the credentials (NOAUTH: it requires a password and REDIS_PASSWORD is empty;
// WRONGPASS: REDIS_PASSWORD is not its password), an ErrAuth error naming REDIS_PASSWORD,
//
//	redisenv: REDIS_PASSWORD: the Redis at REDIS_ADDR="127.0.0.1:6379" answered but refused the credentials (REDIS_PASSWORD is empty): NOAUTH ...
//
// (with MasterName, the master's refusal, found after go-redis asked the Sentinels in
// REDIS_ADDR). Otherwise, without MasterName, it returns go-redis's error (Redis
// unreachable, a timeout of ctx). With MasterName set, go-redis says "all sentinels specified in configuration
// are unreachable" even when they answered but do not know the name, so Ping asks each
// Sentinel in Addr for the master (SENTINEL GET-MASTER-ADDR-BY-NAME, within 1s each, even
// if ctx has ended: go-redis keeps retrying an unreachable Sentinel for about half a
// minute, so give ctx a deadline) and says which it is, naming the variables:
//
//	redisenv: no Sentinel in REDIS_ADDR="s1:26379,s2:26379" answers: <the first error>
//	redisenv: no Sentinel in REDIS_ADDR="s1:26379,s2:26379" knows REDIS_MASTER_NAME="nosuch"
//	redisenv: the master of REDIS_MASTER_NAME="mymaster" at 10.0.0.5:6379 (says Sentinel s1:26379) does not answer: <error>
func (c Config) Ping(ctx context.Context, rdb redis.UniversalClient) error {
	err := rdb.Ping(ctx).Err()
	var rerr redis.Error
	if errors.As(err, &rerr) && (strings.HasPrefix(rerr.Error(), "NOAUTH") || strings.HasPrefix(rerr.Error(), "WRONGPASS")) {
		set := "empty"
		if c.Password != "" {
			set = "set, but not the Redis's password"
		}
		where := fmt.Sprintf("the Redis at REDIS_ADDR=%q", c.Addr)
		if c.MasterName != "" {
			where = fmt.Sprintf("the master of REDIS_MASTER_NAME=%q (Sentinels at REDIS_ADDR=%q)", c.MasterName, c.Addr)
		}
		return &pingError{kind: ErrAuth, err: err, msg: fmt.Sprintf("redisenv: REDIS_PASSWORD: %s answered "+
			"but refused the credentials (REDIS_PASSWORD is %s): %v", where, set, err)}
	}
	if errors.As(err, &rerr) && strings.HasPrefix(rerr.Error(), "ERR DB index is out of range") {
		return &pingError{kind: ErrNoSuchDB, err: err, msg: fmt.Sprintf("redisenv: REDIS_DB=\"%d\": the Redis at REDIS_ADDR=%q has no database %d (%v); "+
			"it has databases 0 to N-1, N its \"databases\" setting (16 by default)", c.DB, c.Addr, c.DB, err)}
	}
	if err != nil && c.MasterName == "" && len(c.Addrs()) > 1 && errors.As(err, &rerr) &&
		strings.Contains(rerr.Error(), "cluster support disabled") {
		return &pingError{kind: ErrNotCluster, err: err, msg: fmt.Sprintf("redisenv: REDIS_ADDR=%q lists %d addresses, "+
			"which means Redis Cluster nodes (or Sentinels, with REDIS_MASTER_NAME), but the Redis there is not in cluster mode (%v): "+
			"give one address for a single Redis", c.Addr, len(c.Addrs()), err)}
	}
	if err == nil && c.MasterName == "" && len(c.Addrs()) == 1 {
		// One address is one server; a cluster node there answers PING alike. INFO cluster
		// tells (a server that refuses INFO is taken at its word).
		if info, ierr := rdb.Info(ctx, "cluster").Result(); ierr == nil && strings.Contains(info, "cluster_enabled:1") {
			return &pingError{kind: ErrClusterNode, msg: fmt.Sprintf("redisenv: REDIS_ADDR=%q is one node of a Redis Cluster "+
				"(INFO cluster: cluster_enabled:1): list its primaries, comma separated, so that the client follows the "+
				"cluster's slots; one address is taken as a single Redis, and every key another node serves would fail with MOVED", c.Addr)}
		}
	}
	if err == nil || c.MasterName == "" {
		return err
	}
	var firstErr error
	answered := false
	for _, a := range c.Addrs() {
		askCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sentinelAskTimeout)
		sc := redis.NewSentinelClient(&redis.Options{Addr: a, MaxRetries: -1})
		addr, serr := sc.GetMasterAddrByName(askCtx, c.MasterName).Result()
		_ = sc.Close()
		cancel()
		switch {
		case serr == nil && len(addr) == 2:
			return fmt.Errorf("redisenv: the master of REDIS_MASTER_NAME=%q at %s (says Sentinel %s) does not answer: %w",
				c.MasterName, net.JoinHostPort(addr[0], addr[1]), a, err)
		case errors.Is(serr, redis.Nil): // it answered: no such master
			answered = true
		case firstErr == nil:
			firstErr = fmt.Errorf("%s: %w", a, serr)
		}
	}
	if answered {
		return fmt.Errorf("redisenv: no Sentinel in REDIS_ADDR=%q knows REDIS_MASTER_NAME=%q", c.Addr, c.MasterName)
	}
	return fmt.Errorf("redisenv: no Sentinel in REDIS_ADDR=%q answers: %w", c.Addr, firstErr)
}

// String describes c for logs in the variables' terms, hiding the password:
// `REDIS_ADDR="127.0.0.1:6379" REDIS_MASTER_NAME="" REDIS_PASSWORD=<set> REDIS_DB=0`.
func (c Config) String() string {
	pw := "<empty>"
	if c.Password != "" {
		pw = "<set>"
	}
	return fmt.Sprintf("REDIS_ADDR=%q REDIS_MASTER_NAME=%q REDIS_PASSWORD=%s REDIS_DB=%d",
		c.Addr, c.MasterName, pw, c.DB)
}

// QuietLogs drops go-redis's own log lines (one per failed dial, and its pool's errors)
// for the whole process: go-redis has a single logger, set by redis.SetLogger. It is for
// a command that reports a Redis failure itself, once and in its variables' terms, as
// Config.Ping's errors do.
func QuietLogs() { redis.SetLogger(quietLogger{}) }

// quietLogger is a go-redis logger that writes nothing.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// QuietDialLogs drops go-redis's log lines about failed dials, its pool's "failed to dial
// after N attempts" (one a dial: dozens a second while Redis is down), for the whole
// process, and writes its others to stderr as go-redis does, prefixed "redis: ": a
// Sentinel's failover ("sentinel: new master=..."), a pool hook's errors. It is for a
// long-running command (cmd/worker) that reports an unreachable Redis itself and whose
// other logs (asynq's errors) say when Redis goes away later.
func QuietDialLogs() { redis.SetLogger(dialFilter{log.New(os.Stderr, "redis: ", log.LstdFlags)}) }

// dialFilter is QuietDialLogs's go-redis logger: l gets every line but the dial failures.
type dialFilter struct{ l *log.Logger }

// dialFailure starts the format of go-redis's log line for a failed dial (v9.23,
// internal/pool: "redis: connection pool: failed to dial after %d attempts: %v").
const dialFailure = "redis: connection pool: failed to dial"

func (f dialFilter) Printf(_ context.Context, format string, v ...any) {
	if strings.HasPrefix(format, dialFailure) {
		return
	}
	f.l.Printf(format, v...)
}
