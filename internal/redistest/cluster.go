package redistest

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// clusterTimeout bounds StartCluster: if the cluster is not up this long after the first
// server started, the test fails.
const clusterTimeout = 30 * time.Second

// clusterBusOffset is how far above its port a cluster node listens for the cluster bus.
const clusterBusOffset = 10000

// Cluster is a Redis Cluster of masters only (no replicas), each a redis-server process on
// a free loopback port with persistence off, started by StartCluster and killed by
// t.Cleanup. It is for tests of code that must keep every key of one call in one hash
// slot: a script whose keys span slots fails on it with CROSSSLOT.
type Cluster struct {
	// Addrs are the masters' addresses, "127.0.0.1:<port>", in the order they were
	// started. redis-cli --cluster create gives them consecutive ranges of the 16384 slots
	// in that order.
	Addrs []string

	tb testing.TB
}

// StartCluster starts masters redis-server processes (at least 3, as redis-cli requires)
// with cluster mode on, joins them with redis-cli --cluster create, no replicas, and waits
// until every node reports cluster_state:ok with all 16384 slots assigned. t.Cleanup
// kills the servers. The test fails, saying why, if redis-server or redis-cli is not on
// PATH or the cluster is not up within 30s.
func StartCluster(tb testing.TB, masters int) *Cluster {
	tb.Helper()
	if masters < 3 {
		tb.Fatalf("redistest: StartCluster(%d): redis-cli --cluster create needs at least 3 masters", masters)
	}
	cli := lookPathOf(tb, "redis-cli")
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()

	c := &Cluster{tb: tb}
	for range masters {
		s := startServer(tb, freeClusterPort, func(s *Server) []string {
			return []string{"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(s.dir, fmt.Sprintf("nodes-%d.conf", s.port)),
				"--cluster-node-timeout", "5000"}
		})
		c.Addrs = append(c.Addrs, s.Addr)
	}

	args := append(append([]string{"--cluster", "create"}, c.Addrs...), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		tb.Fatalf("redistest: redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	if err := c.waitUp(ctx, masters); err != nil {
		tb.Fatalf("redistest: cluster %v did not come up within %s: %v", c.Addrs, clusterTimeout, err)
	}
	return c
}

// Client returns a new client for the cluster, seeded with every master, closed by
// t.Cleanup.
func (c *Cluster) Client() *redis.ClusterClient {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs})
	c.tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// waitUp polls CLUSTER INFO on every node until each says the cluster is ok, knows all
// masters and sees all 16384 slots assigned and ok, or ctx ends. It returns the last
// reason to wait on failure.
func (c *Cluster) waitUp(ctx context.Context, masters int) error {
	clients := make([]*redis.Client, len(c.Addrs))
	for i, addr := range c.Addrs {
		clients[i] = redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		defer clients[i].Close()
	}
	want := map[string]string{
		"cluster_state":          "ok",
		"cluster_slots_assigned": "16384",
		"cluster_slots_ok":       "16384",
		"cluster_known_nodes":    strconv.Itoa(masters),
		"cluster_size":           strconv.Itoa(masters),
	}
	for {
		notYet := ""
	nodes:
		for i, rdb := range clients {
			info, err := rdb.ClusterInfo(ctx).Result()
			if err != nil {
				notYet = fmt.Sprintf("%s: CLUSTER INFO: %v", c.Addrs[i], err)
				break
			}
			got := parseInfo(info)
			for field, v := range want {
				if got[field] != v {
					notYet = fmt.Sprintf("%s: %s:%s, want %s", c.Addrs[i], field, got[field], v)
					break nodes
				}
			}
		}
		if notYet == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s (%w)", notYet, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// parseInfo splits the "field:value" lines of CLUSTER INFO or INFO.
func parseInfo(info string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			m[k] = v
		}
	}
	return m
}

// freeClusterPort asks the kernel for a free loopback port p whose cluster bus port
// p+10000 is free too (and so at most 65535). Both are released before redis-server binds
// them, so startServer retries if another process takes one meanwhile.
func freeClusterPort(tb testing.TB) int {
	tb.Helper()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatalf("redistest: find a free port: %v", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if port+clusterBusOffset > 65535 {
			ln.Close()
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+clusterBusOffset)))
		ln.Close()
		if err != nil {
			continue
		}
		bus.Close()
		return port
	}
	tb.Fatalf("redistest: found no free port p with p+%d free too in 100 tries", clusterBusOffset)
	return 0
}
