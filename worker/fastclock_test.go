package worker_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// fastClockRun is what one server of TestFastClock saw.
type fastClockRun struct {
	mu      sync.Mutex
	starts  map[string]time.Time // real start of each task's handler
	denials map[string]int
	by      map[string]string // the server that ran each task
}

// fastClockServer starts an asynq server named name on rdb whose limiter and middleware
// read a clock ahead of the real one by ahead (asynq's own clock is the real one), under
// the rule "fast:call tenant=1/10s", recording into run.
func fastClockServer(t *testing.T, rdb *redis.Client, name string, ahead time.Duration, run *fastClockRun) *asynq.Server {
	t.Helper()
	now := func() time.Time { return time.Now().Add(ahead) }
	lim, err := throttle.New(rdb, throttle.Config{NowFunc: now})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(lim, worker.Config{
		Rules: mustRules(t, "fast:call tenant=1/10s"), Redis: rdb, NowFunc: now,
		WakeLead: worker.DefaultWakeLead + time.Second + ahead, MaxWait: worker.DefaultMaxWait + time.Second + ahead,
		DecisionFunc: func(ctx context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			if !d.Allowed {
				id, _ := asynq.GetTaskID(ctx)
				run.mu.Lock()
				run.denials[id]++
				run.mu.Unlock()
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		start := time.Now()
		id, _ := asynq.GetTaskID(ctx)
		run.mu.Lock()
		defer run.mu.Unlock()
		run.starts[id], run.by[id] = start, name
		return nil
	}, nil)
}

// TestFastClock: two asynq servers on one queue, "right" (the real clock) and "fast"
// (its limiter's and middleware's clock ahead by 900ms, within the default MaxSkew of 1s,
// or by 3s, beyond it), rule tenant=1/10s. Task A runs on right (the fast server is not
// started yet, so A's admission is logged by the right clock); then right stops and B,
// enqueued on the fast server, is denied and comes back for its slot. Within MaxSkew, B
// is denied exactly once and starts 10s after A (within 200ms), not 900ms early; beyond
// it (the limiter decides by Redis's TIME), B is denied at most twice and starts no
// earlier than 200ms before A + 10s. The window stays 10s: a shorter one would change
// the ratio of skew to window.
//
// asynq's own clock cannot be moved in-process: the fast server's asynq reads the real
// clock, so the wake instant the middleware computes on the fast clock (whole-second
// rounded there) reaches asynq up to the skew late, which on a machine whose clock is
// fast throughout would not happen. The fast server's WakeLead and MaxWait are the
// defaults plus the skew, to give that back, plus 1s, so that a busy machine's late
// forwarder cannot make B arrive after its slot: this test is about the clocks, not
// about the wake lead (TestMiddleware_reservationsDenyOnce's). With only the defaults,
// B arrived 0.2-0.6s before its slot, and once, on a loaded CI machine, 214ms after it.
func TestFastClock(t *testing.T) {
	for _, c := range []struct {
		name       string
		ahead      time.Duration
		maxDenials int
		late       time.Duration // the latest B may start after A + 10s (the earliest: 200ms before)
	}{
		{name: "WithinMaxSkew", ahead: 900 * time.Millisecond, maxDenials: 1, late: 200 * time.Millisecond},
		// Beyond MaxSkew the limiter decides by the server's TIME (the skew fallback), and B
		// may be denied twice: once on each clock. It still starts on time (9.995-9.997s
		// seen); the late bound leaves 500ms for that second trip through asynq's
		// forwarder on a loaded machine.
		{name: "BeyondMaxSkew", ahead: 3 * time.Second, maxDenials: 2, late: 500 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rdb := redistest.Start(t)
			run := &fastClockRun{starts: map[string]time.Time{}, denials: map[string]int{}, by: map[string]string{}}
			client := asynq.NewClientFromRedisClient(rdb)
			right := fastClockServer(t, rdb, "right", 0, run)
			if _, err := client.Enqueue(producer.NewTask("fast:call", nil, "acme", asynq.TaskID("A"))); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, 10*time.Second, "A ran", func() bool { run.mu.Lock(); defer run.mu.Unlock(); return !run.starts["A"].IsZero() })
			right.Shutdown()
			fastClockServer(t, rdb, "fast", c.ahead, run)
			if _, err := client.Enqueue(producer.NewTask("fast:call", nil, "acme", asynq.TaskID("B"))); err != nil {
				t.Fatal(err)
			}
			waitUntil(t, 30*time.Second, "B ran", func() bool { run.mu.Lock(); defer run.mu.Unlock(); return !run.starts["B"].IsZero() })
			run.mu.Lock()
			defer run.mu.Unlock()
			gap := run.starts["B"].Sub(run.starts["A"])
			t.Logf("ahead %s: B started %s after A, denied %d times, by %s", c.ahead, gap, run.denials["B"], run.by["B"])
			if run.by["A"] != "right" || run.by["B"] != "fast" {
				t.Fatalf("A ran on %q, B on %q; want right, fast", run.by["A"], run.by["B"])
			}
			if n := run.denials["B"]; n < 1 || n > c.maxDenials {
				t.Errorf("B denied %d times; want 1..%d", n, c.maxDenials)
			}
			if gap < 10*time.Second-200*time.Millisecond || gap > 10*time.Second+c.late {
				t.Errorf("B started %s after A; want 10s - 200ms to 10s + %s", gap, c.late)
			}
		})
	}
}
