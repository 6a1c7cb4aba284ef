package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// costPayload drives the CostFunc of the "y" rule in TestCost.
type costPayload struct {
	Cost int    `json:"cost"`
	Err  string `json:"err,omitempty"`
}

// TestCost runs tasks through a real asynq server under "x tenant=5/1m cost=header:batch"
// and a rule "y" whose CostFunc reads the payload (and wins over its CostHeader): a task
// takes as many slots in the tenant's window log as its cost says, 1 without the header;
// a task whose cost is unreadable, below 1, or above the limit is archived at once
// (SkipRetry, with retries left) with a LastErr and an error log line that name the rule
// and the offending cost, and writes nothing to the log.
func TestCost(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rules := mustRules(t, "x tenant=5/1m cost=header:batch")
	yRule := worker.Rule{
		TaskType:   "y",
		Quotas:     []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerMinute(5)}},
		CostHeader: "batch", // ignored: CostFunc wins
		CostFunc: func(task *asynq.Task) (int, error) {
			var p costPayload
			if err := json.Unmarshal(task.Payload(), &p); err != nil {
				return 0, err
			}
			if p.Err != "" {
				return 0, errors.New(p.Err)
			}
			return p.Cost, nil
		},
	}
	rules = append(rules, yRule)
	logs := &syncBuffer{}
	metrics, err := worker.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	mw, err := worker.New(lim, worker.Config{
		Rules:   rules,
		Redis:   rdb,
		Logger:  slog.New(slog.NewJSONHandler(logs, nil)),
		Metrics: metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ran := map[string]int{} // task id -> handler runs
	runAsynq(t, rdb, mw, func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		defer mu.Unlock()
		ran[id]++
		return nil
	}, nil)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	enqueue := func(id, typ string, payload []byte, headers map[string]string) {
		t.Helper()
		if _, err := client.Enqueue(asynq.NewTaskWithHeaders(typ, payload, headers),
			asynq.TaskID(id), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	state := func(id string) *asynq.TaskInfo {
		info, err := insp.GetTaskInfo("default", id)
		if err != nil {
			return &asynq.TaskInfo{}
		}
		return info
	}
	ctx := context.Background()
	zcard := func(typ, tenant string) int64 { // slots taken in the tenant's log
		t.Helper()
		return int64(len(admissions(t, rdb, lim.RedisKey(throttle.Key{TaskType: typ, Tenant: tenant}, throttle.ScopeTenant))))
	}
	// runOne enqueues a task, waits until it completed, and returns the slots its tenant's
	// log holds.
	runOne := func(id, typ string, payload []byte, headers map[string]string) int64 {
		t.Helper()
		enqueue(id, typ, payload, headers)
		waitUntil(t, 10*time.Second, "task "+id+" completed", func() bool {
			return state(id).State == asynq.TaskStateCompleted
		})
		return zcard(typ, headers["tenant"])
	}

	t.Run("admitted", func(t *testing.T) {
		if n := runOne("x-batch3", "x", nil, map[string]string{"tenant": "acme", "batch": "3"}); n != 3 {
			t.Errorf("after a task with batch=3: %d slots taken, want 3", n)
		}
		// The three slots are one event: one entry that carries its cost.
		if es := logEntries(t, rdb, lim.RedisKey(throttle.Key{TaskType: "x", Tenant: "acme"}, throttle.ScopeTenant)); len(es) != 1 ||
			!strings.HasPrefix(es[0].Member.(string), "*3:") {
			t.Errorf("entries %v: want one entry of cost 3", es)
		}
		if n := runOne("x-noheader", "x", nil, map[string]string{"tenant": "acme"}); n != 4 {
			t.Errorf("after a task without the batch header: %d slots taken, want 3+1", n)
		}
		// CostFunc: payload cost 2, header batch=4 ignored.
		if n := runOne("y-func2", "y", []byte(`{"cost":2}`), map[string]string{"tenant": "acme", "batch": "4"}); n != 2 {
			t.Errorf("after a task whose CostFunc says 2: %d slots taken, want 2", n)
		}
		// The window now holds 4 of 5 for x/acme: a cost of 2 no longer fits, 1 does.
		d, err := lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: "x", Tenant: "acme"}, Quotas: rules[0].Quotas, Cost: 2})
		if err != nil || d.Allowed {
			t.Errorf("Allow cost 2 at 4/5 = %+v, %v; want denied", d, err)
		}
	})

	t.Run("rejected", func(t *testing.T) {
		const xRule = `rule "x tenant=5/1m cost=header:batch"`
		const yRuleText = `rule "y tenant=5/1m cost=header:batch"`
		tests := []struct {
			id, typ  string
			payload  string
			batch    string // "" for none
			wantErr  []string
			wantBase error
		}{
			{id: "x-abc", typ: "x", batch: "abc", wantErr: []string{xRule, `batch="abc" is not an integer`}, wantBase: worker.ErrBadCost},
			{id: "x-empty", typ: "x", batch: " ", wantErr: []string{xRule, `batch=" " is not an integer`}, wantBase: worker.ErrBadCost},
			{id: "x-1.5", typ: "x", batch: "1.5", wantErr: []string{xRule, `batch="1.5" is not an integer`}, wantBase: worker.ErrBadCost},
			{id: "x-huge", typ: "x", batch: "99999999999999999999", wantErr: []string{xRule, `batch="99999999999999999999" is out of range (an int)`}, wantBase: worker.ErrBadCost},
			{id: "x-zero", typ: "x", batch: "0", wantErr: []string{xRule, "cost 0 is less than 1"}, wantBase: worker.ErrBadCost},
			{id: "x-neg", typ: "x", batch: "-2", wantErr: []string{xRule, "cost -2 is less than 1"}, wantBase: worker.ErrBadCost},
			{id: "x-six", typ: "x", batch: "6", wantErr: []string{xRule, "cost 6 exceeds quota tenant=5/1m"}, wantBase: throttle.ErrCostOverLimit},
			{id: "y-err", typ: "y", payload: `{"err":"no token count"}`, wantErr: []string{yRuleText, "CostFunc: no token count"}, wantBase: worker.ErrBadCost},
			{id: "y-zero", typ: "y", payload: `{"cost":0}`, batch: "1", wantErr: []string{yRuleText, "cost 0 is less than 1"}, wantBase: worker.ErrBadCost},
			{id: "y-six", typ: "y", payload: `{"cost":6}`, batch: "1", wantErr: []string{yRuleText, "cost 6 exceeds quota tenant=5/1m"}, wantBase: throttle.ErrCostOverLimit},
		}
		for _, tc := range tests {
			h := map[string]string{"tenant": "bad"}
			if tc.batch != "" {
				h["batch"] = tc.batch
			}
			enqueue(tc.id, tc.typ, []byte(tc.payload), h)
		}
		for _, tc := range tests {
			waitUntil(t, 10*time.Second, "task "+tc.id+" archived", func() bool {
				return state(tc.id).State == asynq.TaskStateArchived
			})
			info := state(tc.id)
			if info.Retried != 0 {
				t.Errorf("%s: archived with Retried %d, want 0 (SkipRetry, not retried)", tc.id, info.Retried)
			}
			for _, w := range append([]string{"worker: "}, tc.wantErr...) {
				if !strings.Contains(info.LastErr, w) {
					t.Errorf("%s: LastErr %q does not contain %q", tc.id, info.LastErr, w)
				}
			}
			if !strings.Contains(info.LastErr, asynq.SkipRetry.Error()) {
				t.Errorf("%s: LastErr %q does not wrap asynq.SkipRetry", tc.id, info.LastErr)
			}
			if !strings.Contains(info.LastErr, tc.wantBase.Error()) {
				t.Errorf("%s: LastErr %q does not wrap %q", tc.id, info.LastErr, tc.wantBase)
			}
		}
		for _, typ := range []string{"x", "y"} {
			if n := zcard(typ, "bad"); n != 0 {
				t.Errorf("rejected %s tasks wrote %d entries to their tenant's log, want 0", typ, n)
			}
		}
		mu.Lock()
		for _, tc := range tests {
			if ran[tc.id] != 0 {
				t.Errorf("%s: handler ran %d times, want 0", tc.id, ran[tc.id])
			}
		}
		mu.Unlock()

		// One error line per rejected task, naming its rule, its id, and the reason.
		byID := map[string]map[string]any{}
		for _, rec := range logs.records(t) {
			if id, ok := rec["task_id"].(string); ok {
				if _, dup := byID[id]; dup {
					t.Errorf("task %s logged twice: %v", id, rec)
				}
				byID[id] = rec
			}
		}
		for _, tc := range tests {
			rec, ok := byID[tc.id]
			if !ok {
				t.Errorf("%s: no log line; got %v", tc.id, logs.records(t))
				continue
			}
			wantRule := strings.TrimSuffix(strings.TrimPrefix(tc.wantErr[0], `rule "`), `"`)
			if rec["level"] != "ERROR" || rec["rule"] != wantRule || rec["task_type"] != tc.typ || rec["tenant"] != "bad" {
				t.Errorf("%s: log line %v; want level ERROR, rule %q, task_type %q, tenant bad", tc.id, rec, wantRule, tc.typ)
			}
			if msg, _ := rec["err"].(string); !strings.Contains(msg, tc.wantErr[1]) {
				t.Errorf("%s: logged err %q does not contain %q", tc.id, msg, tc.wantErr[1])
			}
		}
		if len(byID) != len(tests) {
			t.Errorf("%d log lines name a task, want %d (one per rejected task)", len(byID), len(tests))
		}
		qi := queueInfo(insp)
		if qi.Archived != len(tests) {
			t.Errorf("queue: %d archived, want %d", qi.Archived, len(tests))
		}
	})

	if got, want := outcomes(t, metrics, "x"), wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 2, worker.OutcomeRejected: 7}); !reflect.DeepEqual(got, want) {
		t.Errorf("x outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
	if got, want := outcomes(t, metrics, "y"), wantOutcomes(map[string]float64{worker.OutcomeAdmitted: 1, worker.OutcomeRejected: 3}); !reflect.DeepEqual(got, want) {
		t.Errorf("y outcomes: %s, want %s", fmtOutcomes(got), fmtOutcomes(want))
	}
}

func TestParseRules_cost(t *testing.T) {
	t.Parallel()
	rules, err := worker.ParseRules("x tenant=5/1m cost=header:batch; y cost=header:tokens type=2/1s")
	if err != nil {
		t.Fatal(err)
	}
	want := []worker.Rule{
		{TaskType: "x", Quotas: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerMinute(5)}}, CostHeader: "batch"},
		{TaskType: "y", Quotas: []throttle.Quota{{Scope: throttle.ScopeType, Limit: throttle.PerSecond(2)}}, CostHeader: "tokens"},
	}
	if !reflect.DeepEqual(rules, want) {
		t.Errorf("ParseRules = %+v, want %+v", rules, want)
	}
	if got := rules[0].String(); got != "x tenant=5/1m cost=header:batch" {
		t.Errorf("String() = %q", got)
	}
	if got := rules[1].String(); got != "y type=2/1s cost=header:tokens" {
		t.Errorf("String() = %q", got)
	}

	tests := []struct {
		in   string
		want []string
	}{
		{in: "x tenant=5/1s cost=tokens", want: []string{`rule 1 "x tenant=5/1s cost=tokens"`, `"cost=tokens"`, "cost=header:<name>"}},
		{in: "x tenant=5/1s cost=header:", want: []string{`rule 1 "x tenant=5/1s cost=header:"`, `"cost=header:"`, "cost=header:<name>"}},
		{in: "x tenant=5/1s cost=", want: []string{`"cost="`, "cost=header:<name>"}},
		{in: "a tenant=1/1s; x tenant=5/1s cost=header:a cost=header:b", want: []string{`rule 2 "x tenant=5/1s cost=header:a cost=header:b"`, `"cost=header:b"`, "want one cost=header:<name>"}},
		{in: "x tenant=5/1s cost=header:a cost=header:a", want: []string{`"cost=header:a"`, "want one"}},
		{in: "x cost=header:batch", want: []string{`rule 1 "x cost=header:batch"`, "has no quota"}},
	}
	for _, tc := range tests {
		_, err := worker.ParseRules(tc.in)
		if err == nil {
			t.Errorf("ParseRules(%q): no error", tc.in)
			continue
		}
		for _, w := range append([]string{"worker: "}, tc.want...) {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("ParseRules(%q) error %q does not contain %q", tc.in, err, w)
			}
		}
	}
}
