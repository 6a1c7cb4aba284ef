package worker_test

import (
	"context"
	"log/slog"
	"strings"
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

// reloadEvent is one call of Config.OverrideReloadFunc.
type reloadEvent struct {
	version int64
	err     error
}

// overrideHarness runs the middleware in-process on one rule with overrides, calling it
// directly for each task and recording what the limiter decided.
type overrideHarness struct {
	t      *testing.T
	h      asynq.Handler
	events chan reloadEvent
	oks    int // good reloads seen by next
	mu     sync.Mutex
	quotas []string // the deciding quota of each decision, "+" before an admission's
}

func newOverrideHarness(t *testing.T, rdb redis.UniversalClient, store *worker.OverrideStore, rules string, interval time.Duration, log *slog.Logger) *overrideHarness {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	oh := &overrideHarness{t: t, events: make(chan reloadEvent, 1000)}
	mw, err := worker.New(newLimiter(t, rdb), worker.Config{
		Rules: mustRules(t, rules), Redis: rdb, Context: ctx, Logger: log, SweepInterval: -1,
		Overrides: store, OverrideInterval: interval,
		OverrideReloadFunc: func(v int64, err error) { oh.events <- reloadEvent{v, err} },
		DecisionFunc: func(_ context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			oh.mu.Lock()
			defer oh.mu.Unlock()
			q := d.Quota.String()
			if d.Allowed {
				q = "+" + q
			}
			oh.quotas = append(oh.quotas, q)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	oh.h = mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	return oh
}

// run processes n tasks of taskType for tenant, one after the other, and returns how many
// the limiter admitted and the quota that denied the last one ("" if none was denied).
func (oh *overrideHarness) run(taskType, tenant string, n int) (admitted int, denied string) {
	oh.t.Helper()
	oh.mu.Lock()
	from := len(oh.quotas)
	oh.mu.Unlock()
	for range n {
		_ = oh.h.ProcessTask(context.Background(), producer.NewTask(taskType, nil, tenant))
	}
	oh.mu.Lock()
	defer oh.mu.Unlock()
	for _, q := range oh.quotas[from:] {
		if strings.HasPrefix(q, "+") {
			admitted++
		} else {
			denied = q
		}
	}
	return admitted, denied
}

// next waits up to 10s for the next reload event.
func (oh *overrideHarness) next() reloadEvent {
	oh.t.Helper()
	select {
	case e := <-oh.events:
		if e.err == nil {
			oh.oks++
		}
		return e
	case <-time.After(10 * time.Second):
		oh.t.Fatal("no override reload within 10s")
		return reloadEvent{}
	}
}

// waitOK waits for the reload that puts version in force, skipping earlier good ones.
func (oh *overrideHarness) waitOK(version int64) {
	oh.t.Helper()
	for {
		e := oh.next()
		if e.err != nil {
			oh.t.Fatalf("reload failed while waiting for version %d: %v", version, e.err)
		}
		if e.version == version {
			return
		}
	}
}

func (oh *overrideHarness) check(taskType, tenant string, n, wantAdmitted int, wantDenied string) {
	oh.t.Helper()
	if got, denied := oh.run(taskType, tenant, n); got != wantAdmitted || denied != wantDenied {
		oh.t.Errorf("%s of %q: %d tasks, %d admitted, denied by %q; want %d admitted, denied by %q",
			taskType, tenant, n, got, denied, wantAdmitted, wantDenied)
	}
}

// TestOverrides_reload runs the middleware with "r:call tenant=2/1m" and overrides in a
// redis-server: the overrides stored before New are in force at once; a change is put in
// force at the next check (the exact new limit decides the next tasks); a set that does
// not parse leaves the last good one in force, is reported for each bad version and
// logged once; a Redis outage likewise, logged once, and the set in force survives it.
func TestOverrides_reload(t *testing.T) {
	t.Parallel()
	srv := redistest.StartServer(t, "--appendonly", "yes", "--appendfsync", "always")
	rdb := srv.Client()
	ctx := context.Background()
	store, err := worker.NewOverrideStore(rdb, "")
	if err != nil {
		t.Fatal(err)
	}
	set := func(kind worker.OverrideKind, name, text string) int64 {
		t.Helper()
		c, err := store.Set(ctx, kind, name, text)
		if err != nil {
			t.Fatal(err)
		}
		return c.Version
	}
	set(worker.OverrideTier, "pro", "tenant=4/1m")
	set(worker.OverrideTenantTier, "acme", "pro")
	var logs syncBuffer
	oh := newOverrideHarness(t, rdb, store, "r:call tenant=2/1m", 100*time.Millisecond, slog.New(slog.NewJSONHandler(&logs, nil)))
	if e := oh.next(); e != (reloadEvent{version: 2}) {
		t.Fatalf("first reload %+v, want version 2 read by New", e)
	}
	oh.check("r:call", "acme", 5, 4, "tenant=4/1m")
	oh.check("r:call", "globex", 3, 2, "tenant=2/1m")

	// A tenant's own limits and a new tenant of the tier, picked up without a restart.
	set(worker.OverrideTenant, "initech", "tenant=1/1m")
	oh.waitOK(set(worker.OverrideTenantTier, "soylent", "pro"))
	oh.check("r:call", "initech", 2, 1, "tenant=1/1m")

	// Written by hand, not through the store: a tier with a type= quota does not parse.
	bad := func(pipe func(redis.Pipeliner)) {
		t.Helper()
		if _, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			pipe(p)
			p.HIncrBy(ctx, store.Key(), "version", 1)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	bad(func(p redis.Pipeliner) { p.HSet(ctx, store.Key(), "tier:pro", "type=1/1s") })
	if e := oh.next(); e.version != 4 || e.err == nil || !strings.Contains(e.err.Error(), `field "tier:pro"="type=1/1s"`) {
		t.Fatalf("reload of a bad set: %+v; want an error naming the field, version 4 still in force", e)
	}
	bad(func(p redis.Pipeliner) { p.HSet(ctx, store.Key(), "tenant-tier:umbrella", "pro") })
	if e := oh.next(); e.version != 4 || e.err == nil {
		t.Fatalf("reload of a second bad version: %+v; want an error, version 4 in force", e)
	}
	oh.check("r:call", "soylent", 5, 4, "tenant=4/1m") // pro is still 4/1m

	oh.waitOK(set(worker.OverrideTier, "pro", "tenant=3/1m")) // version 7: good again
	oh.check("r:call", "umbrella", 4, 3, "tenant=3/1m")
	oh.check("r:call", "globex", 1, 0, "tenant=2/1m")

	// An outage: each check fails, the set in force stays; one line for the whole outage.
	srv.Stop()
	for range 2 {
		if e := oh.next(); e.version != 7 || e.err == nil {
			t.Fatalf("reload during an outage: %+v; want an error, version 7 in force", e)
		}
	}
	srv.Restart("--appendonly", "yes", "--appendfsync", "always")
	waitUntil(t, 10*time.Second, "the reloader logs that the overrides are readable again", func() bool {
		return countMsg(t, &logs, "throttle: overrides readable again") == 1
	})
	for len(oh.events) > 0 { // failures of checks made before the restart
		if e := oh.next(); e.version != 7 || e.err == nil {
			t.Fatalf("reload event %+v after the restart; want only failures at version 7", e)
		}
	}
	oh.check("r:call", "hooli", 4, 2, "tenant=2/1m") // hooli's limit: the default 2/1m...
	set(worker.OverrideTenantTier, "hooli", "pro")
	oh.waitOK(8)
	oh.check("r:call", "hooli", 2, 1, "tenant=3/1m") // ...then pro's 3/1m, 2 used: one more

	const warn = "throttle: cannot read the overrides; the set read last stays in force until they can be read (logged once)"
	if n := countMsg(t, &logs, warn); n != 2 {
		t.Errorf("%d lines %q, want 2: one for the bad set (two versions), one for the outage", n, warn)
	}
	if n, want := countMsg(t, &logs, "throttle: overrides in force"), oh.oks; n != want {
		t.Errorf("%d lines of overrides in force, want %d: one per good reload", n, want)
	}
}

// countMsg counts the log records with message msg.
func countMsg(t *testing.T, logs *syncBuffer, msg string) int {
	n := 0
	for _, r := range logs.records(t) {
		if r["msg"] == msg {
			n++
		}
	}
	return n
}
