package main

import (
	"context"
	"io"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redisenv"
	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// envVars are every variable the worker reads.
var envVars = []string{
	"WORKER_QUEUES", "WORKER_CONCURRENCY", "WORKER_FORWARDER_INTERVAL", "THROTTLE_RULES",
	"THROTTLE_TENANT_HEADER", "THROTTLE_PREFIX", "DEMO_API_URL", "WORKER_WORK_TIME",
	"WORKER_LOG_INTERVAL", "THROTTLE_CLOCK", "THROTTLE_MAX_SKEW", "THROTTLE_FAIL_OPEN",
	"METRICS_ADDR", "METRICS_TENANT_LABEL", "METRICS_MAX_TENANTS", "WORKER_LOG_MAX_LINES",
	"WORKER_SHUTDOWN_TIMEOUT", "REDIS_ADDR", "REDIS_MASTER_NAME", "REDIS_PASSWORD", "REDIS_DB",
}

// clearEnv unsets every variable the worker reads, for this test only, then sets kv
// (name, value, name, value...).
func clearEnv(t *testing.T, kv ...string) {
	t.Helper()
	for _, name := range envVars {
		t.Setenv(name, "") // restores the old value at cleanup
		if err := os.Unsetenv(name); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i+1 < len(kv); i += 2 {
		t.Setenv(kv[i], kv[i+1])
	}
}

func TestLoadConfig_defaults(t *testing.T) {
	clearEnv(t)
	got, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Queues:            Queues{"default": 1},
		Concurrency:       10,
		ForwarderInterval: 500 * time.Millisecond,
		Rules: Rules{{TaskType: "api:call", Quotas: []throttle.Quota{
			{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 5, Window: 2 * time.Second}}}}},
		TenantHeader:   "tenant",
		Prefix:         "throttle",
		DemoAPIURL:     "",
		WorkTime:       20 * time.Millisecond,
		Clock:          "local",
		MaxSkew:        time.Second,
		ReplicaTimeout: 100 * time.Millisecond,
		LogInterval:    time.Second,
		LogMaxLines:    20,
		Redis:          redisenv.Config{Addr: "127.0.0.1:6379"},

		MetricsMaxTenants: 100,
		ShutdownTimeout:   30 * time.Second,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("defaults:\n got %+v\nwant %+v", got, want)
	}
}

func TestLoadConfig_allSet(t *testing.T) {
	clearEnv(t,
		"WORKER_QUEUES", "default:1, critical:6",
		"WORKER_CONCURRENCY", "3",
		"WORKER_FORWARDER_INTERVAL", "250ms",
		"THROTTLE_RULES", "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h;",
		"THROTTLE_TENANT_HEADER", "org",
		"THROTTLE_PREFIX", "rl",
		"DEMO_API_URL", "http://127.0.0.1:8080/call",
		"WORKER_WORK_TIME", "0s",
		"WORKER_LOG_INTERVAL", "5s",
		"THROTTLE_CLOCK", "redis",
		"THROTTLE_MAX_SKEW", "250ms",
		"THROTTLE_MIN_REPLICAS", "1",
		"THROTTLE_REPLICA_TIMEOUT", "50ms",
		"THROTTLE_FAIL_OPEN", "true",
		"METRICS_ADDR", "127.0.0.1:9090",
		"METRICS_TENANT_LABEL", "true",
		"METRICS_MAX_TENANTS", "7",
		"WORKER_LOG_MAX_LINES", "3",
		"WORKER_SHUTDOWN_TIMEOUT", "2m",
		"REDIS_ADDR", "127.0.0.1:7000",
		"REDIS_DB", "5",
	)
	got, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Queues:            Queues{"default": 1, "critical": 6},
		Concurrency:       3,
		ForwarderInterval: 250 * time.Millisecond,
		Rules: Rules{
			{TaskType: "api:call", Quotas: []throttle.Quota{
				{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 5, Window: 2 * time.Second}},
				{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 20, Window: time.Second}}}},
			{TaskType: "email:send", Quotas: []throttle.Quota{
				{Scope: throttle.ScopeTenant, Limit: throttle.PerHour(100)}}},
		},
		TenantHeader:   "org",
		Prefix:         "rl",
		DemoAPIURL:     "http://127.0.0.1:8080/call",
		WorkTime:       0,
		Clock:          "redis",
		MaxSkew:        250 * time.Millisecond,
		MinReplicas:    1,
		ReplicaTimeout: 50 * time.Millisecond,
		FailOpen:       true,
		MetricsAddr:    "127.0.0.1:9090",
		LogInterval:    5 * time.Second,
		LogMaxLines:    3,
		Redis:          redisenv.Config{Addr: "127.0.0.1:7000", DB: 5},

		MetricsTenantLabel: true,
		MetricsMaxTenants:  7,
		ShutdownTimeout:    2 * time.Minute,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got  %+v\nwant %+v", got, want)
	}
	if s := got.Queues.String(); s != "critical:6,default:1" {
		t.Errorf("Queues.String() = %q", s)
	}
	var rules []string
	for _, r := range got.Rules {
		rules = append(rules, r.String())
	}
	if s := strings.Join(rules, "; "); s != "api:call tenant=5/2s type=20/1s; email:send tenant=100/1h" {
		t.Errorf("rules = %q", s)
	}
}

// TestLoadConfig_malformed checks that each bad value is reported as NAME="text": and
// then says what is wrong.
func TestLoadConfig_malformed(t *testing.T) {
	tests := []struct {
		name, value string
		problem     string // in the error after `NAME="value": `
	}{
		{"THROTTLE_RULES", "api:call tenant=5", `worker: rule 1 "api:call tenant=5": quota "tenant=5": throttle: limit "5": want events/window`},
		{"THROTTLE_RULES", "api:call", `worker: rule 1 "api:call": task type "api:call" has no quota`},
		{"THROTTLE_RULES", "api:call user=5/1s", `quota "user=5/1s": unknown scope "user"; want tenant or type`},
		{"THROTTLE_RULES", "api:call tenant=five/1s", `events "five" is not an integer`},
		{"THROTTLE_RULES", "api:call tenant=0/1s", `events must be at least 1, got 0`},
		{"THROTTLE_RULES", "api:call tenant=5/2", `window "2" is not a Go duration`},
		{"THROTTLE_RULES", "api:call tenant=5/0s", `window must be at least 1ms`},
		{"THROTTLE_RULES", "api:call tenant=5/1s; api:call type=9/1s", `worker: rule 2 "api:call type=9/1s": task type "api:call" already has rule 1`},
		{"THROTTLE_RULES", "", `no rule; want e.g.`},
		{"THROTTLE_RULES", " ; ", `no rule; want e.g.`},
		{"WORKER_CONCURRENCY", "ten", `not an integer`},
		{"WORKER_CONCURRENCY", "0", `must be at least 1`},
		{"WORKER_CONCURRENCY", "-4", `must be at least 1`},
		{"WORKER_FORWARDER_INTERVAL", "1", `not a Go duration such as 1s`},
		{"WORKER_FORWARDER_INTERVAL", "0s", `must be at least 100ms: each interval runs a Redis script per queue`},
		{"WORKER_FORWARDER_INTERVAL", "1ns", `must be at least 100ms: each interval runs a Redis script per queue`},
		{"WORKER_FORWARDER_INTERVAL", "99ms", `must be at least 100ms: `},
		{"WORKER_LOG_INTERVAL", "fast", `not a Go duration such as 1s`},
		{"WORKER_LOG_INTERVAL", "0", `must be at least 100ms: shorter intervals flood the log`},
		{"WORKER_LOG_INTERVAL", "1ns", `must be at least 100ms: shorter intervals flood the log`},
		{"WORKER_LOG_MAX_LINES", "0", `must be at least 1`},
		{"WORKER_SHUTDOWN_TIMEOUT", "0", `must be at least 1s: running tasks get this long to finish at shutdown`},
		{"WORKER_SHUTDOWN_TIMEOUT", "999ms", `must be at least 1s: running tasks get this long to finish at shutdown`},
		{"WORKER_SHUTDOWN_TIMEOUT", "30", `not a Go duration such as 1s`},
		{"WORKER_LOG_MAX_LINES", "many", `not an integer`},
		{"METRICS_TENANT_LABEL", "yes please", `not a boolean (true or false)`},
		{"METRICS_MAX_TENANTS", "0", `must be at least 1`},
		{"WORKER_WORK_TIME", "-1ms", `must not be negative`},
		{"WORKER_QUEUES", "default", `queue "default": want queue:priority`},
		{"WORKER_QUEUES", "default:high", `queue "default": priority "high" is not an integer >= 1`},
		{"WORKER_QUEUES", "default:0", `queue "default": priority "0" is not an integer >= 1`},
		{"WORKER_QUEUES", "default:1,default:2", `queue "default" is listed twice`},
		{"WORKER_QUEUES", "", `no queue`},
		{"THROTTLE_CLOCK", "ntp", `want local or redis`},
		{"THROTTLE_MAX_SKEW", "0s", `must be positive`},
		{"THROTTLE_MAX_SKEW", "soon", `not a Go duration such as 1s`},
		{"THROTTLE_MIN_REPLICAS", "-1", `must not be negative`},
		{"THROTTLE_REPLICA_TIMEOUT", "0s", `want 1ms or more and under 5s`},
		{"THROTTLE_REPLICA_TIMEOUT", "5s", `want 1ms or more and under 5s`},
		{"THROTTLE_FAIL_OPEN", "maybe", `not a boolean (true or false)`},
		{"METRICS_ADDR", "9090", `want host:port`},
		{"THROTTLE_TENANT_HEADER", "", `must not be empty`},
		{"THROTTLE_PREFIX", "a{b}", `must not contain '{' or '}'`},
		{"THROTTLE_PREFIX", "throttle:enqueue", `producer: prefix "throttle:enqueue": its last ':'-separated segment is "enqueue", which enqueue quotas put after the workers' prefix ("<prefix>:enqueue:{<task type>}:..."): a worker's keys under it would be enqueue quotas' keys; choose another`},
		{"DEMO_API_URL", "localhost:8080", `want an http:// or https:// URL`},
	}
	for _, tc := range tests {
		t.Run(tc.name+"="+tc.value, func(t *testing.T) {
			clearEnv(t, tc.name, tc.value)
			_, err := loadConfig()
			if err == nil {
				t.Fatalf("%s=%q: no error", tc.name, tc.value)
			}
			prefix := tc.name + `="` + tc.value + `": `
			if msg := err.Error(); !strings.HasPrefix(msg, prefix) || !strings.Contains(msg, tc.problem) {
				t.Errorf("error %q\nwant it to start with %q and contain %q", msg, prefix, tc.problem)
			}
		})
	}
}

// TestLoadConfig_redisenv checks that the REDIS_* variables are read, and checked, by
// package redisenv.
func TestLoadConfig_redisenv(t *testing.T) {
	clearEnv(t, "REDIS_DB", "five")
	_, err := loadConfig()
	if err == nil || err.Error() != `redisenv: REDIS_DB="five": not an integer` {
		t.Errorf("got %v", err)
	}
}

func TestRules_Decode(t *testing.T) {
	var r Rules
	if err := r.Decode("email:send  tenant=100/1h tenant=10/1m"); err != nil {
		t.Fatal(err)
	}
	want := Rules{{TaskType: "email:send", Quotas: []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.PerHour(100)},
		{Scope: throttle.ScopeTenant, Limit: throttle.PerMinute(10)}}}}
	if !reflect.DeepEqual(r, want) || r[0].String() != "email:send tenant=100/1h tenant=10/1m" {
		t.Errorf("got %v", r)
	}
}

// TestLoadConfig_bounds checks that each lower bound itself is accepted.
func TestLoadConfig_bounds(t *testing.T) {
	clearEnv(t, "WORKER_FORWARDER_INTERVAL", "100ms", "WORKER_LOG_INTERVAL", "100ms",
		"WORKER_LOG_MAX_LINES", "1", "METRICS_MAX_TENANTS", "1", "METRICS_ADDR", ":9090",
		"WORKER_SHUTDOWN_TIMEOUT", "1s")
	c, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	if c.ForwarderInterval != 100*time.Millisecond || c.LogInterval != 100*time.Millisecond ||
		c.LogMaxLines != 1 || c.MetricsMaxTenants != 1 || c.MetricsAddr != ":9090" || c.ShutdownTimeout != time.Second {
		t.Errorf("got %+v", c)
	}
}

// TestRedisUsage_matchesRedisenv checks that the -h descriptions of the REDIS_* variables
// name exactly the variables redisenv.Config reads, in its order, with its defaults.
func TestRedisUsage_matchesRedisenv(t *testing.T) {
	type tags struct{ key, def string }
	read := func(v any) []tags {
		var out []tags
		rt := reflect.TypeOf(v)
		for i := range rt.NumField() {
			f := rt.Field(i)
			if key := f.Tag.Get("envconfig"); key != "" {
				out = append(out, tags{key, f.Tag.Get("default")})
			}
		}
		return out
	}
	got, want := read(redisUsage{}), read(redisenv.Config{})
	if !reflect.DeepEqual(got, want) {
		t.Errorf("redisUsage variables %v, want redisenv.Config's %v", got, want)
	}
	rt := reflect.TypeOf(redisUsage{})
	for i := range rt.NumField() {
		if rt.Field(i).Tag.Get("desc") == "" {
			t.Errorf("redisUsage.%s has no desc", rt.Field(i).Name)
		}
	}
}

// TestAsynqConfig: WORKER_SHUTDOWN_TIMEOUT is asynq's ShutdownTimeout (asynq's own default,
// 8s, would cut off a longer task at SIGTERM), beside the other settings the worker maps.
func TestAsynqConfig(t *testing.T) {
	clearEnv(t, "WORKER_SHUTDOWN_TIMEOUT", "45s", "WORKER_CONCURRENCY", "7", "WORKER_FORWARDER_INTERVAL", "300ms")
	cfg, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	ac := asynqConfig(cfg, io.Discard)
	if ac.ShutdownTimeout != 45*time.Second || ac.Concurrency != 7 || ac.DelayedTaskCheckInterval != 300*time.Millisecond ||
		!reflect.DeepEqual(ac.Queues, map[string]int{"default": 1}) || ac.LogLevel != asynq.WarnLevel {
		t.Errorf("asynq.Config: ShutdownTimeout %s Concurrency %d DelayedTaskCheckInterval %s Queues %v LogLevel %v; "+
			"want 45s 7 300ms map[default:1] warn", ac.ShutdownTimeout, ac.Concurrency, ac.DelayedTaskCheckInterval, ac.Queues, ac.LogLevel)
	}
}

// TestConcurrencyAdvice: tenant=20/1s needs 20 x 2 s + 1 = 41 workers (40 waiting, one
// left for tasks due now): with 3 the worker warns and names 41; tenant=5/2s type=2/1s
// binds one tenant at 2/s (the smaller), which 10 workers keep up with; so does the
// default rule, tenant=5/2s. A shadow rule and a cost rule get no advice.
func TestConcurrencyAdvice(t *testing.T) {
	var rules Rules
	if err := rules.Decode("api:call tenant=20/1s; mail:send tenant=5/2s type=2/1s"); err != nil {
		t.Fatal(err)
	}
	got := concurrencyAdvice(rules, 3, 2*time.Second)
	want := []string{
		"warning: rule api:call tenant=20/1s admits one tenant at up to 20/s, and a task waits up to 2s for its slot in its handler; " +
			"WORKER_CONCURRENCY=3 lets 2 wait: expect fewer runs than the limit and repeated denials, " +
			"or set WORKER_CONCURRENCY to 41 or more (README, the concurrency rule)",
		"warning: rule mail:send tenant=5/2s type=2/1s admits one tenant at up to 2/s, and a task waits up to 2s for its slot in its handler; " +
			"WORKER_CONCURRENCY=3 lets 2 wait: expect fewer runs than the limit and repeated denials, " +
			"or set WORKER_CONCURRENCY to 5 or more (README, the concurrency rule)",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("concurrency 3:\n got %q\nwant %q", got, want)
	}
	if got := concurrencyAdvice(rules[1:], 10, 2*time.Second); len(got) != 0 {
		t.Errorf("mail:send at concurrency 10: %q, want no warning", got)
	}
	// A shadow rule's tasks never wait; a cost rule counts cost units, not tasks.
	var quiet Rules
	if err := quiet.Decode("api:call tenant=100/1s mode=shadow; llm:complete tenant=40000/1m cost=header:tokens"); err != nil {
		t.Fatal(err)
	}
	if got := concurrencyAdvice(quiet, 3, 2*time.Second); len(got) != 0 {
		t.Errorf("a shadow rule and a cost rule at concurrency 3: %q, want no warning", got)
	}
	clearEnv(t)
	c, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	if got := concurrencyAdvice(c.Rules, c.Concurrency, 2*time.Second); len(got) != 0 {
		t.Errorf("the defaults: %q, want no warning", got)
	}
}

// TestConnectedReplicas: a server alone has 0 replicas connected; once one has attached
// (replicaof), 1; a server that is down cannot tell.
func TestConnectedReplicas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartServer(t)
	rdb := srv.Client()
	if n, ok := connectedReplicas(ctx, rdb); n != 0 || !ok {
		t.Errorf("alone: %d, %v; want 0, true", n, ok)
	}
	host, port, _ := strings.Cut(srv.Addr, ":")
	redistest.StartServer(t, "--replicaof", host, port)
	deadline := time.Now().Add(10 * time.Second)
	for n, _ := connectedReplicas(ctx, rdb); n != 1; n, _ = connectedReplicas(ctx, rdb) {
		if time.Now().After(deadline) {
			t.Fatalf("with a replica: %d connected after 10s, want 1", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	down := redistest.StartServer(t)
	dc := down.Client()
	down.Stop()
	if n, ok := connectedReplicas(ctx, dc); ok {
		t.Errorf("down: %d, true; want false", n)
	}
}

// TestQueues_Decode_colonInName: a queue name may hold ':' (asynq allows it, and
// cmd/enqueue -queue a:b fills one); its priority follows the last ':'.
func TestQueues_Decode_colonInName(t *testing.T) {
	var q Queues
	if err := q.Decode("a:b:3, default:1,x:y:z: 2"); err != nil {
		t.Fatal(err)
	}
	if want := (Queues{"a:b": 3, "default": 1, "x:y:z": 2}); !reflect.DeepEqual(q, want) {
		t.Errorf("Decode = %v, want %v", q, want)
	}
	if s := q.String(); s != "a:b:3,x:y:z:2,default:1" {
		t.Errorf("String() = %q, want a:b:3,x:y:z:2,default:1 (Decode reads it back)", s)
	}
	if err := q.Decode("a:b"); err == nil || err.Error() != `queue "a": priority "b" is not an integer >= 1` {
		t.Errorf(`Decode("a:b") = %v, want queue "a": priority "b" is not an integer >= 1`, err)
	}
}
