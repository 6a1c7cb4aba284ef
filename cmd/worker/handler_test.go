package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

func TestDemoHandler_API(t *testing.T) {
	t.Parallel()
	type call struct{ method, tenant, body string }
	var mu sync.Mutex
	var calls []call
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		calls = append(calls, call{r.Method, r.Header.Get("Tenant"), string(body)})
		mu.Unlock()
		if r.Header.Get("Tenant") == "greedy" {
			http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusAccepted)
	}))
	defer api.Close()
	h := demoHandler{url: api.URL, tenantHeader: "tenant", client: api.Client()}
	task := func(tenant, payload string) *asynq.Task {
		return asynq.NewTaskWithHeaders("api:call", []byte(payload), map[string]string{"tenant": tenant})
	}

	if err := h.ProcessTask(context.Background(), task("acme", `{"n":1}`)); err != nil {
		t.Errorf("202: %v, want nil", err)
	}
	err := h.ProcessTask(context.Background(), task("greedy", `{"n":2}`))
	if err == nil || !strings.Contains(err.Error(), "429 Too Many Requests") || !strings.Contains(err.Error(), "rate limit exceeded") {
		t.Errorf("429: error %v, want one naming the status and the body", err)
	}
	want := []call{{"POST", "acme", `{"n":1}`}, {"POST", "greedy", `{"n":2}`}}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != len(want) || calls[0] != want[0] || calls[1] != want[1] {
		t.Errorf("API got %+v, want %+v", calls, want)
	}
}

func TestDemoHandler_APIDown(t *testing.T) {
	t.Parallel()
	api := httptest.NewServer(http.NotFoundHandler())
	url := api.URL
	api.Close()
	h := demoHandler{url: url, tenantHeader: "tenant"}
	if err := h.ProcessTask(context.Background(), asynq.NewTask("api:call", nil)); err == nil {
		t.Error("no error with the API down")
	}
}

func TestDemoHandler_sleep(t *testing.T) {
	t.Parallel()
	h := demoHandler{work: 30 * time.Millisecond, tenantHeader: "tenant"}
	start := time.Now()
	if err := h.ProcessTask(context.Background(), asynq.NewTask("api:call", nil)); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d < 30*time.Millisecond {
		t.Errorf("returned after %s, want at least the 30ms of work", d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	h.work = time.Hour
	if err := h.ProcessTask(ctx, asynq.NewTask("api:call", nil)); err != context.Canceled {
		t.Errorf("cancelled: %v, want context.Canceled", err)
	}
}
