package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestRecordWriter_middleware(t *testing.T) {
	t.Parallel()
	retryAt := time.UnixMilli(1_800_000_001_234)
	tests := []struct {
		name        string
		err         error
		wantOutcome string
		wantWake    int64
	}{
		{name: "Ran", err: nil, wantOutcome: outcomeRan},
		{name: "Denied", err: fmt.Errorf("wrapped: %w", &throttle.DeniedError{RetryAt: retryAt}),
			wantOutcome: outcomeRequeued, wantWake: retryAt.UnixMilli()},
		{name: "RateLimited", err: &RateLimitError{RetryIn: time.Second},
			wantOutcome: outcomeRequeued, wantWake: 1_800_000_000_000 + 1000},
		{name: "Failed", err: errors.New("boom"), wantOutcome: outcomeError},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var out bytesWriter
			w := &recordWriter{w: bufio.NewWriter(&out), worker: 3}
			h := w.middleware(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
				recordFrom(ctx).Denials = append(recordFrom(ctx).Denials, denial{AtMS: 1_800_000_000_000})
				return tc.err
			}))
			task := producer.NewTask(taskType, []byte(`{"tenant":"a","seq":7}`), "a")
			if err := h.ProcessTask(context.Background(), task); !errors.Is(err, tc.err) {
				t.Fatalf("middleware returned %v, want %v", err, tc.err)
			}
			recs := out.records(t)
			if len(recs) != 1 {
				t.Fatalf("%d records, want 1", len(recs))
			}
			r := recs[0]
			if r.Outcome != tc.wantOutcome || r.WakeMS != tc.wantWake || r.Tenant != "a" || r.Seq != 7 || r.Worker != 3 {
				t.Errorf("record %+v; want outcome %s, wake %d, tenant a, seq 7, worker 3", r, tc.wantOutcome, tc.wantWake)
			}
			if tc.wantOutcome == outcomeRan && (r.waits() != 1 || r.AtMS == 0) {
				t.Errorf("ran: %d waits, at %d; want 1 wait and an admission instant", r.waits(), r.AtMS)
			}
			if tc.wantOutcome == outcomeRequeued && r.waits() != 0 {
				t.Errorf("requeued: %d waits, want 0 (its one denial re-queued it)", r.waits())
			}
		})
	}
}

// bytesWriter is a bytes.Buffer safe for one writer and a later reader.
type bytesWriter struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *bytesWriter) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// records decodes the JSON lines written so far.
func (b *bytesWriter) records(t *testing.T) []record {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []record
	for _, line := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var r record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("record line %q: %v", line, err)
		}
		out = append(out, r)
	}
	return out
}
