package main

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestRateLimited_middleware(t *testing.T) {
	t.Parallel()
	rl := newRateLimited(throttle.Limit{Events: 2, Window: time.Hour}, 3*time.Second)
	ran := 0
	h := rl.middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran++; return nil }))
	call := func(tenant string) (*record, error) {
		rec := &record{}
		ctx := context.WithValue(context.Background(), recordKey{}, rec)
		return rec, h.ProcessTask(ctx, producer.NewTask(taskType, nil, tenant))
	}
	for i := 0; i < 2; i++ { // the burst: limit.Events at once
		if rec, err := call("a"); err != nil || rec.AtMS == 0 {
			t.Fatalf("call %d: err %v, admission instant %d; want admitted", i, err, rec.AtMS)
		}
	}
	rec, err := call("a")
	var rle *RateLimitError
	if !errors.As(err, &rle) || rle.RetryIn != 3*time.Second || rec.AtMS != 0 || len(rec.Denials) != 1 {
		t.Fatalf("third call: err %v, record %+v; want a RateLimitError retrying in 3s, one denial", err, rec)
	}
	if _, err := call("b"); err != nil { // each tenant has its own limiter
		t.Errorf("tenant b: %v, want admitted", err)
	}
	if ran != 3 {
		t.Errorf("handler ran %d times, want 3", ran)
	}
	// The wiki's IsFailure and RetryDelayFunc, through wrapping.
	wrapped := fmt.Errorf("handler: %w", err)
	if !isRateLimitError(wrapped) || isRateLimitError(errors.New("boom")) {
		t.Errorf("isRateLimitError wrong")
	}
	if d := rateLimitRetryDelay(1, wrapped, nil); d != 3*time.Second {
		t.Errorf("rateLimitRetryDelay = %s, want 3s", d)
	}
}
