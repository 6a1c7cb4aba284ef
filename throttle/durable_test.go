package throttle_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/lua"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestNew_durableConfig: New refuses a negative MinReplicas, a ReplicaTimeout under 1ms
// (WAIT takes whole milliseconds, and 0 would block forever) and one not shorter than the
// client's ReadTimeout (the pipeline's reply would time out first); it takes the rest.
func TestNew_durableConfig(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled: New sends nothing
	t.Cleanup(func() { _ = rdb.Close() })
	short := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ReadTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = short.Close() })
	for _, tc := range []struct {
		name    string
		rdb     redis.UniversalClient
		cfg     throttle.Config
		wantErr string // "": no error
	}{
		{"Off", rdb, throttle.Config{}, ""},
		{"DefaultTimeout", rdb, throttle.Config{MinReplicas: 1}, ""},
		{"TwoReplicas2s", rdb, throttle.Config{MinReplicas: 2, ReplicaTimeout: 2 * time.Second}, ""},
		{"NegativeReplicas", rdb, throttle.Config{MinReplicas: -1}, "MinReplicas -1 is negative"},
		{"SubMillisecond", rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: 500 * time.Microsecond}, "ReplicaTimeout 500µs is under 1ms"},
		{"NegativeTimeout", rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: -time.Second}, "ReplicaTimeout -1s is under 1ms"},
		{"AtReadTimeout", rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: 5 * time.Second}, "ReplicaTimeout 5s is not shorter than the client's ReadTimeout 5s"}, // go-redis v9.23's default
		{"DefaultUnderShortReadTimeout", short, throttle.Config{MinReplicas: 1}, ""},                                                                                  // 100ms < 200ms
		{"OverShortReadTimeout", short, throttle.Config{MinReplicas: 1, ReplicaTimeout: 200 * time.Millisecond}, "ReplicaTimeout 200ms is not shorter than the client's ReadTimeout 200ms"},
		{"OffIgnoresReadTimeout", short, throttle.Config{ReplicaTimeout: time.Hour}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := throttle.New(tc.rdb, tc.cfg)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("New: %v, want no error", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("New: %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
}

// TestLimiter_durableNoReplica runs durable mode on a single node, which has no replica:
// WAIT 1 always answers 0 after ReplicaTimeout. Limit 2/1s.
//   - A fresh admission is written (it is in the log) but reported as ErrNotReplicated
//     (Acked 0, Want 1), with the zero Decision; a fresh call writes no ack key.
//   - Its repeat (same member, not Fresh) is a replay, also ErrNotReplicated
//     (Replayed), and writes the ack key (TTL at most 1s) before its WAIT.
//   - A second admission fills the log; then a denial is returned as a Decision
//     (it wrote nothing, so nothing needs acknowledging), and so is a reservation.
//   - A reservation that comes to be claimed at its instant is an admission: ErrNotReplicated.
//   - After SCRIPT FLUSH, a decision still comes (NOSCRIPT, then EVAL in the pipeline).
func TestLimiter_durableNoReplica(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := redistest.Start(t)
	timeout := 20 * time.Millisecond // nothing can ever acknowledge: only its length matters
	l := clusterNew(t, rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: timeout})
	q := tenantQuota(2, time.Second)
	key := throttle.Key{TaskType: "durable:call", Tenant: "acme"}
	req := func(member string, fresh bool) throttle.Request {
		return throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: member, Fresh: fresh}
	}
	logKey := l.RedisKey(key, throttle.ScopeTenant)
	ackKey := strings.TrimSuffix(logKey, "tenant:acme") + "ack"
	wantNotReplicated := func(what string, d throttle.Decision, err error, replayed bool) {
		t.Helper()
		var nr *throttle.NotReplicatedError
		if !errors.Is(err, throttle.ErrNotReplicated) || !errors.As(err, &nr) {
			t.Fatalf("%s: %v, want ErrNotReplicated", what, err)
		}
		if d != (throttle.Decision{}) {
			t.Errorf("%s: decision %+v beside the error, want the zero Decision", what, d)
		}
		if want := (throttle.NotReplicatedError{Key: key, Acked: 0, Want: 1, Timeout: timeout, Replayed: replayed}); *nr != want {
			t.Errorf("%s: %+v, want %+v", what, *nr, want)
		}
		if !strings.Contains(err.Error(), "0 of 1 replicas acknowledged it within 20ms") {
			t.Errorf("%s: message %q does not give the counts", what, err)
		}
	}

	d, err := l.AllowAt(ctx, req("a", true), ms(1000))
	wantNotReplicated("fresh admission", d, err, false)
	if got := entriesOf(t, rdb, logKey); len(got) != 1 || got["a"] != 1000 {
		t.Errorf("log after the unacknowledged admission = %v, want a at 1000: written, not reported", got)
	}
	if n := rdb.Exists(ctx, ackKey).Val(); n != 0 {
		t.Errorf("a fresh call wrote the ack key %s", ackKey)
	}

	d, err = l.AllowAt(ctx, req("a", false), ms(1100))
	wantNotReplicated("repeat", d, err, true)
	if ttl := pttl(t, rdb, ackKey); ttl <= 0 || ttl > time.Second {
		t.Errorf("PTTL %s after a repeat = %v, want in (0, 1s]", ackKey, ttl)
	}

	d, err = l.AllowAt(ctx, req("b", true), ms(1200))
	wantNotReplicated("second admission", d, err, false)

	// Full (a, b): a denial, then a reservation, each returned.
	wantOutcome(t, l, req("c", true), 1300, outcome{Quota: q, Count: 2, RetryAfter: msd(700), At: 1300})
	resv := req("d", true)
	resv.Reservation = "task-d"
	wantOutcome(t, l, resv, 1400, outcome{Reserved: true, Quota: q, Count: 2, RetryAfter: msd(600), At: 1400})
	// Its claim at 2000 is an admission, not acknowledged either.
	resv.Member, resv.Fresh = "d2", true
	d, err = l.AllowAt(ctx, resv, ms(2000))
	wantNotReplicated("claim", d, err, false)

	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	wantOutcome(t, l, req("e", true), 2001, outcome{Quota: q, Count: 2, RetryAfter: msd(199), At: 2001})
	if got, err := rdb.ScriptExists(ctx, lua.SlidingWindow.Hash()).Result(); err != nil || !got[0] {
		t.Errorf("SCRIPT EXISTS after the flush and a decision = %v, %v; want true (EVAL loaded it)", got, err)
	}
}

// TestLimiter_durableCluster: on a Redis Cluster the pipeline goes to the master of the
// keys' slot, which took the write: the admission is in that master's log, reported as
// ErrNotReplicated (StartCluster's masters have no replicas), and the ack key of a repeat
// lands on that master too. A denial is a Decision.
func TestLimiter_durableCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := redistest.StartCluster(t, 3)
	rdb := c.Client()
	l := clusterNew(t, rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: 20 * time.Millisecond})
	q := tenantQuota(1, time.Second)
	owner := clusterSlotOwner(t, rdb)
	masters := clusterMasters(t, rdb)
	used := map[string]bool{}
	for _, taskType := range []string{"a", "b", "c", "d"} { // slots 15495, 3300, 7365, 11298
		key := throttle.Key{TaskType: taskType, Tenant: "acme"}
		logKey := l.RedisKey(key, throttle.ScopeTenant)
		addr := owner(clusterTagSlot(t, rdb, taskType))
		used[addr] = true
		node := masters[addr]
		// Member "m", not Fresh: a repeat, which writes the ack key.
		_, err := l.AllowAt(ctx, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "m"}, ms(1000))
		if !errors.Is(err, throttle.ErrNotReplicated) {
			t.Fatalf("%s: %v, want ErrNotReplicated", taskType, err)
		}
		if got := entriesOf(t, node, logKey); len(got) != 1 || got["m"] != 1000 {
			t.Errorf("%s: log on the slot's master = %v, want m at 1000", taskType, got)
		}
		if n := node.Exists(ctx, strings.TrimSuffix(logKey, "tenant:acme")+"ack").Val(); n != 1 {
			t.Errorf("%s: the repeat's ack key is not on the slot's master", taskType)
		}
		wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Fresh: true}, 1500,
			outcome{Quota: q, Count: 1, RetryAfter: msd(500), At: 1500})
	}
	if len(used) != 3 {
		t.Errorf("the task types' slots are on %d masters, want all 3: the test shows less", len(used))
	}
}

// TestLimiter_durableClusterReplicated: durable mode on a cluster of 3 masters with one
// replica each (redistest.StartClusterWith): for a task type on each master, the
// admission is acknowledged by the slot's replica (WAIT on the master's own connection),
// so it is returned as an admission, and after the replicas catch up each holds it.
func TestLimiter_durableClusterReplicated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := redistest.StartClusterWith(t, redistest.ClusterConfig{Masters: 3, ReplicasPerMaster: 1})
	rdb := c.Client()
	l := clusterNew(t, rdb, throttle.Config{MinReplicas: 1, ReplicaTimeout: time.Second})
	q := tenantQuota(1, time.Second)
	owner := clusterSlotOwner(t, rdb)
	used := map[string]bool{}
	keys := map[string]string{}                             // log key -> its master's address
	for _, taskType := range []string{"a", "b", "c", "d"} { // slots 15495, 3300, 7365, 11298
		key := throttle.Key{TaskType: taskType, Tenant: "acme"}
		addr := owner(clusterTagSlot(t, rdb, taskType))
		used[addr] = true
		keys[l.RedisKey(key, throttle.ScopeTenant)] = addr
		wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Member: "m"}, 1000,
			outcome{Allowed: true, Quota: q, Count: 1, At: 1000})
		wantOutcome(t, l, throttle.Request{Key: key, Quotas: []throttle.Quota{q}, Fresh: true}, 1500,
			outcome{Quota: q, Count: 1, RetryAfter: msd(500), At: 1500})
	}
	if len(used) != 3 {
		t.Errorf("the task types' slots are on %d masters, want all 3: the test shows less", len(used))
	}
	if err := c.WaitReplicated(ctx); err != nil {
		t.Fatal(err)
	}
	for logKey, addr := range keys {
		i := slices.Index(c.Addrs, addr)
		if i < 0 || len(c.Replicas[i]) != 1 {
			t.Fatalf("master %s: not in Addrs %v or not one replica (%v)", addr, c.Addrs, c.Replicas)
		}
		replica := redis.NewClient(&redis.Options{Addr: c.Replicas[i][0]})
		t.Cleanup(func() { _ = replica.Close() })
		replica.Do(ctx, "READONLY")
		if got := entriesOf(t, replica, logKey); len(got) != 1 || got["m"] != 1000 {
			t.Errorf("%s on the replica of %s: %v, want m at 1000", logKey, addr, got)
		}
	}
}
