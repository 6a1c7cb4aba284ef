package redistest

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
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

// Cluster is a Redis Cluster, each node a redis-server process on a free loopback port
// with persistence off, started by StartCluster or StartClusterWith and killed by
// t.Cleanup. It is for tests of code that must keep every key of one call in one hash
// slot (a script whose keys span slots fails on it with CROSSSLOT), and, with replicas, of
// code that must ride out a change of the cluster under it: a primary killed and its
// replica promoted (Kill, WaitPromoted), a slot moved between primaries (StartMigration),
// the script cache flushed on every node (ScriptFlush).
type Cluster struct {
	// Addrs are the masters' addresses, "127.0.0.1:<port>", in the order they were
	// started. redis-cli --cluster create gives them consecutive ranges of the 16384 slots
	// in that order: with 3 masters, 0-5460, 5461-10922 and 10923-16383.
	Addrs []string
	// Replicas lists, for each master in Addrs (same index), the addresses of its
	// replicas at the start; empty without replicas.
	Replicas [][]string

	tb    testing.TB
	nodes map[string]*Server // every node, masters and replicas, by address
}

// ClusterConfig configures StartClusterWith.
type ClusterConfig struct {
	// Masters is the number of primaries, at least 3 (as redis-cli requires).
	Masters int
	// ReplicasPerMaster is the number of replicas of each primary. Defaults to 0.
	ReplicasPerMaster int
	// NodeTimeout is every node's cluster-node-timeout: how long a node must not answer
	// before the others flag it as failing, after which one of its replicas is promoted.
	// Defaults to 5s; whole milliseconds.
	NodeTimeout time.Duration
	// PinCPU, when Pin is set, binds every node to that CPU core (as StartServerPinned
	// does), so that a benchmark gives the whole cluster the core a single node gets.
	PinCPU int
	// Pin turns PinCPU on. Without taskset, or if it cannot bind, the nodes run unpinned
	// and tb.Logf says why.
	Pin bool
}

// StartCluster starts masters redis-server processes (at least 3, as redis-cli requires)
// with cluster mode on, joins them with redis-cli --cluster create, no replicas, and waits
// until every node reports cluster_state:ok with all 16384 slots assigned. t.Cleanup
// kills the servers. The test fails, saying why, if redis-server or redis-cli is not on
// PATH or the cluster is not up within 30s.
func StartCluster(tb testing.TB, masters int) *Cluster {
	tb.Helper()
	return StartClusterWith(tb, ClusterConfig{Masters: masters})
}

// StartClusterWith starts a cluster as StartCluster does, then cfg.ReplicasPerMaster
// replicas of each master: each meets the cluster (CLUSTER MEET) and replicates its master
// (CLUSTER REPLICATE), so which replica serves which master is fixed (Replicas), not
// redis-cli's choice. It returns once every node knows every other, reports
// cluster_state:ok with all 16384 slots ok, and every master has all its replicas online
// in sync. The test fails, saying why, if redis-server or redis-cli is not on PATH or the
// cluster is not up within 30s.
func StartClusterWith(tb testing.TB, cfg ClusterConfig) *Cluster {
	tb.Helper()
	if cfg.Masters < 3 {
		tb.Fatalf("redistest: StartCluster(%d): redis-cli --cluster create needs at least 3 masters", cfg.Masters)
	}
	if cfg.ReplicasPerMaster < 0 {
		tb.Fatalf("redistest: StartClusterWith: %d replicas per master", cfg.ReplicasPerMaster)
	}
	timeout := cfg.NodeTimeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	var runner []string
	if cfg.Pin {
		var err error
		if runner, err = tasksetRunner(cfg.PinCPU); err != nil {
			tb.Logf("redistest: cluster NOT pinned to CPU %d: %v", cfg.PinCPU, err)
		}
	}
	cli := lookPathOf(tb, "redis-cli")
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout)
	defer cancel()

	c := &Cluster{tb: tb, nodes: map[string]*Server{}}
	start := func() *Server {
		s := startServerWith(tb, freeClusterPort, runner, func(s *Server) []string {
			return []string{"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(s.dir, fmt.Sprintf("nodes-%d.conf", s.port)),
				"--cluster-node-timeout", strconv.FormatInt(timeout.Milliseconds(), 10)}
		})
		c.nodes[s.Addr] = s
		return s
	}
	for range cfg.Masters {
		c.Addrs = append(c.Addrs, start().Addr)
	}

	args := append(append([]string{"--cluster", "create"}, c.Addrs...), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		tb.Fatalf("redistest: redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	if cfg.ReplicasPerMaster > 0 {
		c.Replicas = make([][]string, cfg.Masters)
		for i, master := range c.Addrs {
			for range cfg.ReplicasPerMaster {
				r := start()
				if err := c.replicate(ctx, r.Addr, master); err != nil {
					tb.Fatalf("redistest: replica %s of %s: %v", r.Addr, master, err)
				}
				c.Replicas[i] = append(c.Replicas[i], r.Addr)
			}
		}
	}
	if err := c.waitUp(ctx, cfg.Masters, cfg.ReplicasPerMaster); err != nil {
		tb.Fatalf("redistest: cluster %v did not come up within %s: %v", c.Addrs, clusterTimeout, err)
	}
	return c
}

// replicate makes the empty node at addr meet the cluster through master and replicate
// it, once it knows master's node id (CLUSTER REPLICATE needs that).
func (c *Cluster) replicate(ctx context.Context, addr, master string) error {
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer rdb.Close()
	id, err := c.nodeID(ctx, master)
	if err != nil {
		return err
	}
	host, port, _ := net.SplitHostPort(master)
	p, _ := strconv.Atoi(port)
	if err := rdb.ClusterMeet(ctx, host, strconv.Itoa(p)).Err(); err != nil {
		return fmt.Errorf("CLUSTER MEET %s: %w", master, err)
	}
	for {
		err := rdb.Do(ctx, "CLUSTER", "REPLICATE", id).Err()
		if err == nil {
			return nil
		}
		// "ERR Unknown node": the handshake with master has not finished yet.
		if !strings.Contains(err.Error(), "Unknown node") {
			return fmt.Errorf("CLUSTER REPLICATE %s: %w", id, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("CLUSTER REPLICATE %s: %v (%w)", id, err, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Client returns a new client for the cluster, seeded with every master, closed by
// t.Cleanup.
func (c *Cluster) Client() *redis.ClusterClient {
	return c.ClientWith(&redis.ClusterOptions{})
}

// ClientWith returns a new client for the cluster with opt, its Addrs set to the
// masters', closed by t.Cleanup.
func (c *Cluster) ClientWith(opt *redis.ClusterOptions) *redis.ClusterClient {
	o := *opt
	o.Addrs = slices.Clone(c.Addrs)
	rdb := redis.NewClusterClient(&o)
	c.tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// waitUp polls CLUSTER INFO on every node until each says the cluster is ok, knows all
// masters and sees all 16384 slots assigned and ok, or ctx ends. It returns the last
// reason to wait on failure.
func (c *Cluster) waitUp(ctx context.Context, masters, replicas int) error {
	addrs := slices.Concat(append([][]string{c.Addrs}, c.Replicas...)...)
	clients := make([]*redis.Client, len(addrs))
	for i, addr := range addrs {
		clients[i] = redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		defer clients[i].Close()
	}
	want := map[string]string{
		"cluster_state":          "ok",
		"cluster_slots_assigned": "16384",
		"cluster_slots_ok":       "16384",
		"cluster_known_nodes":    strconv.Itoa(masters * (1 + replicas)),
		"cluster_size":           strconv.Itoa(masters),
	}
	for {
		notYet := ""
	nodes:
		for i, rdb := range clients {
			info, err := rdb.ClusterInfo(ctx).Result()
			if err != nil {
				notYet = fmt.Sprintf("%s: CLUSTER INFO: %v", addrs[i], err)
				break
			}
			got := parseInfo(info)
			for field, v := range want {
				if got[field] != v {
					notYet = fmt.Sprintf("%s: %s:%s, want %s", addrs[i], field, got[field], v)
					break nodes
				}
			}
		}
		if notYet == "" && replicas > 0 {
			notYet = c.replicasInSync(ctx, clients[:masters], replicas)
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
