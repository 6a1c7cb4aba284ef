package worker_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// lockedBuffer is a bytes.Buffer safe for a logger's writes from several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// textLogger returns a slog text logger at Debug level without the time attribute, so that
// its lines can be compared whole, and what it writes.
func textLogger() (*slog.Logger, *lockedBuffer) {
	var buf lockedBuffer
	return slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey && len(groups) == 0 {
				return slog.Attr{}
			}
			return a
		},
	})), &buf
}

// The lines New logs about Redis's maxmemory-policy.
const (
	evictionWarning = `level=WARN msg="throttle: Redis maxmemory-policy is not noeviction: a full Redis evicts the limiter's window logs ` +
		`(volatile-* policies first, as all of them have a TTL; allkeys-* asynq's tasks too), and throttled tasks run over their limits"`
	evictionUnknown = `level=INFO msg="throttle: could not read Redis maxmemory-policy (managed Redis services often rename or forbid CONFIG): ` +
		`make sure it is noeviction, or a full Redis evicts the limiter's window logs and throttled tasks run over their limits"`
)

// TestNew_evictionPolicy starts a real redis-server per case and builds the middleware on
// it: New reads maxmemory-policy and logs exactly one line, and sets
// asynq_throttle_eviction_policy_unsafe, unless the policy is noeviction (no line, 0).
// With CONFIG renamed away or forbidden by ACL, as managed Redis services do, it logs
// once that it could not check, leaves the gauge at 0, and New still succeeds. The same
// holds through a Sentinel failover client and a cluster client, which checks every node.
// Config.NoEvictionCheck skips the check.
func TestNew_evictionPolicy(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		start      func(t *testing.T) redis.UniversalClient
		wantPolicy string // CheckEvictionPolicy's policy; "" with an error
		wantLog    string // New's whole log; with wantPrefix, its start, and one line
		wantPrefix bool   // Redis's own error text differs between versions
		wantGauge  float64
		noCheck    bool // Config.NoEvictionCheck
	}{
		{
			name:       "noeviction",
			start:      func(t *testing.T) redis.UniversalClient { return redistest.Start(t) },
			wantPolicy: "noeviction",
		},
		{
			name: "allkeys-lru",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartServer(t, "--maxmemory-policy", "allkeys-lru").Client()
			},
			wantPolicy: "allkeys-lru",
			wantLog:    evictionWarning + " policy=allkeys-lru maxmemory=0\n",
			wantGauge:  1,
		},
		{
			name: "allkeys-lru, NoEvictionCheck",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartServer(t, "--maxmemory-policy", "allkeys-lru").Client()
			},
			noCheck:    true,
			wantPolicy: "allkeys-lru", // CheckEvictionPolicy itself still reads it
		},
		{
			name: "volatile-lru with maxmemory 100mb",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartServer(t, "--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru").Client()
			},
			wantPolicy: "volatile-lru",
			wantLog:    evictionWarning + " policy=volatile-lru maxmemory=104857600\n",
			wantGauge:  1,
		},
		{
			name: "CONFIG renamed",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartServer(t, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "").Client()
			},
			wantLog:    evictionUnknown + ` err="CONFIG GET maxmemory*: ERR unknown command 'config'`,
			wantPrefix: true,
		},
		{
			name: "CONFIG forbidden by ACL",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartServer(t, "--maxmemory-policy", "allkeys-lru",
					"--user", "default", "on", "nopass", "~*", "&*", "+@all", "-config").Client()
			},
			wantLog:    evictionUnknown + ` err="CONFIG GET maxmemory*: NOPERM `,
			wantPrefix: true,
		},
		{
			name: "Sentinel allkeys-lfu",
			start: func(t *testing.T) redis.UniversalClient {
				return redistest.StartSentinel(t, "--maxmemory-policy", "allkeys-lfu").Client()
			},
			wantPolicy: "allkeys-lfu",
			wantLog:    evictionWarning + " policy=allkeys-lfu maxmemory=0\n",
			wantGauge:  1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rdb := tc.start(t)
			reg := prometheus.NewRegistry()
			metrics, err := worker.NewMetrics(reg)
			if err != nil {
				t.Fatal(err)
			}
			log, buf := textLogger()
			if _, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "ev:call tenant=5/1m"), Redis: rdb,
				Logger: log, Metrics: metrics, SweepInterval: -1, NoEvictionCheck: tc.noCheck}); err != nil {
				t.Fatalf("New: %v", err)
			}
			got := buf.String()
			if tc.wantPrefix && (!strings.HasPrefix(got, tc.wantLog) || strings.Count(got, "\n") != 1 || !strings.HasSuffix(got, "\"\n")) ||
				!tc.wantPrefix && got != tc.wantLog {
				t.Errorf("New logged:\n%s\nwant (prefix %t):\n%s", got, tc.wantPrefix, tc.wantLog)
			}
			if got := gauge(t, reg, "asynq_throttle_eviction_policy_unsafe", nil); got != tc.wantGauge {
				t.Errorf("asynq_throttle_eviction_policy_unsafe = %g, want %g", got, tc.wantGauge)
			}
			policy, err := worker.CheckEvictionPolicy(context.Background(), rdb, slog.New(slog.DiscardHandler), nil)
			if policy != tc.wantPolicy || (err != nil) != (tc.wantPolicy == "") {
				t.Errorf("CheckEvictionPolicy = %q, %v; want %q", policy, err, tc.wantPolicy)
			}
		})
	}
}

// TestNew_evictionPolicyCluster: on a 3-master cluster whose second master alone runs
// volatile-ttl, New reads every node and warns once, naming that node.
func TestNew_evictionPolicyCluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	node := redis.NewClient(&redis.Options{Addr: c.Addrs[1]})
	defer node.Close()
	if err := node.ConfigSet(context.Background(), "maxmemory-policy", "volatile-ttl").Err(); err != nil {
		t.Fatal(err)
	}
	rdb := c.Client()
	reg := prometheus.NewRegistry()
	metrics, err := worker.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	log, buf := textLogger()
	if _, err := worker.New(newLimiter(t, rdb), worker.Config{Rules: mustRules(t, "ev:call tenant=5/1m"), Redis: rdb,
		Logger: log, Metrics: metrics, SweepInterval: -1}); err != nil {
		t.Fatalf("New: %v", err)
	}
	if got, want := buf.String(), evictionWarning+" policy=volatile-ttl maxmemory=0 nodes="+c.Addrs[1]+"\n"; got != want {
		t.Errorf("New logged:\n%s\nwant:\n%s", got, want)
	}
	if got := gauge(t, reg, "asynq_throttle_eviction_policy_unsafe", nil); got != 1 {
		t.Errorf("asynq_throttle_eviction_policy_unsafe = %g, want 1", got)
	}
}

// limiterKey matches every key a Limiter with the default prefix writes, and names its
// kind (the part after the hash tag, tenant ids dropped): window logs, their pending and
// cost sets, a type's leases, fair tags and fair state, and locks.
var limiterKey = regexp.MustCompile(`^throttle:\{[^{}]+\}:(type|tenant|pending:type|pending:tenant|costs:type|costs:tenant|leases|fair|fairstate|lock)(:[^{}]*)?$`)

// TestWorker_throttleKeysAllExpire runs a mix of decisions through a real asynq server,
// the limiter on a Redis of its own: admissions, denials with reservations (held, and
// given up by an overdue task), weighted costs (cost=header:cost), weights of a type-wide
// quota (WeightFunc), tenant and type quotas, copies of tasks with no retry left, and the
// sweeper's lock. Then SCAN finds every key in the limiter's database, and PTTL says each
// has a TTL: no key of the throttle ever has none (-1), so a volatile-* maxmemory-policy
// evicts them before asynq's, and a forgotten one goes away by itself. Every kind of key
// must have been written, or the test shows less than it should; asynq's Redis holds
// none of them.
func TestWorker_throttleKeysAllExpire(t *testing.T) {
	t.Parallel()
	limRDB := redistest.Start(t)
	asynqRDB := redistest.Start(t)
	rules := mustRules(t, "ttl:call tenant=3/1m type=5/1m cost=header:cost; ttl:late tenant=1/1m max-delay=1s overdue=drop")
	var decided sync.Map // task id -> true
	log, logged := textLogger()
	mw, err := worker.New(newLimiter(t, limRDB), worker.Config{
		Rules: rules, Redis: asynqRDB, SweepInterval: 100 * time.Millisecond, Logger: log,
		WeightFunc: func(k throttle.Key) int {
			if k.Tenant == "acme" {
				return 2
			}
			return 1
		},
		DecisionFunc: func(ctx context.Context, _ *asynq.Task, _ throttle.Key, _ throttle.Decision) {
			id, _ := asynq.GetTaskID(ctx)
			decided.Store(id, true)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	runAsynq(t, asynqRDB, mw, func(context.Context, *asynq.Task) error { return nil }, nil)
	client := asynq.NewClientFromRedisClient(asynqRDB)
	n := 0
	enqueue := func(taskType, tenant string, cost, maxRetry int) {
		t.Helper()
		n++
		headers := map[string]string{producer.TenantHeader: tenant}
		if cost > 1 {
			headers["cost"] = strconv.Itoa(cost)
		}
		task := asynq.NewTaskWithHeaders(taskType, nil, headers)
		if _, err := client.Enqueue(task, asynq.TaskID(fmt.Sprintf("task-%d", n)), asynq.MaxRetry(maxRetry)); err != nil {
			t.Fatal(err)
		}
	}
	for _, tenant := range []string{"acme", "globex", "initech"} {
		enqueue("ttl:call", tenant, 2, 3)
		enqueue("ttl:call", tenant, 1, 3)
		enqueue("ttl:call", tenant, 1, 0) // denied: replaced by a copy
	}
	enqueue("ttl:late", "acme", 1, 3)
	enqueue("ttl:late", "acme", 1, 3) // a minute away, over max-delay: dropped, its reservation cancelled
	waitUntil(t, 15*time.Second, "every task decided, none pending or running", func() bool {
		count := 0
		decided.Range(func(any, any) bool { count++; return true })
		qi := queueInfo(asynq.NewInspectorFromRedisClient(asynqRDB))
		return count >= n && qi.Pending == 0 && qi.Active == 0
	})
	if !strings.Contains(logged.String(), `msg="throttle: task overdue: would wait`) {
		t.Errorf("no task was overdue, so no reservation was cancelled: the test shows less than it should; log:\n%s", logged)
	}
	waitUntil(t, 5*time.Second, "the sweeper took its lock", func() bool {
		keys, _ := limRDB.Keys(context.Background(), "throttle:*:lock:*").Result()
		return len(keys) > 0
	})

	ctx := context.Background()
	kinds := map[string]int{}
	it := limRDB.Scan(ctx, 0, "*", 100).Iterator()
	for it.Next(ctx) {
		k := it.Val()
		m := limiterKey.FindStringSubmatch(k)
		if m == nil {
			t.Errorf("key %q in the limiter's Redis is not one of the limiter's", k)
			continue
		}
		kinds[m[1]]++
		if ttl, err := limRDB.PTTL(ctx, k).Result(); err != nil || ttl <= 0 {
			t.Errorf("PTTL %s = %v, %v; want > 0", k, ttl, err)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	for _, kind := range []string{"type", "tenant", "pending:type", "pending:tenant", "costs:type", "costs:tenant", "leases", "fair", "fairstate", "lock"} {
		if kinds[kind] == 0 {
			t.Errorf("no key of kind %q was written (keys by kind: %v): the test shows less than it should", kind, kinds)
		}
	}
	if keys, err := asynqRDB.Keys(ctx, "throttle:*").Result(); err != nil || len(keys) != 0 {
		t.Errorf("asynq's Redis holds the limiter's keys %q (%v); want none", keys, err)
	}
}

// TestEviction_maxmemoryPolicy shows what a full Redis does to the limiter under each
// kind of policy, with "tenant=5/60s" decided at explicit instants and 5 asynq tasks
// waiting in the same Redis. Five admissions at t=0..4s fill acme's minute. Then maxmemory
// drops to 1 byte, below anything Redis holds:
//   - volatile-lru evicts every key that has a TTL, which is every key of the limiter and
//     none of asynq's (its queues and task hashes have none): the 5 tasks still wait, and
//     once memory is back acme gets 5 more at t=5..9s: 10 runs in 60s against a limit of
//     5. The limiter's state is what a full Redis sacrifices first.
//   - noeviction evicts nothing: a denial, which writes nothing, is still decided (acme
//     waits until t=60s), an admission, which must write, fails with Redis's OOM error (the
//     worker fails closed on it), and acme never gets a sixth run in the minute.
func TestEviction_maxmemoryPolicy(t *testing.T) {
	t.Parallel()
	q := throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 5, Window: time.Minute}}
	req := func(tenant string) throttle.Request {
		return throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: tenant}, Quotas: []throttle.Quota{q}}
	}
	// decide decides req at at (ms) and returns an outcome to compare with ==.
	type result struct {
		Allowed          bool
		Count, Remaining int
		RetryAfter       time.Duration
		At               int64
	}
	decide := func(t *testing.T, lim *throttle.Limiter, r throttle.Request, at int64) (result, error) {
		t.Helper()
		d, err := lim.AllowAt(context.Background(), r, time.UnixMilli(at))
		return result{d.Allowed, d.Count, d.Remaining, d.RetryAfter, d.At.UnixMilli()}, err
	}
	admitted := func(count int, at int64) result { return result{true, count, 5 - count, 0, at} }
	denied := func(retry time.Duration, at int64) result { return result{false, 5, 0, retry, at} }

	for _, policy := range []string{"volatile-lru", "noeviction"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			srv := redistest.StartServer(t, "--maxmemory-policy", policy)
			rdb := srv.Client()
			lim := newLimiter(t, rdb)
			client := asynq.NewClientFromRedisClient(rdb)
			for i := range 5 {
				if _, err := client.Enqueue(producer.NewTask("api:call", nil, "acme"), asynq.TaskID(fmt.Sprintf("waiting-%d", i))); err != nil {
					t.Fatal(err)
				}
			}
			var runs []time.Time // acme's admissions
			for i := range 5 {
				at := int64(i) * 1000
				if got, err := decide(t, lim, req("acme"), at); err != nil || got != admitted(i+1, at) {
					t.Fatalf("t=%dms: %+v, %v; want %+v", at, got, err, admitted(i+1, at))
				}
				runs = append(runs, time.UnixMilli(at))
			}
			if got, err := decide(t, lim, req("acme"), 4500); err != nil || got != denied(55500*time.Millisecond, 4500) {
				t.Fatalf("t=4500ms: %+v, %v; want denied until t=60s", got, err)
			}
			asynqKeys, err := rdb.Keys(ctx, "asynq:*").Result()
			if err != nil {
				t.Fatal(err)
			}
			limiterKeys, err := rdb.Keys(ctx, "throttle:*").Result()
			if err != nil || len(limiterKeys) == 0 || len(asynqKeys) < 5 {
				t.Fatalf("keys: %d of the limiter's, %d of asynq's (%v); want some of each", len(limiterKeys), len(asynqKeys), err)
			}

			if err := rdb.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
				t.Fatal(err)
			}
			if policy == "volatile-lru" {
				// Redis evicts before each command until it is under maxmemory or has nothing
				// it may evict left.
				waitUntil(t, 5*time.Second, "the limiter's keys are evicted", func() bool {
					keys, err := rdb.Keys(ctx, "throttle:*").Result()
					return err == nil && len(keys) == 0
				})
				if got := infoField(t, rdb, "stats", "evicted_keys"); got != strconv.Itoa(len(limiterKeys)) {
					t.Errorf("evicted_keys = %s, want %d: every key of the limiter and no other", got, len(limiterKeys))
				}
			} else {
				if got, err := decide(t, lim, req("acme"), 5000); err != nil || got != denied(55*time.Second, 5000) {
					t.Errorf("acme at t=5s, memory full: %+v, %v; want denied until t=60s", got, err)
				}
				if got, err := decide(t, lim, req("globex"), 5000); err == nil || !strings.HasPrefix(err.Error(), "throttle: ") || !strings.Contains(err.Error(), "OOM command not allowed") || got.Allowed {
					t.Errorf("globex at t=5s, memory full: %+v, %v; want Redis's OOM error, not an admission", got, err)
				}
				if got := infoField(t, rdb, "stats", "evicted_keys"); got != "0" {
					t.Errorf("evicted_keys = %s, want 0", got)
				}
				for _, k := range limiterKeys {
					if n, err := rdb.Exists(ctx, k).Result(); err != nil || n != 1 {
						t.Errorf("the limiter's key %s is gone (%d, %v)", k, n, err)
					}
				}
			}
			for _, k := range asynqKeys {
				if n, err := rdb.Exists(ctx, k).Result(); err != nil || n != 1 {
					t.Errorf("asynq's key %s is gone (%d, %v)", k, n, err)
				}
			}
			if err := rdb.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
				t.Fatal(err)
			}
			if qi, err := asynq.NewInspectorFromRedisClient(rdb).GetQueueInfo("default"); err != nil || qi.Pending != 5 {
				t.Errorf("asynq's queue: %+v, %v; want the 5 tasks pending", qi, err)
			}

			// Memory is back: acme asks at t=5..9s.
			for i := range 5 {
				at := 5000 + int64(i)*1000
				got, err := decide(t, lim, req("acme"), at)
				if err != nil {
					t.Fatal(err)
				}
				want := denied(60*time.Second-time.Duration(at)*time.Millisecond, at) // the minute is full until t=60s
				if policy == "volatile-lru" {
					want = admitted(i+1, at) // the minute is forgotten
				}
				if got != want {
					t.Errorf("t=%dms: %+v, want %+v", at, got, want)
				}
				if got.Allowed {
					runs = append(runs, time.UnixMilli(at))
				}
			}
			wantRuns := map[string]int{"volatile-lru": 10, "noeviction": 5}[policy]
			if got := throttle.MaxInWindow(runs, time.Minute); got != wantRuns {
				t.Errorf("acme: most admissions in a 60s window = %d, want %d", got, wantRuns)
			}
		})
	}
}

// infoField reads one field of INFO section.
func infoField(t *testing.T, rdb *redis.Client, section, field string) string {
	t.Helper()
	info, err := rdb.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	t.Fatalf("INFO %s has no field %s", section, field)
	return ""
}
