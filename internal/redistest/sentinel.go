package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMaster is the name under which StartSentinel's sentinels monitor the primary:
// REDIS_MASTER_NAME, redis.FailoverOptions.MasterName.
const SentinelMaster = "mymaster"

// Timings that StartSentinel writes into every sentinel's config file, short so that a
// test of a failover takes seconds, not the minutes of Redis's defaults (30s and 3min).
const (
	// SentinelDownAfter is "sentinel down-after-milliseconds": how long the primary must
	// not answer before a sentinel deems it down (and, with a quorum of 2 sentinels
	// agreeing, starts a failover).
	SentinelDownAfter = time.Second
	// SentinelFailoverTimeout is "sentinel failover-timeout": how long a failover may take
	// before another may be tried, and the least time between two failovers of the master.
	SentinelFailoverTimeout = 5 * time.Second
)

// sentinelPingPeriodMS is Redis's SENTINEL_PING_PERIOD: how often a sentinel pings each
// instance and retries a broken link.
const sentinelPingPeriodMS = 1000

// sentinelTimeout bounds StartSentinel: if replication and the sentinels are not up this
// long after the primary started, the test fails.
const sentinelTimeout = 30 * time.Second

// Sentinel is a Redis Sentinel deployment started by StartSentinel: a primary, one replica
// of it, and 3 sentinels that monitor it with a quorum of 2, each a redis-server process on
// a free loopback port with persistence off, killed by t.Cleanup. Kill the primary
// (Primary.Stop) and the sentinels promote the Replica: SentinelDownAfter later they deem
// the primary down, then elect a leader that promotes it (measured: a failover client
// writes again 2-3s after the kill); a client from Client follows them there.
type Sentinel struct {
	// MasterName is the name the sentinels monitor the primary under: SentinelMaster.
	MasterName string
	// Addrs are the sentinels' addresses, "127.0.0.1:<port>": REDIS_ADDR (joined with
	// commas), redis.FailoverOptions.SentinelAddrs.
	Addrs []string
	// Primary is the server the sentinels monitor, at the start the master.
	Primary *Server
	// Replica replicates Primary (replicaof), in sync when StartSentinel returns.
	Replica *Server
	// Sentinels are the 3 sentinel processes, "redis-server <conf> --sentinel", each with
	// its own config file in its own directory (a sentinel rewrites it as it learns).
	Sentinels []*Server

	tb testing.TB
}

// StartSentinel starts a primary, a replica of it and 3 sentinels, and returns once the
// replica is in sync and every sentinel sees the primary as master, the replica as its
// replica with a working link, and the other 2 sentinels. extraArgs go to the primary and
// the replica, after the defaults (so they win), e.g. "--maxmemory-policy", "allkeys-lru".
//
// Each sentinel's config file (in its t.TempDir) monitors the primary with a quorum of 2,
// SentinelDownAfter and SentinelFailoverTimeout, and names its own id, the replica and
// the other sentinels, so that they need not first discover each other (which takes a
// 2-second hello round); they start at once. It takes about half a second. The test fails, saying why, if
// redis-server is not on PATH or the deployment is not up within 30s.
func StartSentinel(tb testing.TB, extraArgs ...string) *Sentinel {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), sentinelTimeout)
	defer cancel()
	// Both data nodes sync a replica at once, without waiting for more (the default
	// diskless sync waits 5s): the replica now, and the old primary once it comes back as a
	// replica of the promoted one.
	dataArgs := append([]string{"--repl-diskless-sync-delay", "0"}, extraArgs...)
	primary := StartServer(tb, dataArgs...)
	replica := StartServer(tb, append(slices.Clone(dataArgs), "--replicaof", "127.0.0.1", strconv.Itoa(primary.port))...)
	if err := waitReplicaInSync(ctx, primary, replica); err != nil {
		tb.Fatalf("redistest: replica %s of %s: %v", replica.Addr, primary.Addr, err)
	}

	s := &Sentinel{MasterName: SentinelMaster, Primary: primary, Replica: replica, tb: tb}
	ids := make([]string, 3)
	ports := make([]int, 3) // the ports the config files name
	for i := range ids {
		ids[i] = sentinelID(tb)
		ports[i] = freePort(tb)
	}
	writeConf := func(srv *Server, i int) {
		conf := filepath.Join(srv.dir, "sentinel.conf")
		if err := os.WriteFile(conf, []byte(sentinelConf(s.MasterName, ids, ports, i, primary.port, replica.port)), 0o600); err != nil {
			tb.Fatalf("redistest: write %s: %v", conf, err)
		}
		srv.head = []string{conf, "--sentinel"}
	}
	// All at once: a sentinel that finds another not up yet retries its link only a
	// second later, and a second after that deems it down until it answers.
	path := lookPath(tb)
	s.Sentinels = make([]*Server, len(ids))
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i := range ids {
		srv := &Server{tb: tb, port: ports[i], dir: tb.TempDir()}
		srv.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(srv.port))
		writeConf(srv, i)
		tb.Cleanup(srv.kill)
		s.Sentinels[i] = srv
		wg.Go(func() { errs[i] = srv.start(path, nil) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil { // its port was taken meanwhile: on another port, the others learn it from its hello messages
			tb.Logf("redistest: sentinel on %s: %v; starting it on another port", s.Sentinels[i].Addr, err)
			s.Sentinels[i] = startServer(tb, freePort, func(srv *Server) []string { writeConf(srv, i); return nil })
		}
	}
	for _, sen := range s.Sentinels {
		s.Addrs = append(s.Addrs, sen.Addr)
	}
	// A sentinel that found another not listening yet retries the link only a ping period
	// (1s) later. While they connect, the period is 100ms (SENTINEL DEBUG, Redis 7.0+; on
	// an older Redis this does nothing and the wait takes that second); once they are up,
	// it is Redis's again, so that a failover takes as long as it would in production.
	s.sentinelDebug(ctx, "ping-period", "100")
	if err := s.waitUp(ctx); err != nil {
		tb.Fatalf("redistest: sentinels %v of primary %s and replica %s not up within %s: %v",
			s.Addrs, primary.Addr, replica.Addr, sentinelTimeout, err)
	}
	s.sentinelDebug(ctx, "ping-period", strconv.Itoa(sentinelPingPeriodMS))
	return s
}

// FailoverOptions returns the options of a go-redis Sentinel client for s: MasterName and
// SentinelAddrs set, everything else at go-redis defaults.
func (s *Sentinel) FailoverOptions() *redis.FailoverOptions {
	return &redis.FailoverOptions{MasterName: s.MasterName, SentinelAddrs: slices.Clone(s.Addrs)}
}

// Client returns a new Sentinel-backed client (redis.NewFailoverClient) of s's master,
// closed by t.Cleanup. It asks the sentinels where the master is and follows a failover.
func (s *Sentinel) Client() *redis.Client {
	rdb := redis.NewFailoverClient(s.FailoverOptions())
	s.tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// CutReplication stops the replica's replication without stopping the replica: it points
// it at a closed loopback port (REPLICAOF), so it keeps the data it has, answers the
// sentinels and clients, and gets none of the primary's later writes; the primary's WAIT
// counts no replica. The sentinels still promote it if the primary dies: they skip only a
// replica whose link has been down more than 10 x SentinelDownAfter. Kill the primary
// within SentinelFailoverTimeout of the cut: after that, a sentinel that finds the replica
// replicating from elsewhere while the primary is up points it back (+fix-slave-config).
func (s *Sentinel) CutReplication() {
	s.tb.Helper()
	dead := freePort(s.tb) // closed again: nothing listens there
	c := redis.NewClient(&redis.Options{Addr: s.Replica.Addr, MaxRetries: -1})
	defer c.Close()
	if err := c.ReplicaOf(context.Background(), "127.0.0.1", strconv.Itoa(dead)).Err(); err != nil {
		s.tb.Fatalf("redistest: REPLICAOF 127.0.0.1 %d on the replica %s: %v", dead, s.Replica.Addr, err)
	}
}

// Rejoin restarts the stopped Primary, empty, as a replica of the promoted Replica
// (REPLICAOF, as the sentinels would do themselves some 8s after it came back), and
// returns once it is in sync: the promoted primary's WAIT counts it again.
func (s *Sentinel) Rejoin() {
	s.tb.Helper()
	s.Primary.Restart("--replicaof", "127.0.0.1", strconv.Itoa(s.Replica.port), "--repl-diskless-sync-delay", "0")
	ctx, cancel := context.WithTimeout(context.Background(), sentinelTimeout)
	defer cancel()
	if err := waitReplicaInSync(ctx, s.Replica, s.Primary); err != nil {
		s.tb.Fatalf("redistest: old primary %s rejoining as a replica of %s: %v", s.Primary.Addr, s.Replica.Addr, err)
	}
}

// sentinelDebug sets a sentinel timer (SENTINEL DEBUG <param> <value>) on every sentinel,
// ignoring errors: it only makes StartSentinel faster.
func (s *Sentinel) sentinelDebug(ctx context.Context, param, value string) {
	for _, sen := range s.Sentinels {
		c := redis.NewClient(&redis.Options{Addr: sen.Addr, MaxRetries: -1})
		_ = c.Do(ctx, "SENTINEL", "DEBUG", param, value).Err()
		_ = c.Close()
	}
}

// sentinelConf is the config file of sentinel i of those with ids and ports, monitoring the
// primary at primaryPort with its replica at replicaPort.
func sentinelConf(master string, ids []string, ports []int, i, primaryPort, replicaPort int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "sentinel myid %s\n", ids[i])
	fmt.Fprintf(&b, "sentinel monitor %s 127.0.0.1 %d 2\n", master, primaryPort)
	fmt.Fprintf(&b, "sentinel down-after-milliseconds %s %d\n", master, SentinelDownAfter.Milliseconds())
	fmt.Fprintf(&b, "sentinel failover-timeout %s %d\n", master, SentinelFailoverTimeout.Milliseconds())
	fmt.Fprintf(&b, "sentinel parallel-syncs %s 1\n", master)
	fmt.Fprintf(&b, "sentinel known-replica %s 127.0.0.1 %d\n", master, replicaPort)
	for j := range ids {
		if j != i {
			fmt.Fprintf(&b, "sentinel known-sentinel %s 127.0.0.1 %d %s\n", master, ports[j], ids[j])
		}
	}
	return b.String()
}

// sentinelID returns a fresh sentinel id: 40 hex digits, as Redis's run ids.
func sentinelID(tb testing.TB) string {
	tb.Helper()
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		tb.Fatalf("redistest: sentinel id: %v", err)
	}
	return hex.EncodeToString(b)
}

// waitReplicaInSync polls INFO replication until replica's link to primary is up and
// primary lists it online, or ctx ends. It returns the last reason to wait on failure.
func waitReplicaInSync(ctx context.Context, primary, replica *Server) error {
	p := redis.NewClient(&redis.Options{Addr: primary.Addr, MaxRetries: -1})
	defer p.Close()
	r := redis.NewClient(&redis.Options{Addr: replica.Addr, MaxRetries: -1})
	defer r.Close()
	want := fmt.Sprintf("ip=127.0.0.1,port=%d,state=online", replica.port)
	return poll(ctx, func() string {
		info, err := r.Info(ctx, "replication").Result()
		if err != nil {
			return fmt.Sprintf("replica: INFO replication: %v", err)
		}
		if got := parseInfo(info)["master_link_status"]; got != "up" {
			return fmt.Sprintf("replica: master_link_status:%s, want up", got)
		}
		info, err = p.Info(ctx, "replication").Result()
		if err != nil {
			return fmt.Sprintf("primary: INFO replication: %v", err)
		}
		if got := parseInfo(info)["slave0"]; !strings.HasPrefix(got, want) {
			return fmt.Sprintf("primary: slave0:%s, want %s...", got, want)
		}
		return ""
	})
}

// waitUp polls every sentinel until it reports the primary as master (flags "master") with
// 1 replica, the replica (flags "slave", master-link-status ok), and exactly the other
// sentinels at their addresses (flags "sentinel": connected, none deemed down), or ctx ends.
// It returns the last reason to wait on failure.
func (s *Sentinel) waitUp(ctx context.Context) error {
	clients := make([]*redis.SentinelClient, len(s.Sentinels))
	for i, sen := range s.Sentinels {
		clients[i] = redis.NewSentinelClient(&redis.Options{Addr: sen.Addr, MaxRetries: -1})
		defer clients[i].Close()
	}
	return poll(ctx, func() string {
		for i, c := range clients {
			at := s.Addrs[i]
			m, err := c.Master(ctx, s.MasterName).Result()
			if err != nil {
				return fmt.Sprintf("%s: SENTINEL MASTER: %v", at, err)
			}
			if addr := net.JoinHostPort(m["ip"], m["port"]); addr != s.Primary.Addr || m["flags"] != "master" || m["num-slaves"] != "1" {
				return fmt.Sprintf("%s: master at %s flags %q with %s replicas, want %s, \"master\", 1", at, addr, m["flags"], m["num-slaves"], s.Primary.Addr)
			}
			replicas, err := c.Replicas(ctx, s.MasterName).Result()
			if err != nil {
				return fmt.Sprintf("%s: SENTINEL REPLICAS: %v", at, err)
			}
			if len(replicas) != 1 {
				return fmt.Sprintf("%s: %d replicas, want 1", at, len(replicas))
			}
			r := replicas[0]
			if addr := net.JoinHostPort(r["ip"], r["port"]); addr != s.Replica.Addr || r["flags"] != "slave" || r["master-link-status"] != "ok" {
				return fmt.Sprintf("%s: replica at %s flags %q link %q, want %s, \"slave\", \"ok\"", at, addr, r["flags"], r["master-link-status"], s.Replica.Addr)
			}
			others, err := c.Sentinels(ctx, s.MasterName).Result()
			if err != nil {
				return fmt.Sprintf("%s: SENTINEL SENTINELS: %v", at, err)
			}
			var got []string
			for _, o := range others {
				if o["flags"] != "sentinel" {
					return fmt.Sprintf("%s: sentinel %s:%s flags %q, want \"sentinel\"", at, o["ip"], o["port"], o["flags"])
				}
				got = append(got, net.JoinHostPort(o["ip"], o["port"]))
			}
			want := slices.Delete(slices.Clone(s.Addrs), i, i+1)
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				return fmt.Sprintf("%s: knows sentinels %v, want %v", at, got, want)
			}
		}
		return ""
	})
}

// poll calls check every 20ms until it returns "" (done), or ctx ends; then it returns an
// error with check's last reason to wait.
func poll(ctx context.Context, check func() string) error {
	for {
		notYet := check()
		if notYet == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s (%w)", notYet, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
