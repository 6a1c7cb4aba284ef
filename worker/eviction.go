package worker

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// NoEviction is the only maxmemory-policy under which Redis never evicts the limiter's
// keys: at maxmemory it refuses writes instead, and the limiter fails closed (the tasks
// wait, see Config.FailOpen). Under any other policy a full Redis evicts keys, and a task
// type whose window log was evicted admits a whole limit again. Every key of the limiter
// has a TTL, so a volatile-* policy evicts the limiter's keys first, before asynq's (its
// queues have none); an allkeys-* policy evicts asynq's tasks too.
const NoEviction = "noeviction"

// evictionCheckTimeout bounds the check New makes of Config.Redis.
const evictionCheckTimeout = 2 * time.Second

// shardedClient is a client of several Redis servers: a *redis.ClusterClient or a
// *redis.Ring.
type shardedClient interface {
	ForEachShard(ctx context.Context, fn func(ctx context.Context, client *redis.Client) error) error
}

// CheckEvictionPolicy reads the maxmemory-policy of the Redis that rdb writes to (CONFIG
// GET maxmemory*: of the node, or the Sentinel master, or every master and replica of a
// cluster) and returns it: NoEviction, or the first other policy found. Unless it is
// NoEviction it logs one warning and sets m.EvictionPolicyUnsafe to 1:
//
//	level=WARN msg="throttle: Redis maxmemory-policy is not noeviction: ..." policy=allkeys-lru maxmemory=0
//
// (on a cluster with nodes=<the addresses of the nodes that are not>). If CONFIG GET fails
// (managed Redis services often rename CONFIG or forbid it by ACL; or Redis is
// unreachable), it logs one line at Info saying it could not check, with the error, and
// returns the error; m is left as it is. log nil means slog.Default(); m may be nil.
//
// New calls it for Config.Redis, within 2s; call it yourself for a limiter that keeps its
// logs on another Redis.
func CheckEvictionPolicy(ctx context.Context, rdb redis.UniversalClient, log *slog.Logger, m *Metrics) (string, error) {
	if log == nil {
		log = slog.Default()
	}
	policy, maxmemory, nodes, err := evictionPolicy(ctx, rdb)
	if err != nil {
		log.Info("throttle: could not read Redis maxmemory-policy (managed Redis services often rename or forbid CONFIG): "+
			"make sure it is noeviction, or a full Redis evicts the limiter's window logs and throttled tasks run over their limits",
			"err", err)
		return "", err
	}
	if policy == NoEviction {
		return policy, nil
	}
	attrs := []any{"policy", policy, "maxmemory", maxmemory}
	if nodes != "" {
		attrs = append(attrs, "nodes", nodes)
	}
	log.Warn("throttle: Redis maxmemory-policy is not noeviction: a full Redis evicts the limiter's window logs "+
		"(volatile-* policies first, as all of them have a TTL; allkeys-* asynq's tasks too), and throttled tasks run over their limits",
		attrs...)
	if m != nil {
		m.EvictionPolicyUnsafe.Set(1)
	}
	return policy, nil
}

// evictionPolicy reads maxmemory-policy and maxmemory of the server rdb writes to, or of
// every shard of a sharded client: it returns NoEviction if all are, else the first other
// policy (by address), that server's maxmemory, and, for a sharded client, the addresses
// of every server that is not NoEviction.
func evictionPolicy(ctx context.Context, rdb redis.UniversalClient) (policy, maxmemory, nodes string, err error) {
	sharded, ok := rdb.(shardedClient)
	if !ok {
		c, err := rdb.ConfigGet(ctx, "maxmemory*").Result()
		if err != nil {
			return "", "", "", fmt.Errorf("CONFIG GET maxmemory*: %w", err)
		}
		return c["maxmemory-policy"], c["maxmemory"], "", nil
	}
	type server struct{ addr, policy, maxmemory string }
	var mu sync.Mutex
	var servers []server
	err = sharded.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		cfg, err := c.ConfigGet(ctx, "maxmemory*").Result()
		if err != nil {
			return fmt.Errorf("CONFIG GET maxmemory* on %s: %w", c.Options().Addr, err)
		}
		mu.Lock()
		defer mu.Unlock()
		servers = append(servers, server{c.Options().Addr, cfg["maxmemory-policy"], cfg["maxmemory"]})
		return nil
	})
	if err != nil {
		return "", "", "", err
	}
	slices.SortFunc(servers, func(a, b server) int { return strings.Compare(a.addr, b.addr) })
	policy = NoEviction
	var unsafe []string
	for _, s := range servers {
		if s.policy != NoEviction {
			if len(unsafe) == 0 {
				policy, maxmemory = s.policy, s.maxmemory
			}
			unsafe = append(unsafe, s.addr)
		}
	}
	return policy, maxmemory, strings.Join(unsafe, ","), nil
}
