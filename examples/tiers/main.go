// Command tiers shows per-tenant quotas changed at runtime: two tenants share the default
// rule "report:build tenant=2/1s" (the free tier) while a worker runs, then the example
// stores a pro tier (tenant=10/1s) and puts one tenant in it, as `throttle limits set`
// would, without restarting the worker. It prints each tenant's rate before and after.
//
//	go run ./examples/tiers
//
// It runs on an embedded Redis (miniredis): nothing to install. It exits 0 if no tenant
// ever ran more than its tier allows in any second and the pro tenant ran faster than the
// free tier allows once the change was in force, else 1.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

const (
	rule  = "report:build tenant=2/1s" // every tenant's default: the free tier
	pro   = "tenant=10/1s"             // the pro tier, stored at runtime
	phase = 3 * time.Second            // how long each tier runs
)

func main() { os.Exit(run(context.Background(), os.Stdout)) }

func run(ctx context.Context, w io.Writer) int {
	mr, err := miniredis.Run()
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	defer mr.Close()
	mr.ClockTTL(true) // age TTLs by the wall clock, as a real Redis does
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	// The worker: the default rule, and the overrides that every worker reads from Redis.
	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	store, err := worker.NewOverrideStore(rdb, "") // <prefix>:overrides, as cmd/throttle limits writes
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	rules, _ := worker.ParseRules(rule)
	inForce := make(chan int64, 8)
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, Overrides: store, WakeLead: 1350 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		OverrideReloadFunc: func(v int64, err error) {
			if err == nil {
				select {
				case inForce <- v:
				default:
				}
			}
		}})
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	var mu sync.Mutex
	starts := map[string][]time.Time{} // admission instants, by tenant
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.HandleFunc("report:build", func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		d, _ := worker.DecisionFrom(ctx) // the instant the limiter admitted it at
		mu.Lock()
		starts[tenant] = append(starts[tenant], d.At)
		mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{Concurrency: 40, ShutdownTimeout: time.Second,
		TaskCheckInterval: 50 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, LogLevel: asynq.FatalLevel}))
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	defer srv.Shutdown()

	// Both tenants ask for 12 reports a second, more than either tier allows.
	tenants := []string{"acme", "bigco"}
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	start := time.Now()
	stop := make(chan struct{})
	go func() {
		tick := time.NewTicker(time.Second / 12)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				for _, t := range tenants {
					_, _ = producer.Enqueue(ctx, client, "report:build", nil, t, asynq.MaxRetry(3))
				}
			}
		}
	}()

	fmt.Fprintf(w, "Default rule %q (the free tier); acme and bigco each enqueue 12 tasks/s.\n\n", rule)
	time.Sleep(phase)
	changed := time.Now()
	if _, err := store.Set(ctx, worker.OverrideTier, "pro", pro); err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	c, err := store.Set(ctx, worker.OverrideTenantTier, "bigco", "pro")
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	fmt.Fprintf(w, "at %.1fs, while the worker runs: throttle limits set tier pro %q; throttle limits set tenant-tier bigco pro\n",
		changed.Sub(start).Seconds(), pro)
	var pickedUp time.Duration
	for pickedUp == 0 {
		select {
		case v := <-inForce:
			if v >= c.Version {
				pickedUp = time.Since(changed)
			}
		case <-time.After(5 * time.Second):
			fmt.Fprintln(w, "FAIL: the worker did not put the change in force within 5s")
			return 1
		}
	}
	fmt.Fprintf(w, "the worker put overrides version %d in force %.1fs later, without a restart\n\n", c.Version, pickedUp.Seconds())
	after := time.Now()
	time.Sleep(phase)
	close(stop)
	end := time.Now()

	mu.Lock()
	defer mu.Unlock()
	ok := true
	fmt.Fprintln(w, "  tenant  tier  before: tasks/s  max in any 1s  after: tasks/s  max in any 1s")
	for _, t := range tenants {
		before, later := between(starts[t], start, changed), between(starts[t], after, end)
		mb, ma := throttle.MaxInWindow(before, time.Second), throttle.MaxInWindow(later, time.Second)
		tier, limitAfter := "free", 2
		if t == "bigco" {
			tier, limitAfter = "pro", 10
			ok = ok && ma > 2 // faster than the free tier could ever run it
		}
		ok = ok && mb <= 2 && ma <= limitAfter
		fmt.Fprintf(w, "  %-6s  %-4s  %15.1f  %13s  %14.1f  %13s\n", t, tier, rate(before, changed.Sub(start)), fmt.Sprintf("%d/%d", mb, 2),
			rate(later, end.Sub(after)), fmt.Sprintf("%d/%d", ma, limitAfter))
	}
	if !ok {
		fmt.Fprintln(w, "\nFAIL: a tenant ran over its tier, or bigco did not speed up")
		return 1
	}
	fmt.Fprintln(w, "\nOK: bigco runs at the pro tier's rate since the change, acme still at the free tier's; no second over either limit")
	return 0
}

// between returns the instants of ts in [from, to).
func between(ts []time.Time, from, to time.Time) []time.Time {
	var out []time.Time
	for _, t := range ts {
		if !t.Before(from) && t.Before(to) {
			out = append(out, t)
		}
	}
	return out
}

func rate(ts []time.Time, d time.Duration) float64 { return float64(len(ts)) / d.Seconds() }
