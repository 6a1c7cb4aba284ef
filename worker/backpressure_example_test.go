package worker_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// callAPI handles api:call tasks behind the throttle middleware (mux.Use(mw)). When the
// API answers 429 or 503 it returns worker.Backpressure(resp): the middleware pauses the
// tenant on every worker until the Retry-After and re-queues the task for then, without
// counting a failure or spending a retry.
func callAPI(ctx context.Context, task *asynq.Task) error {
	tenant, _ := producer.Tenant(task)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://api.example.com/v1/orders", nil)
	if err != nil {
		return err
	}
	req.Header.Set("X-Tenant", tenant)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := worker.Backpressure(resp); err != nil { // nil unless 429 or 503
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("API answered %s", resp.Status)
	}
	return nil
}

// A 429 with Retry-After: 3 is a *worker.BackpressureError asking for a 3s pause of the
// tenant's quota (BackpressureScope(throttle.ScopeType): the task type's).
func ExampleBackpressure() {
	mux := asynq.NewServeMux()
	mux.HandleFunc("api:call", callAPI)

	resp := &http.Response{StatusCode: http.StatusTooManyRequests, Header: http.Header{"Retry-After": {"3"}}}
	err := fmt.Errorf("call the API: %w", worker.Backpressure(resp))
	var bp *worker.BackpressureError
	if errors.As(err, &bp) {
		fmt.Println(bp.StatusCode, bp.RetryAfter, bp.Scope)
	}
	// Output: 429 3s tenant
}
