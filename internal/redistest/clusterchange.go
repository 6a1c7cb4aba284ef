package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// This file changes a running Cluster under its clients, as an operator or a failure
// would: a node killed and its replica promoted, a slot moved to another master key by
// key, the script cache flushed on every node.

// Node returns the node (master or replica) at addr, as started; the test fails if the
// cluster has no such node.
func (c *Cluster) Node(addr string) *Server {
	c.tb.Helper()
	s := c.nodes[addr]
	if s == nil {
		c.tb.Fatalf("redistest: cluster has no node %s", addr)
	}
	return s
}

// Kill kills the node at addr (SIGKILL, as a crash: nothing it had not yet sent to its
// replicas reaches them). Its port refuses connections from then on; with a replica,
// NodeTimeout later the other masters flag it as failing and the replica is promoted
// (WaitPromoted).
func (c *Cluster) Kill(addr string) {
	c.tb.Helper()
	c.Node(addr).Stop()
}

// live returns the addresses of the nodes still running, masters of Addrs first.
func (c *Cluster) live() []string {
	var addrs []string
	for _, a := range slices.Concat(append([][]string{c.Addrs}, c.Replicas...)...) {
		if c.nodes[a].running() {
			addrs = append(addrs, a)
		}
	}
	return addrs
}

// running reports whether the server's process is up (started and not stopped).
func (s *Server) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil
}

// nodeClient is a client of one node, with no retries, for the caller to close.
func nodeClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
}

// nodeID returns the cluster node id of the node at addr (CLUSTER MYID).
func (c *Cluster) nodeID(ctx context.Context, addr string) (string, error) {
	rdb := nodeClient(addr)
	defer rdb.Close()
	id, err := rdb.Do(ctx, "CLUSTER", "MYID").Text()
	if err != nil {
		return "", fmt.Errorf("CLUSTER MYID on %s: %w", addr, err)
	}
	return id, nil
}

// replication reads INFO replication of rdb.
func replication(ctx context.Context, rdb *redis.Client) (map[string]string, error) {
	info, err := rdb.Info(ctx, "replication").Result()
	if err != nil {
		return nil, err
	}
	return parseInfo(info), nil
}

// replicaAddrs returns the "ip:port" of each replica listed in a master's INFO
// replication, with its state ("online" once in sync).
func replicaAddrs(info map[string]string) map[string]string {
	out := map[string]string{}
	n, _ := strconv.Atoi(info["connected_slaves"])
	for i := range n {
		f := parseList(info["slave"+strconv.Itoa(i)])
		out[net.JoinHostPort(f["ip"], f["port"])] = f["state"]
	}
	return out
}

// replicasInSync returns why the masters do not yet each have n replicas online, or "".
func (c *Cluster) replicasInSync(ctx context.Context, masters []*redis.Client, n int) string {
	for i, m := range masters {
		info, err := replication(ctx, m)
		if err != nil {
			return fmt.Sprintf("%s: INFO replication: %v", c.Addrs[i], err)
		}
		got := replicaAddrs(info)
		for _, r := range c.Replicas[i] {
			if got[r] != "online" {
				return fmt.Sprintf("%s: replica %s is %q, want online (%d of %d connected)", c.Addrs[i], r, got[r], len(got), n)
			}
		}
	}
	return ""
}

// WaitReplicated returns once every replica of every running master has processed all
// that its master had written when WaitReplicated was called (its slave_repl_offset has
// reached the master's master_repl_offset), or ctx ends. Call it when no client writes:
// then a master killed afterwards loses nothing it had acknowledged. (WAIT would do
// for one connection's own writes only, and the test's clients are many.)
func (c *Cluster) WaitReplicated(ctx context.Context) error {
	for _, addr := range c.live() {
		m := nodeClient(addr)
		info, err := replication(ctx, m)
		m.Close()
		if err != nil {
			return fmt.Errorf("%s: INFO replication: %w", addr, err)
		}
		if info["role"] != "master" {
			continue
		}
		want, _ := strconv.ParseInt(info["master_repl_offset"], 10, 64)
		for r := range replicaAddrs(info) {
			if err := waitOffset(ctx, r, want); err != nil {
				return fmt.Errorf("replica %s of %s: %w", r, addr, err)
			}
		}
	}
	return nil
}

// waitOffset polls the replica at addr until its link to its master is up and it has
// processed the replication stream up to offset want.
func waitOffset(ctx context.Context, addr string, want int64) error {
	rdb := nodeClient(addr)
	defer rdb.Close()
	for {
		info, err := replication(ctx, rdb)
		var got int64
		if err == nil {
			got, _ = strconv.ParseInt(info["slave_repl_offset"], 10, 64)
			if info["master_link_status"] == "up" && got >= want {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("offset %d, want %d (%v, %w)", got, want, err, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// WaitPromoted waits until a replica that the master at dead had at the start (Replicas)
// is a master, every running node reports cluster_state:ok, and none of them lists dead
// as serving any slot in CLUSTER SLOTS; it returns that replica's address. Kill dead
// first. It returns an error if dead was not a master at the start or ctx ends first.
func (c *Cluster) WaitPromoted(ctx context.Context, dead string) (string, error) {
	i := slices.Index(c.Addrs, dead)
	if i < 0 || len(c.Replicas) == 0 || len(c.Replicas[i]) == 0 {
		return "", fmt.Errorf("redistest: %s was not a master with replicas at the start", dead)
	}
	for {
		promoted, notYet := c.promoted(ctx, dead, c.Replicas[i])
		if notYet == "" {
			return promoted, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("redistest: no replica of %s promoted: %s (%w)", dead, notYet, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// promoted returns the replica among candidates that is a master, once every running
// node agrees the cluster is ok without dead, or why not yet.
func (c *Cluster) promoted(ctx context.Context, dead string, candidates []string) (string, string) {
	promoted := ""
	for _, r := range candidates {
		rdb := nodeClient(r)
		info, err := replication(ctx, rdb)
		rdb.Close()
		if err == nil && info["role"] == "master" {
			promoted = r
		}
	}
	if promoted == "" {
		return "", fmt.Sprintf("none of %v is a master yet", candidates)
	}
	for _, addr := range c.live() {
		rdb := nodeClient(addr)
		info, err := rdb.ClusterInfo(ctx).Result()
		var slots []redis.ClusterSlot
		if err == nil {
			slots, err = rdb.ClusterSlots(ctx).Result()
		}
		rdb.Close()
		if err != nil {
			return "", fmt.Sprintf("%s: %v", addr, err)
		}
		if s := parseInfo(info)["cluster_state"]; s != "ok" {
			return "", fmt.Sprintf("%s: cluster_state:%s", addr, s)
		}
		for _, r := range slots {
			if len(r.Nodes) == 0 || r.Nodes[0].Addr == dead {
				return "", fmt.Sprintf("%s: slots %d-%d still served by %s", addr, r.Start, r.End, dead)
			}
		}
	}
	return promoted, ""
}

// ScriptFlush runs SCRIPT FLUSH SYNC on every running node, masters and replicas, and
// returns how many it flushed: the next EVALSHA on any of them answers NOSCRIPT.
func (c *Cluster) ScriptFlush(ctx context.Context) (int, error) {
	n := 0
	for _, addr := range c.live() {
		rdb := nodeClient(addr)
		err := rdb.ScriptFlush(ctx).Err()
		rdb.Close()
		if err != nil {
			return n, fmt.Errorf("SCRIPT FLUSH on %s: %w", addr, err)
		}
		n++
	}
	return n, nil
}

// Migration moves one slot from one master to another as redis-cli --cluster reshard
// does, but a step at a time, so that a test can run its clients between the steps:
// StartMigration opens the slot (IMPORTING on the target, MIGRATING on the source), Move
// moves the keys it is given, Finish moves the rest and gives the slot to the target.
//
// While the slot is open, the source serves a command whose keys it all still has; one
// whose keys are all gone it redirects with ASK to the target, which serves it after
// ASKING; a command with several keys, some moved and some not, gets TRYAGAIN on both
// sides. After Finish, the source answers MOVED.
type Migration struct {
	Slot     int    // the slot being moved
	From, To string // the masters' addresses

	fromID, toID string
	src, dst     *redis.Client
	c            *Cluster
}

// StartMigration opens slot for a move from the master at from, which must serve it, to
// the master at to: CLUSTER SETSLOT <slot> IMPORTING on to, then MIGRATING on from.
// t.Cleanup closes the Migration's connections.
func (c *Cluster) StartMigration(ctx context.Context, slot int, from, to string) (*Migration, error) {
	m := &Migration{Slot: slot, From: from, To: to, c: c, src: nodeClient(from), dst: nodeClient(to)}
	c.tb.Cleanup(func() { _ = m.src.Close(); _ = m.dst.Close() })
	var err error
	if m.fromID, err = c.nodeID(ctx, from); err != nil {
		return nil, err
	}
	if m.toID, err = c.nodeID(ctx, to); err != nil {
		return nil, err
	}
	if err := m.dst.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", m.fromID).Err(); err != nil {
		return nil, fmt.Errorf("CLUSTER SETSLOT %d IMPORTING on %s: %w", slot, to, err)
	}
	if err := m.src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", m.toID).Err(); err != nil {
		return nil, fmt.Errorf("CLUSTER SETSLOT %d MIGRATING on %s: %w", slot, from, err)
	}
	return m, nil
}

// Keys returns the keys of the slot still on the source (CLUSTER GETKEYSINSLOT).
func (m *Migration) Keys(ctx context.Context) ([]string, error) {
	keys, err := m.src.ClusterGetKeysInSlot(ctx, m.Slot, 1<<30).Result()
	if err != nil {
		return nil, fmt.Errorf("CLUSTER GETKEYSINSLOT %d on %s: %w", m.Slot, m.From, err)
	}
	return keys, nil
}

// Move moves keys (of the slot) from the source to the target in one MIGRATE ... KEYS
// command: each is copied with its TTL and deleted from the source, and no command runs on
// the source in between. Keys the source no longer has are skipped.
func (m *Migration) Move(ctx context.Context, keys ...string) error {
	if len(keys) == 0 {
		return nil
	}
	host, port, _ := net.SplitHostPort(m.To)
	args := append([]any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}, anySlice(keys)...)
	err := m.src.Do(ctx, args...).Err()
	if err != nil && !strings.HasPrefix(err.Error(), "NOKEY") {
		return fmt.Errorf("MIGRATE %d keys of slot %d from %s to %s: %w", len(keys), m.Slot, m.From, m.To, err)
	}
	return nil
}

// Finish moves the keys left on the source, then gives the slot to the target: CLUSTER
// SETSLOT <slot> NODE on the target, the source, then every other running master, as
// redis-cli does.
func (m *Migration) Finish(ctx context.Context) error {
	for {
		keys, err := m.Keys(ctx)
		if err != nil {
			return err
		}
		if len(keys) == 0 {
			break
		}
		if err := m.Move(ctx, keys...); err != nil {
			return err
		}
	}
	order := []string{m.To, m.From}
	for _, a := range m.c.live() {
		if !slices.Contains(order, a) && slices.Contains(m.c.masters(ctx), a) {
			order = append(order, a)
		}
	}
	for _, a := range order {
		rdb := nodeClient(a)
		err := rdb.Do(ctx, "CLUSTER", "SETSLOT", m.Slot, "NODE", m.toID).Err()
		rdb.Close()
		if err != nil {
			return fmt.Errorf("CLUSTER SETSLOT %d NODE %s on %s: %w", m.Slot, m.toID, a, err)
		}
	}
	return nil
}

// masters returns the running nodes whose INFO replication says role:master.
func (c *Cluster) masters(ctx context.Context) []string {
	var out []string
	for _, a := range c.live() {
		rdb := nodeClient(a)
		info, err := replication(ctx, rdb)
		rdb.Close()
		if err == nil && info["role"] == "master" {
			out = append(out, a)
		}
	}
	return out
}

// anySlice converts ss for a variadic Do.
func anySlice(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// SlotOwner returns the address of the master that serves slot, as CLUSTER SLOTS on the
// first running node that answers says.
func (c *Cluster) SlotOwner(ctx context.Context, slot int) (string, error) {
	for _, a := range c.live() {
		rdb := nodeClient(a)
		slots, err := rdb.ClusterSlots(ctx).Result()
		rdb.Close()
		if err != nil {
			continue
		}
		for _, r := range slots {
			if int64(r.Start) <= int64(slot) && int64(slot) <= int64(r.End) && len(r.Nodes) > 0 {
				return r.Nodes[0].Addr, nil
			}
		}
		return "", fmt.Errorf("redistest: %s says no master serves slot %d", a, slot)
	}
	return "", errors.New("redistest: no node of the cluster answers CLUSTER SLOTS")
}

// Cancel abandons the move: it closes the slot on the source (CLUSTER SETSLOT <slot>
// STABLE), moves the keys the target has of it back (MIGRATE from the target, which its
// open slot allows), then closes the slot on the target: the source serves the slot as
// before StartMigration. Call it while no client uses the slot: until the keys are back,
// the source serves the slot without them.
func (m *Migration) Cancel(ctx context.Context) error {
	if err := m.src.Do(ctx, "CLUSTER", "SETSLOT", m.Slot, "STABLE").Err(); err != nil {
		return fmt.Errorf("CLUSTER SETSLOT %d STABLE on %s: %w", m.Slot, m.From, err)
	}
	host, port, _ := net.SplitHostPort(m.From)
	for {
		keys, err := m.dst.ClusterGetKeysInSlot(ctx, m.Slot, 1<<30).Result()
		if err != nil {
			return fmt.Errorf("CLUSTER GETKEYSINSLOT %d on %s: %w", m.Slot, m.To, err)
		}
		if len(keys) == 0 {
			break
		}
		args := append([]any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}, anySlice(keys)...)
		if err := m.dst.Do(ctx, args...).Err(); err != nil && !strings.HasPrefix(err.Error(), "NOKEY") {
			return fmt.Errorf("MIGRATE %d keys of slot %d back from %s to %s: %w", len(keys), m.Slot, m.To, m.From, err)
		}
	}
	if err := m.dst.Do(ctx, "CLUSTER", "SETSLOT", m.Slot, "STABLE").Err(); err != nil {
		return fmt.Errorf("CLUSTER SETSLOT %d STABLE on %s: %w", m.Slot, m.To, err)
	}
	return nil
}
