package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kelseyhightower/envconfig"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
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
	ForwarderInterval time.Duration `envconfig:"WORKER_FORWARDER_INTERVAL" default:"500ms" desc:"how often due throttled (retry/scheduled) tasks are moved back to their queue"`
	// Rules are the throttling rules, at least one.
	Rules Rules `envconfig:"THROTTLE_RULES" default:"api:call tenant=5/2s" desc:"rules separated by ';', each a task type and scope=events/window quotas, scope tenant or type"`
	// TenantHeader is the task header that names the tenant.
	TenantHeader string `envconfig:"THROTTLE_TENANT_HEADER" default:"tenant" desc:"task header that names the tenant"`
	// Prefix starts every Redis key of the limiter.
	Prefix string `envconfig:"THROTTLE_PREFIX" default:"throttle" desc:"Redis key prefix of the limiter; no '{' or '}'"`
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
	// FailOpen runs tasks unthrottled when the limiter's Redis cannot answer.
	FailOpen bool `envconfig:"THROTTLE_FAIL_OPEN" default:"false" desc:"if true, run tasks unthrottled when Redis cannot answer; default: they wait and come back (fail closed)"`
	// MetricsAddr, if set, serves Prometheus metrics at http://<addr>/metrics.
	MetricsAddr string `envconfig:"METRICS_ADDR" desc:"if set, host:port to serve Prometheus metrics on at /metrics, e.g. 127.0.0.1:9090"`
	// LogInterval is how often the worker logs what ran and what was throttled.
	LogInterval time.Duration `envconfig:"WORKER_LOG_INTERVAL" default:"1s" desc:"how often to log tasks ran and throttled per task type and tenant"`

	// Redis is the Redis connection, from redisenv.Load.
	Redis redisenv.Config `ignored:"true"`
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

// validate reports the first value that parsed but is out of range.
func (c Config) validate() error {
	switch {
	case c.Concurrency < 1:
		return badVar("WORKER_CONCURRENCY", "must be at least 1")
	case c.ForwarderInterval <= 0:
		return badVar("WORKER_FORWARDER_INTERVAL", "must be positive")
	case c.LogInterval <= 0:
		return badVar("WORKER_LOG_INTERVAL", "must be positive")
	case c.WorkTime < 0:
		return badVar("WORKER_WORK_TIME", "must not be negative")
	case c.TenantHeader == "":
		return badVar("THROTTLE_TENANT_HEADER", "must not be empty")
	case c.Clock != "local" && c.Clock != "redis":
		return badVar("THROTTLE_CLOCK", "want local or redis")
	case c.MaxSkew <= 0:
		return badVar("THROTTLE_MAX_SKEW", "must be positive")
	case c.Prefix == "":
		return badVar("THROTTLE_PREFIX", "must not be empty")
	case strings.ContainsAny(c.Prefix, "{}"):
		return badVar("THROTTLE_PREFIX", "must not contain '{' or '}': they would move the Redis Cluster hash tag")
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
// "default:1,critical:6", with spaces around names and numbers allowed.
type Queues map[string]int

// Decode implements envconfig.Decoder.
func (q *Queues) Decode(s string) error {
	m := Queues{}
	for _, item := range strings.Split(s, ",") {
		if strings.TrimSpace(item) == "" {
			continue
		}
		name, prio, ok := strings.Cut(item, ":")
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
