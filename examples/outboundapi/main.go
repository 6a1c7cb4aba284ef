// Command outboundapi shows what the throttle is for: asynq tasks that call a third-party
// API with its own per-tenant rate limit. It runs the same workload twice against a fake
// API that answers 429 Too Many Requests past 5 calls per tenant in any second: with plain
// asynq workers, then with the throttle middleware, and prints the 429s of each run.
//
//	go run ./examples/outboundapi
//
// Each run starts its own embedded Redis (miniredis): nothing to install. It exits 0 if
// both runs completed every task and the throttled one got no 429, else 1.
package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

const (
	taskType  = "api:call"
	perTenant = 20
	apiLimit  = 5 // calls per tenant in any apiWindow, as the API counts them
	apiWindow = time.Second
	// rule is the throttle's: the API's limit, in a window 500ms wider so that calls
	// admitted a window apart still arrive a window apart when their latencies differ
	// (see "Why the worker's rule is 10 per 1.2 s" in the README).
	rule = "api:call tenant=5/1500ms"
)

var tenants = []string{"acme", "globex", "initech"}

func main() { os.Exit(run(context.Background(), os.Stdout)) }

func run(ctx context.Context, w io.Writer) int {
	fmt.Fprintf(w, "The API accepts %d calls per tenant in any %s and answers 429 past that.\n", apiLimit, apiWindow)
	fmt.Fprintf(w, "Workload: %d tenants x %d tasks of type %s, one call each; a 429 fails the task, retried after 1s.\n\n",
		len(tenants), perTenant, taskType)
	code := 0
	for _, throttled := range []bool{false, true} {
		r, err := runOnce(ctx, throttled)
		if err != nil {
			fmt.Fprintln(w, "error:", err)
			return 1
		}
		name := "without the throttle:"
		if throttled {
			name = "with the throttle:   "
		}
		fmt.Fprintf(w, "%s %d/%d tasks completed in %.1fs; the API answered 429 %d times:",
			name, r.completed, len(tenants)*perTenant, r.elapsed.Seconds(), r.total429())
		for _, t := range tenants {
			fmt.Fprintf(w, " %s %d", t, r.api429[t])
		}
		fmt.Fprintln(w)
		if r.completed != len(tenants)*perTenant || throttled && r.total429() != 0 {
			code = 1
		}
	}
	fmt.Fprintf(w, "\nThe throttle's rule: %q, shared by every worker on the Redis.\n", rule)
	return code
}

// result is what one run saw.
type result struct {
	completed int
	api429    map[string]int // 429s the API answered, by tenant
	elapsed   time.Duration
}

func (r result) total429() int {
	n := 0
	for _, c := range r.api429 {
		n += c
	}
	return n
}

// runOnce enqueues the workload on a fresh embedded Redis and works it off with an asynq
// server, throttled or not, until every task has completed (or 30s have passed).
func runOnce(ctx context.Context, throttled bool) (result, error) {
	mr, err := miniredis.Run()
	if err != nil {
		return result{}, err
	}
	defer mr.Close()
	mr.ClockTTL(true) // age TTLs by the wall clock, as a real Redis does
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	api := newFakeAPI()
	defer api.Close()
	var completed atomic.Int64
	mux := asynq.NewServeMux()
	mux.HandleFunc(taskType, func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		if err := api.call(ctx, tenant); err != nil {
			return err // asynq retries the task
		}
		completed.Add(1)
		return nil
	})
	cfg := asynq.Config{
		Concurrency:              30,
		RetryDelayFunc:           func(int, error, *asynq.Task) time.Duration { return time.Second },
		TaskCheckInterval:        50 * time.Millisecond, // snappier than asynq's defaults
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.ErrorLevel,
	}
	if throttled {
		lim, err := throttle.New(rdb, throttle.Config{})
		if err != nil {
			return result{}, err
		}
		rules, err := worker.ParseRules(rule)
		if err != nil {
			return result{}, err
		}
		// WakeLead: asynq's whole-second retry times, this forwarder's 100ms, and 250ms.
		// NoEvictionCheck: the embedded miniredis has no maxmemory-policy to read.
		mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, WakeLead: 1350 * time.Millisecond, NoEvictionCheck: true})
		if err != nil {
			return result{}, err
		}
		mux.Use(mw)
		cfg = worker.WrapConfig(cfg) // throttled tasks are not failures and come back on time
	}

	client := asynq.NewClientFromRedisClient(rdb)
	for range perTenant {
		for _, tenant := range tenants {
			if _, err := producer.Enqueue(ctx, client, taskType, nil, tenant, asynq.MaxRetry(10)); err != nil {
				return result{}, err
			}
		}
	}
	start := time.Now()
	srv := asynq.NewServerFromRedisClient(rdb, cfg)
	if err := srv.Start(mux); err != nil {
		return result{}, err
	}
	for completed.Load() < int64(len(tenants)*perTenant) && time.Since(start) < 30*time.Second {
		time.Sleep(20 * time.Millisecond)
	}
	elapsed := time.Since(start)
	srv.Shutdown()
	return result{completed: int(completed.Load()), api429: api.rejected(), elapsed: elapsed}, nil
}

// fakeAPI is the third-party API: an HTTP server that accepts at most apiLimit calls per
// tenant in any sliding window of apiWindow, counted at their arrival, and answers 429
// to the others.
type fakeAPI struct {
	*httptest.Server
	mu       sync.Mutex
	accepted map[string][]time.Time // arrivals of accepted calls, by tenant
	refused  map[string]int         // 429s, by tenant
}

func newFakeAPI() *fakeAPI {
	a := &fakeAPI{accepted: map[string][]time.Time{}, refused: map[string]int{}}
	a.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, now := r.Header.Get("Tenant"), time.Now()
		a.mu.Lock()
		defer a.mu.Unlock()
		inWindow := 0
		for _, t := range a.accepted[tenant] {
			if t.After(now.Add(-apiWindow)) {
				inWindow++
			}
		}
		if inWindow >= apiLimit {
			a.refused[tenant]++
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		a.accepted[tenant] = append(a.accepted[tenant], now)
	}))
	return a
}

// call makes one call to the API for tenant; an answer other than 200 is an error.
func (a *fakeAPI) call(ctx context.Context, tenant string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.URL, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Tenant", tenant)
	resp, err := a.Client().Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("API answered %s", resp.Status)
	}
	return nil
}

// rejected returns the 429s answered so far, by tenant (every tenant listed).
func (a *fakeAPI) rejected() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int, len(tenants))
	for _, t := range tenants {
		out[t] = a.refused[t]
	}
	return out
}
