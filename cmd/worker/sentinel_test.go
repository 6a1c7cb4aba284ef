package main

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
)

// TestRun_sentinel runs the worker through Sentinel: REDIS_ADDR lists the sentinels of
// redistest.StartSentinel and REDIS_MASTER_NAME names their master, with
// "api:call tenant=5/1s" and 2 tenants x 8 tasks enqueued through a failover client. All
// 16 complete on the primary, none is archived, the worker's lines count 8 runs per tenant,
// its startup line names the master, and it logs nothing to stderr (no asynq error, no
// eviction warning: the servers run noeviction). The same again in durable mode
// (THROTTLE_MIN_REPLICAS=1: the replica acknowledges every admission), which its startup
// line says. An unknown master name exits 1 and says so.
func TestRun_sentinel(t *testing.T) {
	for _, durable := range []bool{false, true} {
		t.Run(fmt.Sprintf("durable=%t", durable), func(t *testing.T) { testRunSentinel(t, durable) })
	}
}

func testRunSentinel(t *testing.T, durable bool) {
	s := redistest.StartSentinel(t)
	sentinels := strings.Join(s.Addrs, ",")
	env := []string{"REDIS_ADDR", sentinels, "REDIS_MASTER_NAME", "mymaster", "THROTTLE_RULES", "api:call tenant=5/1s"}
	if durable {
		env = append(env, "THROTTLE_MIN_REPLICAS", "1", "THROTTLE_REPLICA_TIMEOUT", "1s")
	}
	clearEnv(t, env...)
	rdb := s.Client()

	w := startWorker(t)
	ctx, stdout, stderr := context.Background(), &w.stdout, &w.stderr

	client := asynq.NewClientFromRedisClient(rdb)
	tenants := []string{"acme", "globex"}
	for i := 1; i <= 8; i++ {
		for _, tenant := range tenants {
			if _, err := producer.Enqueue(ctx, client, "api:call", []byte(fmt.Sprintf(`{"seq":%d}`, i)), tenant, asynq.Retention(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}
	}
	insp := asynq.NewInspectorFromRedisClient(s.Primary.Client()) // the primary itself: where the worker wrote
	var qi *asynq.QueueInfo
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		var err error
		if qi, err = insp.GetQueueInfo("default"); err != nil {
			t.Fatal(err)
		}
		if qi.Completed+qi.Archived >= 16 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30s: completed=%d archived=%d pending=%d active=%d scheduled=%d retry=%d\nstdout:\n%s\nstderr:\n%s",
				qi.Completed, qi.Archived, qi.Pending, qi.Active, qi.Scheduled, qi.Retry, stdout.String(), stderr.String())
		}
	}
	if qi.Completed != 16 || qi.Archived != 0 || qi.Pending+qi.Active+qi.Scheduled+qi.Retry != 0 {
		t.Errorf("queue on the primary: completed=%d archived=%d pending=%d active=%d scheduled=%d retry=%d; want 16 completed, nothing else",
			qi.Completed, qi.Archived, qi.Pending, qi.Active, qi.Scheduled, qi.Retry)
	}
	w.stop(t, 15*time.Second)

	ran := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		if m := activityLine.FindStringSubmatch(line); m != nil {
			n, _ := strconv.Atoi(m[3])
			ran[m[2]] += n
		}
	}
	for _, tenant := range tenants {
		if ran[tenant] != 8 {
			t.Errorf("tenant %s: the worker logged ran=%d in all, want 8", tenant, ran[tenant])
		}
	}
	if want := fmt.Sprintf(` redis REDIS_ADDR=%q REDIS_MASTER_NAME="mymaster" REDIS_PASSWORD=<empty> REDIS_DB=0`+"\n", sentinels); !strings.Contains(stdout.String(), want) {
		t.Errorf("startup log lacks %q:\n%s", want, stdout.String())
	}
	const durableLine = "durable: an admission runs its task once 1 replica(s) acknowledged it within 1s\n"
	if got := strings.Contains(stdout.String(), durableLine); got != durable {
		t.Errorf("startup log has %q: %t, want %t:\n%s", durableLine, got, durable, stdout.String())
	}
	if stderr.String() != "" {
		t.Errorf("stderr: %s", stderr.String())
	}

	clearEnv(t, "REDIS_ADDR", sentinels, "REDIS_MASTER_NAME", "nosuch")
	var out, errOut bytes.Buffer
	want := fmt.Sprintf(`worker: Redis at REDIS_ADDR=%q does not answer: redisenv: no Sentinel in REDIS_ADDR=%q knows REDIS_MASTER_NAME="nosuch"`+"\n", sentinels, sentinels)
	if code := run(context.Background(), nil, &out, &errOut); code != 1 || errOut.String() != want {
		t.Errorf("unknown master name: exit %d, stderr %q; want 1 and %q", code, errOut.String(), want)
	}
}
