package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// swPayload is the payload of TestThrottledForSeveralWindows: Fail real failures come
// before the task succeeds.
type swPayload struct {
	ID   string `json:"id"`
	Fail int    `json:"fail"`
}

// swTask is what the test saw of one task, by payload id (copies share it).
type swTask struct {
	maxRetry  int
	fail      int
	decisions []throttle.Decision
	failures  int // real failures returned by the handler
	successes int
	success   time.Time // Decision.At of the successful run
}

// TestThrottledForSeveralWindows runs, under "sw:call tenant=1/1s", one tenant's 4 tasks
// with MaxRetry(0) and 2 with MaxRetry(2) that fail for real twice first. Other traffic
// holds the tenant's next slots at the start, and again right after each of the failing
// tasks spends its last retry, so that every task is throttled across several windows
// when asynq would archive it on a plain error (no retry left). Each must then run
// exactly once more successfully, as a copy (worker.HeaderDeferrals), with nothing
// archived, the retries left exactly as the real failures left them, and never two
// handler starts in one 1s window.
func TestThrottledForSeveralWindows(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rules := mustRules(t, "sw:call tenant=1/1s")
	key := throttle.Key{TaskType: "sw:call", Tenant: "acme"}
	ctx := context.Background()

	// hold takes the tenant's next n slots for other work: the first free one is
	// admitted if free now, the others held as reservations one window apart; the
	// middleware cannot start a task before the last of them has left the window.
	var blockers int
	hold := func(n int) (last time.Time, err error) {
		for i := 0; i < n; i++ {
			blockers++
			d, err := lim.Allow(ctx, throttle.Request{Key: key, Quotas: rules[0].Quotas,
				Reservation: fmt.Sprintf("other-work-%d", blockers)})
			if err != nil {
				return time.Time{}, err
			}
			last = d.RetryAt()
		}
		return last, nil
	}

	var mu sync.Mutex
	tasks := map[string]*swTask{}
	var starts []time.Time    // Decision.At of every handler run
	var heldUntil []time.Time // instants before which no task may start
	var problems []string     // found inside the handler
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb,
		DecisionFunc: func(_ context.Context, task *asynq.Task, _ throttle.Key, d throttle.Decision) {
			var p swPayload
			_ = json.Unmarshal(task.Payload(), &p)
			mu.Lock()
			defer mu.Unlock()
			if st := tasks[p.ID]; st != nil {
				st.decisions = append(st.decisions, d)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	runAsynq(t, rdb, mw, func(ctx context.Context, task *asynq.Task) error {
		var p swPayload
		if err := json.Unmarshal(task.Payload(), &p); err != nil {
			return err
		}
		d, ok := worker.DecisionFrom(ctx)
		mu.Lock()
		defer mu.Unlock()
		if !ok || !d.Allowed {
			problems = append(problems, fmt.Sprintf("%s ran without an admission: %+v", p.ID, d))
		}
		starts = append(starts, d.At)
		st := tasks[p.ID]
		if st.failures < p.Fail {
			st.failures++
			if st.failures == p.Fail { // its last retry is spent: keep it waiting a while
				last, err := hold(3)
				if err != nil {
					problems = append(problems, err.Error())
				}
				heldUntil = append(heldUntil, last)
			}
			return errors.New("a real failure")
		}
		st.successes++
		st.success = d.At
		return nil
	}, func(cfg *asynq.Config) {
		// Real failures come back at once, while the failed run's slot is still taken.
		cfg.RetryDelayFunc = func(int, error, *asynq.Task) time.Duration { return 0 }
	})

	first, err := hold(4)
	if err != nil {
		t.Fatal(err)
	}
	heldUntil = append(heldUntil, first)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	for i := 1; i <= 6; i++ {
		p := swPayload{ID: fmt.Sprintf("sw-%d", i)}
		st := &swTask{}
		if i > 4 {
			st.maxRetry, st.fail, p.Fail = 2, 2, 2
		}
		mu.Lock()
		tasks[p.ID] = st
		mu.Unlock()
		payload, _ := json.Marshal(p)
		if _, err := producer.Enqueue(ctx, client, "sw:call", payload, "acme", asynq.TaskID(p.ID),
			asynq.MaxRetry(st.maxRetry), asynq.Retention(time.Hour), asynq.Timeout(time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	done := func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, st := range tasks {
			if st.successes == 0 {
				return false
			}
		}
		return true
	}
	waitUntil(t, 60*time.Second, "every task succeeded", done)
	waitUntil(t, 10*time.Second, "the queue is idle", func() bool {
		qi := queueInfo(insp)
		return qi.Pending+qi.Active+qi.Scheduled+qi.Retry == 0
	})
	time.Sleep(300 * time.Millisecond) // let a duplicate run, if any, show up

	mu.Lock()
	defer mu.Unlock()
	for _, p := range problems {
		t.Error(p)
	}
	ids := make([]string, 0, len(tasks))
	for id := range tasks {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		st := tasks[id]
		denials := 0
		for _, d := range st.decisions {
			if !d.Allowed {
				denials++
			}
		}
		t.Logf("%s: %d decisions, %d denials, %d real failures, ran successfully at +%s",
			id, len(st.decisions), denials, st.failures, st.success.Sub(first).Round(time.Millisecond))
		if st.successes != 1 || st.failures != st.fail {
			t.Errorf("%s: %d successful runs and %d real failures, want 1 and %d", id, st.successes, st.failures, st.fail)
		}
		if len(st.decisions) == 0 || st.decisions[0].Allowed {
			t.Errorf("%s: its first decision was not a denial: the tenant's slots were held", id)
		}
	}
	// No task started while other work held the tenant's slots (a reservation at h
	// counts until h + 1s), and never two in one 1s window.
	for _, h := range heldUntil {
		for _, s := range starts {
			if s.After(h.Add(-time.Second)) && s.Before(h.Add(time.Second)) {
				t.Errorf("a task started at %s, within 1s of a slot held by other work at %s",
					s.Format("15:04:05.000"), h.Format("15:04:05.000"))
			}
		}
	}
	if got := throttle.MaxInWindow(starts, time.Second); got != 1 || len(starts) != 10 {
		t.Errorf("%d handler starts, at most %d in one 1s window; want 10 (6 successes, 4 real failures), at most 1", len(starts), got)
	}

	qi := queueInfo(insp)
	if qi.Archived != 0 || qi.Completed != 6 {
		t.Errorf("queue: %d archived, %d completed; want 0 and 6", qi.Archived, qi.Completed)
	}
	completed, err := insp.ListCompletedTasks("default", asynq.PageSize(100))
	if err != nil {
		t.Fatal(err)
	}
	for _, info := range completed {
		var p swPayload
		_ = json.Unmarshal(info.Payload, &p)
		st := tasks[p.ID]
		if st == nil {
			t.Errorf("completed task %s has an unknown payload %q", info.ID, info.Payload)
			continue
		}
		// No retry left (MaxRetry 0, or both retries spent) when denied: each completed
		// as a copy of the first task.
		n, _ := strconv.Atoi(info.Headers[worker.HeaderDeferrals])
		if n < 1 || info.Headers[worker.HeaderOriginID] != p.ID || info.ID != fmt.Sprintf("%s:deferred:%d", p.ID, n) {
			t.Errorf("completed %s: headers %v; want a copy of %s (%s >= 1, %s = %s, ID %s:deferred:<n>)",
				info.ID, info.Headers, p.ID, worker.HeaderDeferrals, worker.HeaderOriginID, p.ID, p.ID)
		}
		if info.Headers[producer.TenantHeader] != "acme" {
			t.Errorf("completed %s lost its tenant header: %v", info.ID, info.Headers)
		}
		// Throttling spent no retry: what is left is what the real failures left.
		if left, want := info.MaxRetry-info.Retried, st.maxRetry-st.fail; left != want {
			t.Errorf("completed %s: MaxRetry %d - Retried %d = %d, want %d", info.ID, info.MaxRetry, info.Retried, left, want)
		}
		if info.Retention != time.Hour || info.Timeout != time.Minute {
			t.Errorf("completed %s: Retention %s, Timeout %s; want the original's 1h and 1m", info.ID, info.Retention, info.Timeout)
		}
	}
}
