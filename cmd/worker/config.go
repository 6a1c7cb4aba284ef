package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/redis/go-redis/v9"
	"math"
	"net"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// Config is the worker's configuration, read from the environment by loadConfig. The
// REDIS_* variables are package redisenv's.
type Config struct {
	// Queues maps each queue to its priority, as asynq.Config.Queues.
	Queues Queues `envconfig:"WORKER_QUEUES" default:"default:1" desc:"queue:priority pairs, comma-separated; priority >= 1"`
	// Concurrency is the most tasks handled at once, as asynq.Config.Concurrency.
	Concurrency int `envconfig:"WORKER_CONCURRENCY" default:"10" desc:"most tasks handled at once, >= 1"`
	// ForwarderInterval is asynq.Config.DelayedTaskCheckInterval: how often due
	// scheduled and retry tasks (throttled tasks among them) move back to their queue.
	// At least minForwarderInterval.
	ForwarderInterval time.Duration `envconfig:"WORKER_FORWARDER_INTERVAL" default:"500ms" desc:"how often due throttled (retry/scheduled) tasks are moved back to their queue, >= 100ms"`
	// Rules are the throttling rules, at least one.
	Rules Rules `envconfig:"THROTTLE_RULES" default:"api:call tenant=5/2s" desc:"rules separated by ';', each a task type and scope=events/window quotas, scope tenant or type"`
	// TenantHeader is the task header that names the tenant.
	TenantHeader string `envconfig:"THROTTLE_TENANT_HEADER" default:"tenant" desc:"task header that names the tenant"`
	// Prefix starts every Redis key of the limiter.
	Prefix string `envconfig:"THROTTLE_PREFIX" default:"throttle" desc:"Redis key prefix of the limiter; no '{' or '}', and its last ':'-separated segment not 'enqueue' (producers' enqueue quotas live under <prefix>:enqueue:)"`
	// DemoAPIURL, if set, is the URL the demo handler POSTs each task to; otherwise the
	// handler sleeps WorkTime.
	DemoAPIURL string `envconfig:"DEMO_API_URL" desc:"if set, POST each task here (header Tenant, payload as body); non-2xx is a failure"`
	// WorkTime is how long the demo handler works on a task when DemoAPIURL is empty.
	WorkTime time.Duration `envconfig:"WORKER_WORK_TIME" default:"20ms" desc:"simulated work per task when DEMO_API_URL is empty, >= 0"`
	// Clock chooses whose clock timestamps the window logs: "local" (this process's,
	// checked against the Redis server's within MaxSkew) or "redis" (the server's TIME).
	Clock string `envconfig:"THROTTLE_CLOCK" default:"local" desc:"whose clock timestamps admissions: local (checked against Redis within THROTTLE_MAX_SKEW) or redis (the server's TIME)"`
	// MaxSkew is throttle.Config.MaxSkew: beyond it, decisions use the server's TIME and
	// the worker logs the skew.
	MaxSkew time.Duration `envconfig:"THROTTLE_MAX_SKEW" default:"1s" desc:"clock skew to Redis tolerated before deciding by the server's TIME (logged and counted), > 0"`
	// MinReplicas is throttle.Config.MinReplicas (durable mode): an admission runs its task
	// only once that many replicas have acknowledged it (WAIT). 0: off.
	MinReplicas int `envconfig:"THROTTLE_MIN_REPLICAS" default:"0" desc:"replicas that must acknowledge an admission (WAIT) before its task runs, >= 0; 0: off (see README, Failover and durable mode)"`
	// ReplicaTimeout is throttle.Config.ReplicaTimeout: how long WAIT waits for them.
	ReplicaTimeout time.Duration `envconfig:"THROTTLE_REPLICA_TIMEOUT" default:"100ms" desc:"with THROTTLE_MIN_REPLICAS, how long an admission waits for the replicas' acknowledgement, >= 1ms and under 5s"`
	// FailOpen runs tasks unthrottled when the limiter's Redis cannot answer.
	FailOpen bool `envconfig:"THROTTLE_FAIL_OPEN" default:"false" desc:"if true, run tasks unthrottled when Redis cannot answer; default: they wait and come back (fail closed)"`
	// MetricsAddr, if set, serves Prometheus metrics at http://<addr>/metrics.
	MetricsAddr string `envconfig:"METRICS_ADDR" desc:"if set, host:port to serve Prometheus metrics on at /metrics, e.g. :9090 or 127.0.0.1:9090"`
	// MetricsTenantLabel is worker.MetricsConfig.TenantLabel: count decisions by tenant.
	MetricsTenantLabel bool `envconfig:"METRICS_TENANT_LABEL" default:"false" desc:"if true, label asynq_throttle_decisions_total by tenant too, for the first METRICS_MAX_TENANTS tenants (later ones: tenant=\"other\")"`
	// MetricsMaxTenants is worker.MetricsConfig.MaxTenants: the most distinct tenant
	// labels; at least 1.
	MetricsMaxTenants int `envconfig:"METRICS_MAX_TENANTS" default:"100" desc:"most distinct tenant label values with METRICS_TENANT_LABEL, >= 1"`
	// ShutdownTimeout is asynq.Config.ShutdownTimeout: after SIGINT or SIGTERM, how long
	// the tasks already running may take to finish. asynq then cancels the context of
	// each one still running and puts it back in its queue (pending, no retry spent), to
	// run again from the start. At least minShutdownTimeout.
	ShutdownTimeout time.Duration `envconfig:"WORKER_SHUTDOWN_TIMEOUT" default:"30s" desc:"after SIGINT/SIGTERM, how long running tasks may take to finish; then each one still running has its context cancelled and goes back to its queue (pending, no retry spent) to run again, >= 1s"`
	// LogInterval is how often the worker logs what ran and what was throttled. At least
	// minLogInterval.
	LogInterval time.Duration `envconfig:"WORKER_LOG_INTERVAL" default:"1s" desc:"how often to log tasks ran and throttled per task type and tenant, >= 100ms"`
	// LogMaxLines is the most (task type, tenant) lines logged per LogInterval; the rest
	// are summed up in one more line. At least 1.
	LogMaxLines int `envconfig:"WORKER_LOG_MAX_LINES" default:"20" desc:"most lines per WORKER_LOG_INTERVAL, the busiest (task type, tenant) pairs; the rest are summed in one '... and N more' line, >= 1"`

	// Redis is the Redis connection, from redisenv.Load.
	Redis redisenv.Config `ignored:"true"`
}

// redisUsage describes, for -h only, the REDIS_* variables that redisenv.Load reads (its
// Config has no descriptions); the names and defaults are redisenv.Config's, which
// TestRedisUsage_matchesRedisenv checks.
type redisUsage struct {
	Addr       string `envconfig:"REDIS_ADDR" default:"127.0.0.1:6379" desc:"host:port of Redis; a comma-separated list means Redis Cluster nodes, or Sentinels when REDIS_MASTER_NAME is set"`
	MasterName string `envconfig:"REDIS_MASTER_NAME" desc:"Sentinel master name; when set, REDIS_ADDR lists Sentinels. Empty: no Sentinel"`
	Password   string `envconfig:"REDIS_PASSWORD" desc:"password of the Redis data nodes (not of the Sentinels). Empty: no AUTH"`
	DB         int    `envconfig:"REDIS_DB" default:"0" desc:"database number, >= 0; Redis Cluster has only 0"`
}

// loadConfig reads Config from the environment. The error names the variable and
// quotes its text: `WORKER_CONCURRENCY="ten": not an integer`.
func loadConfig() (Config, error) {
	var c Config
	if err := envconfig.Process("", &c); err != nil {
		return Config{}, redisenv.EnvError(err)
	}
	if err := c.validate(); err != nil {
		return Config{}, err
	}
	rc, err := redisenv.Load()
	if err != nil {
		return Config{}, err
	}
	c.Redis = rc
	return c, nil
}

// Lower bounds of the intervals. Each tick of either costs CPU whether or not there is
// work: at 1ns, measured on an idle worker, the forwarder took 51% of a core and the log
// ticker 103%.
const (
	// minForwarderInterval bounds WORKER_FORWARDER_INTERVAL: each interval asynq runs a
	// script per queue on Redis to move due tasks. asynq's own default is 5s; the tests
	// run at this bound.
	minForwarderInterval = 100 * time.Millisecond
	// minLogInterval bounds WORKER_LOG_INTERVAL: lines are for people, and each interval
	// sorts every (task type, tenant) with activity.
	minLogInterval = 100 * time.Millisecond
)

// minShutdownTimeout bounds WORKER_SHUTDOWN_TIMEOUT: asynq reads 0 as its own 8s, and
// less than a second gives a task no time to finish.
const minShutdownTimeout = time.Second

// validate reports the first value that parsed but is out of range.
func (c Config) validate() error {
	switch {
	case c.Concurrency < 1:
		return badVar("WORKER_CONCURRENCY", "must be at least 1")
	case c.ForwarderInterval < minForwarderInterval:
		return badVar("WORKER_FORWARDER_INTERVAL", fmt.Sprintf("must be at least %s: each interval runs a Redis script per queue, "+
			"and shorter intervals keep an idle worker and Redis busy (1ns took half a CPU core) for no gain", minForwarderInterval))
	case c.LogInterval < minLogInterval:
		return badVar("WORKER_LOG_INTERVAL", fmt.Sprintf("must be at least %s: shorter intervals flood the log "+
			"and keep an idle worker busy (1ns took a whole CPU core)", minLogInterval))
	case c.ShutdownTimeout < minShutdownTimeout:
		return badVar("WORKER_SHUTDOWN_TIMEOUT", fmt.Sprintf("must be at least %s: running tasks get this long to finish at shutdown", minShutdownTimeout))
	case c.LogMaxLines < 1:
		return badVar("WORKER_LOG_MAX_LINES", "must be at least 1")
	case c.MetricsMaxTenants < 1:
		return badVar("METRICS_MAX_TENANTS", "must be at least 1")
	case c.WorkTime < 0:
		return badVar("WORKER_WORK_TIME", "must not be negative")
	case c.TenantHeader == "":
		return badVar("THROTTLE_TENANT_HEADER", "must not be empty")
	case c.Clock != "local" && c.Clock != "redis":
		return badVar("THROTTLE_CLOCK", "want local or redis")
	case c.MaxSkew <= 0:
		return badVar("THROTTLE_MAX_SKEW", "must be positive")
	case c.MinReplicas < 0:
		return badVar("THROTTLE_MIN_REPLICAS", "must not be negative")
	case c.ReplicaTimeout < time.Millisecond || c.ReplicaTimeout >= 5*time.Second:
		return badVar("THROTTLE_REPLICA_TIMEOUT", "want 1ms or more and under 5s (the Redis client's read timeout)")
	case c.Prefix == "":
		return badVar("THROTTLE_PREFIX", "must not be empty")
	case strings.ContainsAny(c.Prefix, "{}"):
		return badVar("THROTTLE_PREFIX", "must not contain '{' or '}': they would move the Redis Cluster hash tag")
	}
	if err := producer.CheckPrefix(c.Prefix); err != nil { // "x:enqueue": keys of the producers' enqueue quotas
		return badVar("THROTTLE_PREFIX", err.Error())
	}
	if c.MetricsAddr != "" {
		if _, port, err := net.SplitHostPort(c.MetricsAddr); err != nil || port == "" {
			return badVar("METRICS_ADDR", "want host:port, e.g. 127.0.0.1:9090")
		}
	}
	if c.DemoAPIURL != "" {
		u, err := url.Parse(c.DemoAPIURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return badVar("DEMO_API_URL", "want an http:// or https:// URL with a host")
		}
	}
	return nil
}

// badVar is the error for a set variable whose value is out of range. Only set variables
// can be: every default is valid.
func badVar(name, problem string) error {
	return fmt.Errorf("%s=%q: %s", name, os.Getenv(name), problem)
}

// Queues maps queue names to priorities. It reads envconfig's map syntax,
// "default:1,critical:6", with spaces around names and numbers allowed. A priority
// follows its queue's last ':', so that a queue whose name holds ':' (asynq allows it,
// and cmd/enqueue -queue fills one) reads as "a:b:1".
type Queues map[string]int

// Decode implements envconfig.Decoder.
func (q *Queues) Decode(s string) error {
	m := Queues{}
	for _, item := range strings.Split(s, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		name, prio, ok := item, "", false
		if i := strings.LastIndexByte(item, ':'); i >= 0 {
			name, prio, ok = item[:i], item[i+1:], true
		}
		name, prio = strings.TrimSpace(name), strings.TrimSpace(prio)
		if !ok || name == "" {
			return fmt.Errorf("queue %q: want queue:priority, e.g. default:1,critical:6", strings.TrimSpace(item))
		}
		p, err := strconv.Atoi(prio)
		if err != nil || p < 1 {
			return fmt.Errorf("queue %q: priority %q is not an integer >= 1", name, prio)
		}
		if _, dup := m[name]; dup {
			return fmt.Errorf("queue %q is listed twice", name)
		}
		m[name] = p
	}
	if len(m) == 0 {
		return errors.New("no queue; want queue:priority pairs, e.g. default:1,critical:6")
	}
	*q = m
	return nil
}

// String lists the queues as Decode reads them, highest priority first:
// "critical:6,default:1".
func (q Queues) String() string {
	names := make([]string, 0, len(q))
	for name := range q {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool {
		if q[names[i]] != q[names[j]] {
			return q[names[i]] > q[names[j]]
		}
		return names[i] < names[j]
	})
	for i, name := range names {
		names[i] = name + ":" + strconv.Itoa(q[name])
	}
	return strings.Join(names, ",")
}

// Rules are the throttling rules, read by worker.ParseRules; there must be at least one.
type Rules []worker.Rule

// Decode implements envconfig.Decoder.
func (r *Rules) Decode(s string) error {
	rules, err := worker.ParseRules(s)
	if err != nil {
		return err
	}
	if len(rules) == 0 {
		return errors.New(`no rule; want e.g. "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h"`)
	}
	*r = rules
	return nil
}

// concurrencyAdvice returns a warning for each rule under which one tenant alone can be
// admitted faster than the workers can wait for: a task woken for its slot waits up to
// maxWait in its handler, and at most concurrency - 1 handlers may wait (worker.Config
// .Concurrency), so a tenant admitted at rate r needs about r x maxWait of them (the
// README's concurrency rule). Below that, tasks come back after their slots and are
// denied again: fewer runs than the limit allows, and many more denials. The rate is the
// rule's smallest events/window over its quotas (a tenant is bound by all of them);
// more tenants need more workers still, which a rule alone does not tell. A shadow rule
// gets no advice (its tasks never wait: worker.ModeShadow), nor does a rule with a cost
// (cost=): its quotas count cost units, and how many tasks a second they admit depends
// on their costs, which the rule alone does not tell either.
func concurrencyAdvice(rules Rules, concurrency int, maxWait time.Duration) []string {
	var out []string
	for _, r := range rules {
		if r.Mode == worker.ModeShadow || r.CostHeader != "" || r.CostFunc != nil {
			continue
		}
		rate := -1.0
		for _, q := range r.Quotas {
			if qr := float64(q.Limit.Events) / q.Limit.Window.Seconds(); rate < 0 || qr < rate {
				rate = qr
			}
		}
		need := int(math.Ceil(rate*maxWait.Seconds())) + 1
		if rate < 0 || need <= concurrency {
			continue
		}
		out = append(out, fmt.Sprintf("warning: rule %s admits one tenant at up to %.4g/s, and a task waits up to %s for its slot "+
			"in its handler; WORKER_CONCURRENCY=%d lets %d wait: expect fewer runs than the limit and repeated denials, "+
			"or set WORKER_CONCURRENCY to %d or more (README, the concurrency rule)", r, rate, maxWait, concurrency, max(concurrency-1, 1), need))
	}
	return out
}

// connectedReplicas returns the connected_slaves of INFO replication on the server rdb
// writes to (on a Redis Cluster, of one master), and false if it cannot be read.
func connectedReplicas(ctx context.Context, rdb redis.UniversalClient) (int, bool) {
	info, err := rdb.Info(ctx, "replication").Result()
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_slaves:"); ok {
			n, err := strconv.Atoi(v)
			return n, err == nil
		}
	}
	return 0, false
}
