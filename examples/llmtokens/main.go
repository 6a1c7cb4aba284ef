// Command llmtokens shows a tokens-per-minute quota for calls to an LLM API: each task
// costs the tokens its "tokens" header says (rule "cost=header:tokens"), each tenant may
// spend 10,000 tokens a minute, and when the API answers 429 anyway (its own limit, shared
// with other callers) the handler returns worker.Backpressure(resp): the tenant is paused
// on every worker until the Retry-After, and the task comes back then without spending a
// retry.
//
//	go run ./examples/llmtokens
//
// It runs on an embedded Redis (miniredis) and a fake API: nothing to install. It exits 0
// if the API saw no call for the paused tenant during its pause, every call ran once
// after it (the refused one with no retry spent), and the tenant past its tokens per
// minute was held back for its slot, else 1.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

const rule = "llm:complete tenant=10000/1m cost=header:tokens"

func main() { os.Exit(run(context.Background(), os.Stdout)) }

// journal is what the example prints and checks, in order.
type journal struct {
	mu         sync.Mutex
	w          io.Writer
	start      time.Time
	pausedTill time.Time            // acme's pause, from its 429
	calls      map[string]time.Time // "tenant call n" -> when the API accepted it
	apiAcme    []time.Time          // every acme call the API got
	heldBack   time.Duration        // the wait given to globex's call over its tokens per minute
}

func (j *journal) printf(format string, a ...any) {
	j.mu.Lock()
	defer j.mu.Unlock()
	fmt.Fprintf(j.w, "  +%.1fs  "+format+"\n", append([]any{time.Since(j.start).Seconds()}, a...)...)
}

func run(ctx context.Context, w io.Writer) int {
	mr, err := miniredis.Run()
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	defer mr.Close()
	mr.ClockTTL(true)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	j := &journal{w: w, start: time.Now(), calls: map[string]time.Time{}}

	// The LLM API: it refuses acme's first call with 429 and Retry-After: 2.
	refused := false
	api := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		j.mu.Lock()
		defer j.mu.Unlock()
		if r.Header.Get("Tenant") == "acme" {
			j.apiAcme = append(j.apiAcme, time.Now())
			if !refused {
				refused = true
				rw.Header().Set("Retry-After", "2")
				rw.WriteHeader(http.StatusTooManyRequests)
			}
		}
	}))
	defer api.Close()

	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	rules, _ := worker.ParseRules(rule)
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, WakeLead: 1350 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		DecisionFunc: func(_ context.Context, task *asynq.Task, key throttle.Key, d throttle.Decision) {
			name := key.Tenant + " call " + string(task.Payload())
			switch {
			case d.Paused:
				j.printf("%-14s paused until +%.1fs: re-queued for then", name, d.RetryAt().Sub(j.start).Seconds())
			case !d.Allowed:
				j.printf("%-14s over %s (%d of %d tokens used): waits %s for its slot", name, d.Quota, d.Count, d.Quota.Limit.Events,
					d.RetryAfter.Round(100*time.Millisecond))
				j.mu.Lock()
				j.heldBack = d.RetryAfter
				j.mu.Unlock()
			}
		}})
	if err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.HandleFunc("llm:complete", func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		name := tenant + " call " + string(task.Payload())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api.URL, nil)
		req.Header.Set("Tenant", tenant)
		resp, err := api.Client().Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if err := worker.Backpressure(resp); err != nil { // 429 or 503: pause the tenant
			j.printf("%-14s the API answered %s, Retry-After: %s: %s paused on every worker", name, resp.Status, resp.Header.Get("Retry-After"), tenant)
			return err
		}
		retried, _ := asynq.GetRetryCount(ctx)
		j.printf("%-14s %s tokens, ok (retries spent: %d)", name, task.Headers()["tokens"], retried)
		j.mu.Lock()
		j.calls[name] = time.Now()
		j.mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{Concurrency: 10, ShutdownTimeout: time.Second,
		TaskCheckInterval: 50 * time.Millisecond, DelayedTaskCheckInterval: 100 * time.Millisecond, LogLevel: asynq.FatalLevel}))
	if err := srv.Start(mux); err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	defer srv.Shutdown()

	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	enqueue := func(tenant string, n, tokens int) error {
		task := asynq.NewTaskWithHeaders("llm:complete", []byte(strconv.Itoa(n)),
			map[string]string{producer.TenantHeader: tenant, "tokens": strconv.Itoa(tokens)})
		_, err := client.EnqueueContext(ctx, task, asynq.MaxRetry(3))
		return err
	}
	fmt.Fprintf(w, "Rule %q: each task costs its \"tokens\" header,\nand each tenant may spend 10000 tokens in any minute.\n\n", rule)
	if err := enqueue("acme", 1, 3000); err != nil {
		fmt.Fprintln(w, "error:", err)
		return 1
	}
	acme := throttle.Key{TaskType: "llm:complete", Tenant: "acme"}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if until, ok, _ := lim.PausedUntil(ctx, acme, throttle.ScopeTenant); ok {
			j.mu.Lock()
			j.pausedTill = until
			j.mu.Unlock()
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(w, "FAIL: acme was never paused")
			return 1
		}
	}
	for _, c := range []struct {
		tenant    string
		n, tokens int
	}{{"acme", 2, 3000}, {"globex", 1, 4000}, {"globex", 2, 4000}, {"globex", 3, 4000}} {
		if err := enqueue(c.tenant, c.n, c.tokens); err != nil {
			fmt.Fprintln(w, "error:", err)
			return 1
		}
	}
	// acme's two calls run after the pause; two of globex's three run, in whatever order
	// asynq hands them out, and the third to reach the limiter waits for its slot.
	globexRan := func() int {
		n := 0
		for _, name := range []string{"globex call 1", "globex call 2", "globex call 3"} {
			if _, ok := j.calls[name]; ok {
				n++
			}
		}
		return n
	}
	want := []string{"acme call 1", "acme call 2"}
	done := func() bool {
		j.mu.Lock()
		defer j.mu.Unlock()
		for _, name := range want {
			if _, ok := j.calls[name]; !ok {
				return false
			}
		}
		return globexRan() == 2 && j.heldBack > 0
	}
	for deadline := time.Now().Add(15 * time.Second); !done() && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}

	j.mu.Lock()
	defer j.mu.Unlock()
	inPause := 0
	for _, t := range j.apiAcme[1:] {
		if t.Before(j.pausedTill) {
			inPause++
		}
	}
	fmt.Fprintf(j.w, "\nacme was paused until +%.1fs, and the API got %d calls for acme meanwhile; its refused call still\n"+
		"counts in its minute (the limiter admitted it before the API refused it). globex's third call to\n"+
		"reach the limiter waits "+
		"for its slot: 8000 + 4000 tokens would be more than 10000 in a minute.\n", j.pausedTill.Sub(j.start).Seconds(), inPause)
	ok := inPause == 0 && j.heldBack > 50*time.Second && globexRan() == 2
	for _, name := range want {
		t, ran := j.calls[name]
		ok = ok && ran && (name[:4] != "acme" || !t.Before(j.pausedTill))
	}
	if !ok {
		fmt.Fprintln(j.w, "FAIL: a call ran during the pause or not at all, or the tokens per minute were not enforced")
		return 1
	}
	return 0
}
