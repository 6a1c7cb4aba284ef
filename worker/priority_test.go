package worker_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// pinClock is the clock of the limiter and the middleware in TestMiddleware_queuePriority:
// pinned at an instant while the test sets a scene (every decision then is made at that
// very instant, so RetryAfters are exact), else the real clock, never before the last
// pin (it never runs back).
type pinClock struct {
	mu     sync.Mutex
	pinned bool
	at     time.Time
}

func (c *pinClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := time.Now(); !c.pinned && now.After(c.at) {
		return now
	}
	return c.at
}

func (c *pinClock) pin(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pinned, c.at = true, at
}

func (c *pinClock) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pinned = false
}

// TestMiddleware_queuePriority is issue 9's scenario on a real asynq server with Queues
// {"critical": 6, "low": 1} (QueuePriorities: critical 1, low 0) and tenant=1/1s: ten
// "low" tasks at T0, one "critical" task at T0+500ms. The critical task gets the slot at
// T0+1s that a low task's reservation held (RetryAfter exactly 500ms) and runs second;
// that low task, back for T0+1s, is denied once more (its reservation moved to T0+10s, its
// own earliest instant) and runs last. Each task runs once; the 11 starts are 1s apart.
//
// The clock is pinned at T0 while the low tasks are first decided and at T0+500ms while
// the critical one is, then runs (pinClock). The "low" queue is paused (asynq's
// PauseQueue) from the low tasks' first decisions until the critical task's, so no low
// task comes back in between, however slow the machine. The low tasks are let in at
// T0 = a whole second + 500ms: WakeLead 1s wakes a task for the slot at T0 + k s at
// T0 + (k-1) s, which asynq (whole seconds, rounded up by WrapConfig) makes the whole
// second k, 500ms before its slot, less the forwarder (100ms) and poll (~50ms): 350ms of
// margin against coming back late, and MaxWait 1.5s admits it early for its slot. The
// pause must only begin within 500ms of T0 (before the first low task is due back): it
// follows ten decisions of tasks already pending, one poll away.
func TestMiddleware_queuePriority(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	clock := &pinClock{}
	lim, err := throttle.New(rdb, throttle.Config{NowFunc: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	queues := map[string]int{"critical": 6, "low": 1}
	if got, want := worker.QueuePriorities(queues), map[string]int{"critical": 1, "low": 0}; !maps.Equal(got, want) {
		t.Fatalf("QueuePriorities(%v) = %v, want %v", queues, got, want)
	}
	rule := worker.Rule{TaskType: "prio:call", Quotas: []throttle.Quota{
		{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Second}}}}
	type decision struct {
		queue string
		d     throttle.Decision
	}
	var mu sync.Mutex
	decisions := map[string][]decision{}
	starts := map[string][]time.Time{} // DecisionFrom(ctx).At of each handler run, by task id
	mw, err := worker.New(lim, worker.Config{Rules: []worker.Rule{rule}, Redis: rdb,
		QueuePriority: worker.QueuePriorities(queues), WakeLead: time.Second, MaxWait: 1500 * time.Millisecond,
		NowFunc: clock.Now,
		DecisionFunc: func(ctx context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			id, _ := asynq.GetTaskID(ctx)
			queue, _ := asynq.GetQueueName(ctx)
			mu.Lock()
			defer mu.Unlock()
			decisions[id] = append(decisions[id], decision{queue, d})
		}})
	if err != nil {
		t.Fatal(err)
	}
	decided := func(ids ...string) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			if len(decisions[id]) == 0 {
				return false
			}
		}
		return true
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	if err := insp.PauseQueue("low"); err != nil {
		t.Fatal(err)
	}
	runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		d, ok := worker.DecisionFrom(ctx)
		if !ok || !d.Allowed {
			return fmt.Errorf("handler ran without an admission: %+v", d)
		}
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		defer mu.Unlock()
		starts[id] = append(starts[id], d.At)
		return nil
	}, func(cfg *asynq.Config) { cfg.Queues, cfg.Concurrency = queues, 12 })

	client := asynq.NewClientFromRedisClient(rdb)
	enqueue := func(id, queue string) {
		t.Helper()
		if _, err := client.Enqueue(producer.NewTask("prio:call", nil, "acme", asynq.TaskID(id), asynq.Queue(queue))); err != nil {
			t.Fatalf("enqueue %s: %v", id, err)
		}
	}
	var low []string
	for i := range 10 {
		low = append(low, fmt.Sprintf("low-%d", i))
		enqueue(low[i], "low")
	}
	// T0: the next whole second + 500ms, at least 100ms ahead.
	t0 := time.Now().Add(100 * time.Millisecond).Truncate(time.Second).Add(500 * time.Millisecond)
	if time.Until(t0) < 100*time.Millisecond {
		t0 = t0.Add(time.Second)
	}
	time.Sleep(time.Until(t0))
	clock.pin(t0)
	if err := insp.UnpauseQueue("low"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 5*time.Second, "the ten low tasks are decided", func() bool { return decided(low...) })
	if err := insp.PauseQueue("low"); err != nil {
		t.Fatal(err)
	}
	if late := time.Since(t0); late >= 500*time.Millisecond {
		t.Fatalf("the low queue was paused %v after T0, not within 500ms: a low task could be back before the critical one is decided", late)
	}
	clock.pin(t0.Add(500 * time.Millisecond))
	enqueue("critical", "critical")
	waitUntil(t, 5*time.Second, "the critical task is decided", func() bool { return decided("critical") })
	clock.release()
	if err := insp.UnpauseQueue("low"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, "all 11 tasks ran and both queues are empty", func() bool {
		mu.Lock()
		n := 0
		for _, s := range starts {
			n += len(s)
		}
		mu.Unlock()
		for _, q := range []string{"low", "critical"} {
			if qi, err := insp.GetQueueInfo(q); err != nil || qi.Pending+qi.Active+qi.Scheduled+qi.Retry > 0 {
				return false
			}
		}
		return n == 11
	})

	mu.Lock()
	defer mu.Unlock()
	at := func(ms int64) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	// The critical task: reserved at T0+1s, 500ms after its call; then admitted for it.
	c := decisions["critical"]
	if len(c) != 2 || c[0].queue != "critical" || c[0].d.Allowed || !c[0].d.Reserved || c[0].d.Held ||
		c[0].d.RetryAfter != 500*time.Millisecond || !c[0].d.At.Equal(at(500)) {
		t.Fatalf("critical task's decisions %+v; want a reservation made at T0+500ms with RetryAfter 500ms, then an admission", c)
	}
	if d := c[1].d; !d.Allowed || !d.Held || !d.At.Equal(at(1000)) {
		t.Errorf("critical task's second decision %+v, want an admission for its reservation at T0+1s", d)
	}
	// The low tasks: one admitted at T0; the others reserved at T0 + k s; the one that held
	// T0+1s is denied again (its reservation now at T0+10s), the others claim their slots.
	var displaced string
	var allStarts []time.Time
	for _, id := range low {
		ds := decisions[id]
		first := ds[0].d
		denials := 0
		for _, x := range ds {
			if !x.d.Allowed {
				denials++
			}
		}
		switch {
		case first.Allowed:
			if len(ds) != 1 || !first.At.Equal(at(0)) {
				t.Errorf("%s: decisions %+v, want one admission at T0", id, ds)
			}
		case first.Reserved && first.RetryAfter == time.Second:
			displaced = id
			if denials != 2 || len(ds) != 3 || !ds[1].d.Held || !ds[1].d.RetryAt().Equal(at(10_000)) || !ds[2].d.At.Equal(at(10_000)) {
				t.Errorf("%s (reserved at T0+1s): decisions %+v; want denied once more, held at T0+10s, then admitted then", id, ds)
			}
		default:
			k := first.RetryAfter.Milliseconds()
			if !first.Reserved || k < 2000 || k > 9000 || k%1000 != 0 || denials != 1 || len(ds) != 2 || !ds[1].d.At.Equal(at(k)) {
				t.Errorf("%s: decisions %+v; want a reservation at T0 + 2..9 s, then an admission for it", id, ds)
			}
		}
		if len(starts[id]) != 1 {
			t.Errorf("%s ran %d times, want once", id, len(starts[id]))
		}
		allStarts = append(allStarts, starts[id]...)
	}
	if displaced == "" {
		t.Errorf("no low task was reserved at T0+1s: %v", decisions)
	}
	if len(starts["critical"]) != 1 || !starts["critical"][0].Equal(at(1000)) {
		t.Errorf("critical task started at %v, want once, at T0+1s (second)", starts["critical"])
	}
	allStarts = append(allStarts, starts["critical"]...)
	slices.SortFunc(allStarts, time.Time.Compare)
	var want []time.Time
	for k := range int64(11) {
		want = append(want, at(1000*k))
	}
	if !slices.EqualFunc(allStarts, want, time.Time.Equal) || throttle.MaxInWindow(allStarts, time.Second) != 1 {
		t.Errorf("starts %v, want T0 + 0, 1, ..., 10 s: one a second", allStarts)
	}
}

// TestQueuePriorities: a queue's priority is its weight's rank among the distinct weights,
// 0 for the lowest; queues of one weight share a priority.
func TestQueuePriorities(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ queues, want map[string]int }{
		{nil, map[string]int{}},
		{map[string]int{"default": 1}, map[string]int{"default": 0}},
		{map[string]int{"critical": 6, "default": 3, "low": 1}, map[string]int{"critical": 2, "default": 1, "low": 0}},
		{map[string]int{"a": 5, "b": 5, "c": 2}, map[string]int{"a": 1, "b": 1, "c": 0}},
	} {
		if got := worker.QueuePriorities(c.queues); !maps.Equal(got, c.want) {
			t.Errorf("QueuePriorities(%v) = %v, want %v", c.queues, got, c.want)
		}
	}
}

// TestNew_queuePriorityRange: New refuses a queue priority outside [0, throttle.MaxPriority].
func TestNew_queuePriorityRange(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	for _, p := range []int{-1, throttle.MaxPriority + 1} {
		if _, err := worker.New(lim, worker.Config{Redis: rdb, QueuePriority: map[string]int{"critical": p}}); err == nil {
			t.Errorf("QueuePriority critical=%d: New returned no error", p)
		}
	}
	if _, err := worker.New(lim, worker.Config{Redis: rdb, QueuePriority: map[string]int{"critical": throttle.MaxPriority}}); err != nil {
		t.Errorf("QueuePriority critical=MaxPriority: %v", err)
	}
}
