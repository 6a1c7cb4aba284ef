package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
)

// demoHandler handles every task the worker gets: with url set it POSTs the task to a
// (rate-limited) API, otherwise it sleeps work to simulate some.
type demoHandler struct {
	url          string        // DEMO_API_URL; empty: sleep work
	work         time.Duration // WORKER_WORK_TIME
	tenantHeader string        // THROTTLE_TENANT_HEADER: the task header read
	client       *http.Client
}

var _ asynq.Handler = demoHandler{}

// ProcessTask POSTs the task's payload to h.url with the header "Tenant: <tenant>". A 2xx
// response is success; any other status, 429 included, is an error that names it, which
// asynq retries as a failure. Without h.url it sleeps h.work, or less if ctx ends first.
func (h demoHandler) ProcessTask(ctx context.Context, task *asynq.Task) error {
	tenant := task.Headers()[h.tenantHeader]
	if h.url == "" {
		t := time.NewTimer(h.work)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.url, bytes.NewReader(task.Payload()))
	if err != nil {
		return fmt.Errorf("demo: %s for tenant %s: %w", quote.Name(task.Type()), quote.Quote(tenant), err)
	}
	req.Header.Set("Tenant", tenant)
	req.Header.Set("Content-Type", "application/octet-stream")
	client := h.client
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("demo: %s for tenant %s: %w", quote.Name(task.Type()), quote.Quote(tenant), err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 200))
	_, _ = io.Copy(io.Discard, resp.Body) // drain, so the connection is reused
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		msg := fmt.Sprintf("demo: %s for tenant %s: POST %s: %s", quote.Name(task.Type()), quote.Quote(tenant), h.url, resp.Status)
		if b := strings.TrimSpace(string(body)); b != "" {
			msg += ": " + strings.Join(strings.Fields(b), " ")
		}
		return errors.New(msg)
	}
	return nil
}
