package redistest_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

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
