package worker_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestOverdue: under "o:call tenant=1/1m max-delay=2s overdue=<outcome>", the window is
// full for the next minute, so a task would wait ~60s, more than max-delay: it ends as the
// rule says, at its first denial, and its reservation is cancelled. archive: archived with
// the reason as LastErr, never run; drop: neither run nor archived, a log line names it;
// run: runs at once, without an admission. A task whose slot is after its asynq Deadline
// is archived the same way without max-delay (overdue defaults to archive).
func TestOverdue(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		rule     string
		deadline bool // enqueue with Deadline(now+5s) instead of relying on max-delay
		archived int
		ran      int
		logged   string
	}{
		{rule: "o:call tenant=1/1m max-delay=2s overdue=archive", archived: 1, logged: "more than max-delay 2s"},
		{rule: "o:call tenant=1/1m max-delay=2s overdue=drop", logged: "more than max-delay 2s"},
		{rule: "o:call tenant=1/1m max-delay=2s overdue=run", ran: 1, logged: "more than max-delay 2s"},
		{rule: "o:call tenant=1/1m", deadline: true, archived: 1, logged: "after its deadline"},
	} {
		t.Run(tc.rule, func(t *testing.T) {
			t.Parallel()
			rdb := redistest.Start(t)
			lim := newLimiter(t, rdb)
			rules := mustRules(t, tc.rule)
			var logs syncBuffer
			mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var runs []bool // whether each run had an admission
			runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
				_, admitted := worker.DecisionFrom(ctx)
				mu.Lock()
				defer mu.Unlock()
				runs = append(runs, admitted)
				return nil
			}, nil)
			key := throttle.Key{TaskType: "o:call", Tenant: "acme"}
			if d, err := lim.Allow(context.Background(), throttle.Request{Key: key, Quotas: rules[0].Quotas}); err != nil || !d.Allowed {
				t.Fatalf("fill the window: %+v %v", d, err)
			}
			opts := []asynq.Option{asynq.TaskID("late"), asynq.MaxRetry(3)}
			if tc.deadline {
				opts = append(opts, asynq.Deadline(time.Now().Add(5*time.Second)))
			}
			if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(producer.NewTask("o:call", nil, "acme"), opts...); err != nil {
				t.Fatal(err)
			}
			insp := asynq.NewInspectorFromRedisClient(rdb)
			waitUntil(t, 10*time.Second, "the task ended", func() bool {
				qi := queueInfo(insp)
				return qi.Pending+qi.Active+qi.Retry+qi.Scheduled == 0 && len(logs.records(t)) > 0
			})
			mu.Lock()
			defer mu.Unlock()
			if qi := queueInfo(insp); qi.Archived != tc.archived || len(runs) != tc.ran {
				t.Errorf("archived %d, ran %d times; want %d and %d", qi.Archived, len(runs), tc.archived, tc.ran)
			}
			for _, admitted := range runs {
				if admitted {
					t.Errorf("overdue=run ran with an admission; want it run without one (over the limit)")
				}
			}
			if tc.archived == 1 {
				info, err := insp.GetTaskInfo("default", "late")
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(info.LastErr, tc.logged) || !strings.Contains(info.LastErr, rules[0].String()) {
					t.Errorf("LastErr %q, want the reason %q and the rule %q", info.LastErr, tc.logged, rules[0].String())
				}
			}
			var found bool
			for _, r := range logs.records(t) {
				if msg, _ := r["msg"].(string); strings.Contains(msg, tc.logged) && r["task_id"] == "late" && r["rule"] == rules[0].String() {
					found = true
				}
			}
			if !found {
				t.Errorf("no log line naming the task, the rule and %q: %v", tc.logged, logs.records(t))
			}
			// The reservation was cancelled: only the fill is left in the log.
			if n := len(logEntries(t, rdb, lim.RedisKey(key, throttle.ScopeTenant))); n != 1 {
				t.Errorf("the log holds %d entries, want 1 (the fill; the overdue task's reservation cancelled)", n)
			}
		})
	}
}
