package redistest_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// TestStartSentinel starts a primary, a replica and 3 sentinels and checks what a test
// relies on: every sentinel names the primary as the master of "mymaster"; the failover
// client writes to the primary, whose write reaches the replica (WAIT counts it); the
// replica refuses writes; each sentinel runs from its own config file. Then the primary is
// killed: the sentinels promote the replica, and the same failover client writes there.
func TestStartSentinel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start := time.Now()
	s := redistest.StartSentinel(t)
	t.Logf("StartSentinel took %s", time.Since(start).Round(time.Millisecond))
	if s.MasterName != "mymaster" || len(s.Addrs) != 3 || len(s.Sentinels) != 3 {
		t.Fatalf("MasterName %q, %d sentinel addresses, %d sentinels; want mymaster, 3, 3", s.MasterName, len(s.Addrs), len(s.Sentinels))
	}
	confs := map[string]bool{}
	for i, addr := range s.Addrs {
		if s.Sentinels[i].Addr != addr {
			t.Errorf("Addrs[%d] = %s, Sentinels[%d].Addr = %s; want the same", i, addr, i, s.Sentinels[i].Addr)
		}
		sc := redis.NewSentinelClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { _ = sc.Close() })
		got, err := sc.GetMasterAddrByName(ctx, "mymaster").Result()
		if err != nil || strings.Join(got, ":") != s.Primary.Addr {
			t.Errorf("sentinel %s: SENTINEL GET-MASTER-ADDR-BY-NAME mymaster = %v, %v; want %s", addr, got, err, s.Primary.Addr)
		}
		if msg, err := sc.CkQuorum(ctx, "mymaster").Result(); err != nil || !strings.HasPrefix(msg, "OK 3 usable Sentinels") {
			t.Errorf("sentinel %s: SENTINEL CKQUORUM = %q, %v; want OK 3 usable Sentinels", addr, msg, err)
		}
		// StartSentinel sped up the sentinels' ping period while they connected, and put
		// Redis's back.
		plain := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { _ = plain.Close() })
		dbg, err := plain.Do(ctx, "SENTINEL", "DEBUG").Result() // a RESP3 map
		if m, ok := dbg.(map[any]any); err != nil || !ok || fmt.Sprint(m["PING-PERIOD"]) != "1000" {
			t.Errorf("sentinel %s: SENTINEL DEBUG = %v, %v; want PING-PERIOD 1000", addr, dbg, err)
		}
		path := sentinelConfPath(t, plain)
		conf, err := os.ReadFile(path)
		if want := fmt.Sprintf("sentinel monitor mymaster 127.0.0.1 %s 2\n", port(s.Primary.Addr)); err != nil || !strings.Contains(string(conf), want) {
			t.Errorf("sentinel %s: config file %s (%v) lacks %q:\n%s", addr, path, err, want, conf)
		}
		if confs[path] {
			t.Errorf("sentinel %s: config file %s is another sentinel's too", addr, path)
		}
		confs[path] = true
	}

	rdb := s.Client()
	if err := rdb.Set(ctx, "k", "v1", 0).Err(); err != nil {
		t.Fatalf("SET through the failover client: %v", err)
	}
	if n, err := rdb.Wait(ctx, 1, 5000).Result(); err != nil || n != 1 {
		t.Errorf("WAIT 1 5000 = %d, %v; want 1: the replica acknowledged the write", n, err)
	}
	primary, replica := s.Primary.Client(), s.Replica.Client()
	for name, c := range map[string]*redis.Client{"primary": primary, "replica": replica} {
		if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v1" {
			t.Errorf("GET k on the %s = %q, %v; want v1", name, got, err)
		}
	}
	if err := replica.Set(ctx, "k", "v2", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "READONLY") {
		t.Errorf("SET on the replica: %v; want a READONLY error", err)
	}

	// Failover: the primary dies; about SentinelDownAfter later the sentinels agree it is
	// down and promote the replica.
	killed := time.Now()
	s.Primary.Stop()
	deadline := killed.Add(20 * time.Second)
	var err error
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err = rdb.Set(cctx, "k", "v3", 0).Err()
		cancel()
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("the failover client could not write within 20s of the primary's death: %v", err)
	}
	t.Logf("the failover client wrote again %s after the primary was killed", time.Since(killed).Round(time.Millisecond))
	if got, err := replica.Get(ctx, "k").Result(); err != nil || got != "v3" {
		t.Errorf("GET k on the promoted replica = %q, %v; want v3", got, err)
	}
	role, err := replica.Do(ctx, "ROLE").Slice()
	if err != nil || len(role) == 0 || role[0] != "master" {
		t.Errorf("ROLE of the replica after the failover = %v, %v; want master", role, err)
	}
	// The sentinel that led the failover tells the others in its next hello (2s).
	for _, addr := range s.Addrs {
		sc := redis.NewSentinelClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { _ = sc.Close() })
		var got []string
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if got, err = sc.GetMasterAddrByName(ctx, "mymaster").Result(); err == nil && strings.Join(got, ":") == s.Replica.Addr {
				break
			}
		}
		if strings.Join(got, ":") != s.Replica.Addr {
			t.Errorf("sentinel %s: 10s after the failover the master is %v, %v; want the replica %s", addr, got, err, s.Replica.Addr)
		}
	}
}

// sentinelConfPath is the config file the sentinel behind c runs from, as INFO server
// names it.
func sentinelConfPath(t *testing.T, c *redis.Client) string {
	t.Helper()
	info, err := c.Info(context.Background(), "server").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "config_file:"); ok {
			return v
		}
	}
	t.Fatalf("INFO server of a sentinel names no config_file:\n%s", info)
	return ""
}

// port is the port of host:port addr.
func port(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}
