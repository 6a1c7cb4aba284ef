package worker_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// This file runs the sweep (worker.Sweeper) against a real asynq server: a reservation
// whose task asynq no longer holds is released, that of a task replaced by its copy is
// not, and the middleware runs the sweep on its own.

const sweepType = "sweep:call"

// sweepRecorder records, per task id, the limiter's decisions (DecisionFunc) and the
// admission instants of the handler's runs.
type sweepRecorder struct {
	mu        sync.Mutex
	decisions map[string][]throttle.Decision
	admitted  map[string][]time.Time // DecisionFrom(ctx).At of every handler run
}

func (r *sweepRecorder) decisionsOf(id string) []throttle.Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.decisions[id])
}

func (r *sweepRecorder) admittedOf(id string) []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.admitted[id])
}

// sweepStart runs an asynq server on rdb (runAsynq) whose tasks go through New(lim, cfg)
// with the rule "sweep:call <quotas>", and returns what it records.
func sweepStart(t *testing.T, rdb *redis.Client, lim *throttle.Limiter, quotas string, cfg worker.Config) *sweepRecorder {
	t.Helper()
	rec := &sweepRecorder{decisions: map[string][]throttle.Decision{}, admitted: map[string][]time.Time{}}
	cfg.Rules, cfg.Redis = mustRules(t, sweepType+" "+quotas), rdb
	cfg.DecisionFunc = func(ctx context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
		id, _ := asynq.GetTaskID(ctx)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		rec.decisions[id] = append(rec.decisions[id], d)
	}
	mw, err := worker.New(lim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runAsynq(t, rdb, mw, func(ctx context.Context, _ *asynq.Task) error {
		d, ok := worker.DecisionFrom(ctx)
		if !ok || !d.Allowed {
			return fmt.Errorf("handler ran without an admission: %+v", d)
		}
		id, _ := asynq.GetTaskID(ctx)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		rec.admitted[id] = append(rec.admitted[id], d.At)
		return nil
	}, nil)
	return rec
}

// sweepEnqueue enqueues a "sweep:call" task (tenant "") with id and MaxRetry(maxRetry).
func sweepEnqueue(t *testing.T, client *asynq.Client, id string, maxRetry int) {
	t.Helper()
	if _, err := client.Enqueue(asynq.NewTask(sweepType, nil), asynq.TaskID(id), asynq.MaxRetry(maxRetry)); err != nil {
		t.Fatalf("enqueue %s: %v", id, err)
	}
}

// waitState waits until asynq holds task id of the default queue in state.
func waitState(t *testing.T, insp *asynq.Inspector, id string, state asynq.TaskState) {
	t.Helper()
	waitUntil(t, 20*time.Second, fmt.Sprintf("task %s is %s", id, state), func() bool {
		info, err := insp.GetTaskInfo("default", id)
		return err == nil && info.State == state
	})
}

// reservations lists the reservations held on lim for taskType, by token.
func reservations(t *testing.T, lim *throttle.Limiter, taskType string) map[string]throttle.Reservation {
	t.Helper()
	out := map[string]throttle.Reservation{}
	if err := lim.Reservations(context.Background(), taskType, func(r throttle.Reservation) bool {
		out[r.Token] = r
		return true
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// holderName is the Holder the middleware writes for task id of the default queue.
func holderName(id string) string { return "7:default" + id }

func newSweeper(t *testing.T, lim *throttle.Limiter, rdb redis.UniversalClient, cfg worker.SweeperConfig) *worker.Sweeper {
	t.Helper()
	s, err := worker.NewSweeper(lim, rdb, []string{sweepType}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSweeper_Sweep_deletedTasks is the core v2 issue's case 6 end to end. Rule
// tenant=10/1h, the limiter's clock at T0: T1-T10 run, T11-T30 are denied and wait in
// asynq's retry state, holding reservations at T0+1h (10) and T0+2h (10). The 20 are
// deleted with the Inspector; one sweep releases their 20 reservations, so at T0+10min
// T31 is told the slot at T0+1h: RetryAfter 3,000,000ms, not the slot at T0+3h
// (10,200,000ms) that the deleted tasks' reservations would leave it.
func TestSweeper_Sweep_deletedTasks(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	t0 := time.Now().Truncate(time.Second)
	var clock atomic.Int64
	clock.Store(t0.UnixMilli())
	lim, err := throttle.New(rdb, throttle.Config{NowFunc: func() time.Time { return time.UnixMilli(clock.Load()) }, MaxSkew: -1})
	if err != nil {
		t.Fatal(err)
	}
	rec := sweepStart(t, rdb, lim, "tenant=10/1h", worker.Config{SweepInterval: -1})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)

	for i := 1; i <= 10; i++ {
		sweepEnqueue(t, client, fmt.Sprintf("T%d", i), 25)
	}
	waitUntil(t, 20*time.Second, "T1-T10 ran", func() bool {
		for i := 1; i <= 10; i++ {
			if len(rec.admittedOf(fmt.Sprintf("T%d", i))) != 1 {
				return false
			}
		}
		return true
	})
	for i := 11; i <= 30; i++ {
		sweepEnqueue(t, client, fmt.Sprintf("T%d", i), 25)
	}
	slots := map[time.Duration]int{}
	for i := 11; i <= 30; i++ {
		id := fmt.Sprintf("T%d", i)
		waitState(t, insp, id, asynq.TaskStateRetry)
		ds := rec.decisionsOf(id)
		if len(ds) != 1 || !ds[0].Reserved {
			t.Fatalf("%s: decisions %+v, want one reserving denial", id, ds)
		}
		slots[ds[0].RetryAfter]++
	}
	if want := map[time.Duration]int{time.Hour: 10, 2 * time.Hour: 10}; !mapsEqual(slots, want) {
		t.Fatalf("T11-T30 reserved %v (RetryAfter: tasks), want %v", slots, want)
	}
	held := reservations(t, lim, sweepType)
	for i := 11; i <= 30; i++ {
		id := fmt.Sprintf("T%d", i)
		if r, ok := held[id]; !ok || r.Holder != holderName(id) {
			t.Fatalf("reservation of %s = %+v (listed: %v), want one held by %q", id, r, ok, holderName(id))
		}
	}

	for i := 11; i <= 30; i++ {
		if err := insp.DeleteTask("default", fmt.Sprintf("T%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	released, err := newSweeper(t, lim, rdb, worker.SweeperConfig{Grace: -1}).Sweep(context.Background())
	if err != nil || released != 20 {
		t.Fatalf("Sweep = %d, %v; want 20 released", released, err)
	}
	if left := reservations(t, lim, sweepType); len(left) != 0 {
		t.Errorf("reservations left after the sweep: %v, want none", left)
	}

	clock.Store(t0.Add(10 * time.Minute).UnixMilli())
	sweepEnqueue(t, client, "T31", 25)
	waitUntil(t, 20*time.Second, "T31 was decided", func() bool { return len(rec.decisionsOf("T31")) > 0 })
	if d := rec.decisionsOf("T31")[0]; !d.Reserved || d.RetryAfter != 3_000_000*time.Millisecond {
		t.Errorf("T31 at T0+10min: %+v, want reserved with RetryAfter 3,000,000ms (the slot at T0+1h)", d)
	}
}

func mapsEqual[K comparable, V comparable](a, b map[K]V) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestSweeper_Sweep_keepsCopies: rule tenant=1/3s. A runs. B, MaxRetry(0), is denied and
// replaced by its copy B:deferred:1 (asynq would archive B), which holds B's reservation
// for A's instant + 3s. C, MaxRetry(5), is denied, reserves the slot after, and is deleted.
// One sweep releases C's reservation, and only it: B's stays, held by the copy, and the
// copy then runs at its slot, A's instant + 3s.
func TestSweeper_Sweep_keepsCopies(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rec := sweepStart(t, rdb, lim, "tenant=1/3s", worker.Config{SweepInterval: -1})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)

	sweepEnqueue(t, client, "A", 0)
	waitUntil(t, 20*time.Second, "A ran", func() bool { return len(rec.admittedOf("A")) == 1 })
	sweepEnqueue(t, client, "B", 0)
	waitState(t, insp, "B:deferred:1", asynq.TaskStateScheduled)
	waitUntil(t, 20*time.Second, "B is revoked", func() bool {
		_, err := insp.GetTaskInfo("default", "B")
		return errors.Is(err, asynq.ErrTaskNotFound)
	})
	sweepEnqueue(t, client, "C", 5)
	waitState(t, insp, "C", asynq.TaskStateRetry)
	if err := insp.DeleteTask("default", "C"); err != nil {
		t.Fatal(err)
	}

	released, err := newSweeper(t, lim, rdb, worker.SweeperConfig{Grace: -1}).Sweep(context.Background())
	if err != nil || released != 1 {
		t.Fatalf("Sweep = %d, %v; want 1 released (C's)", released, err)
	}
	left := reservations(t, lim, sweepType)
	if r, ok := left["B"]; len(left) != 1 || !ok || r.Holder != holderName("B:deferred:1") {
		t.Fatalf("reservations after the sweep: %+v; want only B's, held by %q", left, holderName("B:deferred:1"))
	}

	a := rec.admittedOf("A")[0]
	waitUntil(t, 20*time.Second, "B:deferred:1 ran", func() bool { return len(rec.admittedOf("B:deferred:1")) == 1 })
	if got, want := rec.admittedOf("B:deferred:1")[0], a.Add(3*time.Second); !got.Equal(want) {
		t.Errorf("B:deferred:1 admitted at %s, want its slot %s (A's + 3s)", got.Format(time.StampMilli), want.Format(time.StampMilli))
	}
}

// TestSweeper_Sweep_keepsCopyRunEarly: rule tenant=1/1h. B, MaxRetry(0), is denied and
// replaced by B:deferred:1, due in about an hour. Run by hand (Inspector.RunTask, as
// asynqmon's "run" button does), the copy is denied until its reservation's instant and
// replaced by B:deferred:2; the decision, writing nothing, leaves the reservation's Holder
// naming B:deferred:1, which is gone. The sweep keeps it: it asks about the copy after the
// holder too.
func TestSweeper_Sweep_keepsCopyRunEarly(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rec := sweepStart(t, rdb, lim, "tenant=1/1h", worker.Config{SweepInterval: -1})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)

	sweepEnqueue(t, client, "A", 0)
	waitUntil(t, 20*time.Second, "A ran", func() bool { return len(rec.admittedOf("A")) == 1 })
	sweepEnqueue(t, client, "B", 0)
	waitState(t, insp, "B:deferred:1", asynq.TaskStateScheduled)
	if err := insp.RunTask("default", "B:deferred:1"); err != nil {
		t.Fatal(err)
	}
	waitState(t, insp, "B:deferred:2", asynq.TaskStateScheduled)
	waitUntil(t, 20*time.Second, "B:deferred:1 is revoked", func() bool {
		_, err := insp.GetTaskInfo("default", "B:deferred:1")
		return errors.Is(err, asynq.ErrTaskNotFound)
	})
	if ds := rec.decisionsOf("B:deferred:1"); len(ds) != 1 || ds[0].Allowed || !ds[0].Held {
		t.Fatalf("B:deferred:1's decisions: %+v; want one denial for its held reservation", ds)
	}
	before := reservations(t, lim, sweepType)
	t.Logf("B's reservation is held by %q after B:deferred:1 was replaced", before["B"].Holder)

	released, err := newSweeper(t, lim, rdb, worker.SweeperConfig{Grace: -1}).Sweep(context.Background())
	if err != nil || released != 0 {
		t.Fatalf("Sweep = %d, %v; want 0 released", released, err)
	}
	if after := reservations(t, lim, sweepType); len(after) != 1 || after["B"] != before["B"] {
		t.Errorf("reservations after the sweep: %+v; want B's as before, %+v", after, before["B"])
	}
}

// TestSweeper_Sweep_lockGraceAndForeignHolders, on reservations made with the limiter
// alone, for tasks asynq never held: a sweep releases none younger than Grace; a second
// sweeper skips the type while the first one's lock lasts (4/5 of its Interval); and once
// it has ended, releases the reservation held by a missing task and keeps those whose
// Holder the middleware did not write.
func TestSweeper_Sweep_lockGraceAndForeignHolders(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	ctx := context.Background()
	q := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Hour}}}
	for _, r := range []struct{ token, holder string }{{"", ""}, {"gone", holderName("gone")}, {"none", ""}, {"odd", "odd"}} {
		d, err := lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: sweepType, Tenant: "acme"}, Quotas: q,
			Reservation: r.token, Holder: r.holder})
		if err != nil || d.Allowed != (r.token == "") || d.Reserved != (r.token != "") {
			t.Fatalf("decision for %q: %+v, %v", r.token, d, err)
		}
	}
	// Asynq must know the queue: else every lookup is ErrQueueNotFound, a doubt.
	if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask("other", nil), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}

	first := newSweeper(t, lim, rdb, worker.SweeperConfig{Interval: 3 * time.Second, Grace: time.Hour})
	second := newSweeper(t, lim, rdb, worker.SweeperConfig{Interval: 3 * time.Second, Grace: -1})
	if n, err := first.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("first Sweep (Grace 1h) = %d, %v; want 0", n, err)
	}
	if n, err := second.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("second Sweep while the first's lock lasts = %d, %v; want 0", n, err)
	}
	if got := len(reservations(t, lim, sweepType)); got != 3 {
		t.Fatalf("%d reservations, want 3", got)
	}
	start := time.Now()
	var n int
	waitUntil(t, 10*time.Second, "the second sweeper released one", func() bool {
		var err error
		if n, err = second.Sweep(ctx); err != nil {
			t.Fatal(err)
		}
		return n != 0
	})
	if n != 1 || time.Since(start) < 2*time.Second {
		t.Errorf("second Sweep released %d after %s; want 1, after the 2.4s lock", n, time.Since(start))
	}
	left := reservations(t, lim, sweepType)
	if _, ok := left["gone"]; len(left) != 2 || ok {
		t.Errorf("reservations left: %v; want none and odd", left)
	}
}

// TestSweeper_Sweep_doubt: when asynq cannot answer (here: its Redis has no such queue,
// as when the client is not asynq's), nothing is released, and one Warn line says so.
func TestSweeper_Sweep_doubt(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	ctx := context.Background()
	q := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Hour}}}
	for _, token := range []string{"", "x", "y"} {
		if _, err := lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: sweepType}, Quotas: q,
			Reservation: token, Holder: holderName(token)}); err != nil {
			t.Fatal(err)
		}
	}
	var logs syncBuffer
	s := newSweeper(t, lim, rdb, worker.SweeperConfig{Grace: -1, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	if n, err := s.Sweep(ctx); err != nil || n != 0 {
		t.Fatalf("Sweep = %d, %v; want 0", n, err)
	}
	if got := len(reservations(t, lim, sweepType)); got != 2 {
		t.Errorf("%d reservations left, want 2", got)
	}
	var warns []map[string]any
	for _, r := range logs.records(t) {
		if r["level"] == "WARN" {
			warns = append(warns, r)
		}
	}
	if len(warns) != 1 || warns[0]["reservations"] != float64(2) || !strings.Contains(fmt.Sprint(warns[0]["err"]), "queue not found") {
		t.Errorf("warnings %v; want one, for 2 reservations, saying queue not found", warns)
	}
}

// TestSweeper_Run: Run sweeps every Interval until its context ends, then returns the
// context's error.
func TestSweeper_Run(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	ctx, cancel := context.WithCancel(context.Background())
	q := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 1, Window: time.Hour}}}
	if _, err := asynq.NewClientFromRedisClient(rdb).Enqueue(asynq.NewTask("other", nil), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}
	s := newSweeper(t, lim, rdb, worker.SweeperConfig{Interval: 50 * time.Millisecond, Grace: -1})
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	for i := range 3 { // each new reservation is released by a later sweep
		token := fmt.Sprintf("r%d", i)
		if _, err := lim.Allow(ctx, throttle.Request{Key: throttle.Key{TaskType: sweepType}, Quotas: q,
			Reservation: token, Holder: holderName(token)}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, 10*time.Second, token+" was released", func() bool {
			_, held := reservations(t, lim, sweepType)[token]
			return !held
		})
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of its context's end")
	}
}

// TestNew_startsSweep: the middleware sweeps on its own, every Config.SweepInterval
// (200ms here) until Config.Context ends. A task denied under tenant=1/1h and deleted
// while it waits loses its reservation, not before the default Grace, and soon after.
func TestNew_startsSweep(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	rec := sweepStart(t, rdb, lim, "tenant=1/1h", worker.Config{SweepInterval: 200 * time.Millisecond, Context: ctx})
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)

	sweepEnqueue(t, client, "A", 5)
	waitUntil(t, 20*time.Second, "A ran", func() bool { return len(rec.admittedOf("A")) == 1 })
	sweepEnqueue(t, client, "B", 5)
	waitState(t, insp, "B", asynq.TaskStateRetry)
	r, ok := reservations(t, lim, sweepType)["B"]
	if !ok {
		t.Fatal("B holds no reservation")
	}
	if err := insp.DeleteTask("default", "B"); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "B's reservation was released", func() bool {
		_, held := reservations(t, lim, sweepType)["B"]
		return !held
	})
	now, err := rdb.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	if age := now.Sub(r.Created); age < worker.DefaultSweepGrace || age > worker.DefaultSweepGrace+5*time.Second {
		t.Errorf("B's reservation released %s after it was made; want after the %s grace, within a few 200ms sweeps", age, worker.DefaultSweepGrace)
	}
}

// TestNewSweeper_invalid: NewSweeper, and New for the sweep it starts, refuse what
// could never sweep.
func TestNewSweeper_invalid(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	_ = rdb.Close()
	lim := newLimiter(t, rdb)
	for name, c := range map[string]struct {
		lim   *throttle.Limiter
		rdb   redis.UniversalClient
		types []string
		cfg   worker.SweeperConfig
	}{
		"NilLimiter":          {nil, rdb, []string{"a"}, worker.SweeperConfig{}},
		"NilRedis":            {lim, nil, []string{"a"}, worker.SweeperConfig{}},
		"EmptyTaskType":       {lim, rdb, []string{"a", ""}, worker.SweeperConfig{}},
		"NegativeInterval":    {lim, rdb, []string{"a"}, worker.SweeperConfig{Interval: -time.Second}},
		"NegativeConcurrency": {lim, rdb, []string{"a"}, worker.SweeperConfig{Concurrency: -1}},
	} {
		if s, err := worker.NewSweeper(c.lim, c.rdb, c.types, c.cfg); err == nil || s != nil || !strings.HasPrefix(err.Error(), "worker: ") {
			t.Errorf("%s: NewSweeper = %v, %v; want an error", name, s, err)
		}
	}
	// A negative ClaimTimeout would make every task's request invalid (so archived): New
	// refuses it, with a sweep or without.
	cfg := worker.Config{Rules: mustRules(t, "a tenant=1/1s"), Redis: rdb, ClaimTimeout: -time.Second}
	for _, sweep := range []time.Duration{0, -1} {
		cfg.SweepInterval = sweep
		const want = "worker: ClaimTimeout -1s < 0: a reservation must stay claimable for some time after its instant"
		if _, err := worker.New(lim, cfg); err == nil || err.Error() != want {
			t.Errorf("New with ClaimTimeout -1s, SweepInterval %s: %v; want %q", sweep, err, want)
		}
	}
	// So are the other negative durations and a negative Concurrency (a trial found them
	// accepted silently, OverrideInterval's only with Overrides set, unlike its doc).
	rules := mustRules(t, "a tenant=1/1s")
	for _, c := range []struct {
		cfg  worker.Config
		want string
	}{
		{worker.Config{Rules: rules, Redis: rdb, OverrideInterval: -time.Second}, "worker: OverrideInterval -1s < 0"},
		{worker.Config{Rules: rules, Redis: rdb, UnavailableWait: -time.Second}, "worker: UnavailableWait -1s < 0"},
		{worker.Config{Rules: rules, Redis: rdb, WakeLead: -time.Second}, "worker: WakeLead -1s < 0"},
		{worker.Config{Rules: rules, Redis: rdb, Concurrency: -5}, "worker: Concurrency -5 < 0; want asynq's Config.Concurrency, or 0 for no bound on waiting slots"},
	} {
		if _, err := worker.New(lim, c.cfg); err == nil || err.Error() != c.want {
			t.Errorf("New: %v; want %q", err, c.want)
		}
	}
}
