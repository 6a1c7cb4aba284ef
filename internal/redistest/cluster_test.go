package redistest_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestStartCluster starts 3 masters and checks that they form one cluster: every node
// says cluster_state:ok, the three masters split the 16384 slots between them, a key
// written through the cluster client lands on the master that owns its slot (one key per
// master, so keys in different slots land on different nodes), and keys that share a
// hash tag share a slot.
func TestStartCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := redistest.StartCluster(t, 3)
	if len(c.Addrs) != 3 {
		t.Fatalf("Addrs = %v, want 3 addresses", c.Addrs)
	}
	nodes := make(map[string]*redis.Client, len(c.Addrs)) // addr -> a client of that node only
	for _, addr := range c.Addrs {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { _ = rdb.Close() })
		nodes[addr] = rdb
		info, err := rdb.ClusterInfo(ctx).Result()
		if err != nil {
			t.Fatalf("CLUSTER INFO on %s: %v", addr, err)
		}
		for _, want := range []string{"cluster_state:ok", "cluster_slots_assigned:16384", "cluster_known_nodes:3", "cluster_size:3"} {
			if !strings.Contains(info, want+"\r\n") {
				t.Errorf("CLUSTER INFO on %s lacks %q:\n%s", addr, want, info)
			}
		}
	}

	rdb := c.Client()
	ranges, err := rdb.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	owner := func(slot int64) string { // the master that serves slot
		for _, r := range ranges {
			if int64(r.Start) <= slot && slot <= int64(r.End) {
				return r.Nodes[0].Addr
			}
		}
		return ""
	}
	covered, masters := 0, map[string]bool{}
	for _, r := range ranges {
		covered += int(r.End - r.Start + 1)
		if len(r.Nodes) != 1 {
			t.Errorf("slots %d-%d are served by %d nodes, want 1 (no replicas)", r.Start, r.End, len(r.Nodes))
		}
		masters[r.Nodes[0].Addr] = true
	}
	if got := slices.Sorted(maps.Keys(masters)); covered != 16384 || !slices.Equal(got, slices.Sorted(slices.Values(c.Addrs))) {
		t.Fatalf("CLUSTER SLOTS covers %d slots served by %v; want 16384 served by %v", covered, got, c.Addrs)
	}

	// One key per master: the first of "key:0", "key:1", ... whose slot it owns.
	keyOf := map[string]string{} // master addr -> its key
	for i := 0; len(keyOf) < len(c.Addrs); i++ {
		key := fmt.Sprintf("key:%d", i)
		slot, err := rdb.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if addr := owner(slot); keyOf[addr] == "" {
			keyOf[addr] = key
			if err := rdb.Set(ctx, key, addr, 0).Err(); err != nil {
				t.Fatalf("SET %s through the cluster client: %v", key, err)
			}
		}
	}
	for addr, key := range keyOf {
		node := nodes[addr]
		if n, err := node.DBSize(ctx).Result(); err != nil || n != 1 {
			t.Errorf("DBSIZE on %s = %d, %v; want 1 (only %s)", addr, n, err, key)
		}
		if got, err := node.Get(ctx, key).Result(); err != nil || got != addr {
			t.Errorf("GET %s on %s = %q, %v; want %q", key, addr, got, err, addr)
		}
	}

	tagged := []string{"{user:1}", "{user:1}:a", "{user:1}:b:{other}", "user:1"}
	want, err := rdb.ClusterKeySlot(ctx, tagged[0]).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range tagged[1:] {
		if got, err := rdb.ClusterKeySlot(ctx, key).Result(); err != nil || got != want {
			t.Errorf("CLUSTER KEYSLOT %s = %d, %v; want %d, the slot of %s", key, got, err, want, tagged[0])
		}
	}
	if err := rdb.MSet(ctx, tagged[1], "a", tagged[2], "b").Err(); err != nil {
		t.Errorf("MSET of two keys with one hash tag: %v", err)
	}
}

// TestStartClusterWith_Changes starts 3 masters with one replica each (node timeout 1s)
// and changes the cluster as the limiter's tests do: a slot moved key by key (a key of it
// answers ASK while the slot is open, then MOVED from the old owner, and the new owner
// holds it), SCRIPT FLUSH on all 6 nodes (an EVALSHA of a loaded script then answers
// NOSCRIPT on each), and a master killed (its replica promoted; it serves the key written
// before the kill, replicated first).
func TestStartClusterWith_Changes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := redistest.StartClusterWith(t, redistest.ClusterConfig{Masters: 3, ReplicasPerMaster: 1, NodeTimeout: time.Second})
	if len(c.Replicas) != 3 || len(c.Replicas[0]) != 1 {
		t.Fatalf("Replicas = %v, want one per master", c.Replicas)
	}
	for i, m := range c.Addrs {
		r := redis.NewClient(&redis.Options{Addr: c.Replicas[i][0]})
		t.Cleanup(func() { _ = r.Close() })
		info, err := r.Info(ctx, "replication").Result()
		if err != nil || !strings.Contains(info, "role:slave\r\n") || !strings.Contains(info, "master_port:"+m[strings.LastIndex(m, ":")+1:]+"\r\n") {
			t.Errorf("replica %s of %s: INFO replication %q, %v; want role:slave of that master", c.Replicas[i][0], m, info, err)
		}
	}
	rdb := c.Client()

	key := "k:{a}" // slot 15495: served by the third master (10923-16383)
	slot, err := rdb.ClusterKeySlot(ctx, key).Result()
	if err != nil || slot != 15495 {
		t.Fatalf("CLUSTER KEYSLOT %s = %d, %v; want 15495", key, slot, err)
	}
	if err := rdb.Set(ctx, key, "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	other := "k2:{a}" // same slot, not yet written
	m, err := c.StartMigration(ctx, int(slot), c.Addrs[2], c.Addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	src := redis.NewClient(&redis.Options{Addr: c.Addrs[2], MaxRetries: -1})
	t.Cleanup(func() { _ = src.Close() })
	if err := src.Get(ctx, key).Err(); err != nil {
		t.Errorf("GET %s on the source, slot open, key not moved: %v; want served", key, err)
	}
	if err := src.Get(ctx, other).Err(); err == nil || !strings.HasPrefix(err.Error(), "ASK 15495 "+c.Addrs[0]) {
		t.Errorf("GET %s (no such key) on the source, slot open: %v; want ASK 15495 %s", other, err, c.Addrs[0])
	}
	if keys, err := m.Keys(ctx); err != nil || !slices.Equal(keys, []string{key}) {
		t.Errorf("Keys = %q, %v; want [%s]", keys, err, key)
	}
	if err := m.Move(ctx, key); err != nil {
		t.Fatal(err)
	}
	if err := src.Get(ctx, key).Err(); err == nil || !strings.HasPrefix(err.Error(), "ASK 15495 ") {
		t.Errorf("GET %s on the source after MIGRATE: %v; want ASK", key, err)
	}
	if err := m.Finish(ctx); err != nil {
		t.Fatal(err)
	}
	if err := src.Get(ctx, key).Err(); err == nil || !strings.HasPrefix(err.Error(), "MOVED 15495 "+c.Addrs[0]) {
		t.Errorf("GET %s on the old owner after Finish: %v; want MOVED 15495 %s", key, err, c.Addrs[0])
	}
	if owner, err := c.SlotOwner(ctx, int(slot)); err != nil || owner != c.Addrs[0] {
		t.Errorf("SlotOwner(%d) = %s, %v; want %s", slot, owner, err, c.Addrs[0])
	}
	if v, err := rdb.Get(ctx, key).Result(); err != nil || v != "v" {
		t.Errorf("GET %s through the cluster client after the move: %q, %v; want v", key, v, err)
	}

	// SCRIPT FLUSH on every node.
	script := redis.NewScript("return 1")
	if err := script.Load(ctx, rdb).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := c.ScriptFlush(ctx); err != nil || n != 6 {
		t.Fatalf("ScriptFlush = %d, %v; want 6 nodes", n, err)
	}
	for _, addr := range slices.Concat(c.Addrs, c.Replicas[0], c.Replicas[1], c.Replicas[2]) {
		n := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		err := n.EvalSha(ctx, script.Hash(), nil).Err()
		n.Close()
		if err == nil || !strings.HasPrefix(err.Error(), "NOSCRIPT") {
			t.Errorf("EVALSHA on %s after ScriptFlush: %v; want NOSCRIPT", addr, err)
		}
	}

	// Kill the master that now serves the key, after its replica has it.
	if err := c.WaitReplicated(ctx); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	c.Kill(c.Addrs[0])
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	promoted, err := c.WaitPromoted(wctx, c.Addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("replica %s promoted %v after the kill of %s", promoted, time.Since(killed).Round(time.Millisecond), c.Addrs[0])
	if promoted != c.Replicas[0][0] {
		t.Errorf("promoted %s, want %s, the killed master's replica", promoted, c.Replicas[0][0])
	}
	if owner, err := c.SlotOwner(ctx, int(slot)); err != nil || owner != promoted {
		t.Errorf("SlotOwner(%d) = %s, %v; want %s", slot, owner, err, promoted)
	}
	p := redis.NewClient(&redis.Options{Addr: promoted})
	t.Cleanup(func() { _ = p.Close() })
	if v, err := p.Get(ctx, key).Result(); err != nil || v != "v" {
		t.Errorf("GET %s on the promoted replica: %q, %v; want v", key, v, err)
	}
}
