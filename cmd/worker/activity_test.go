package main

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestActivity_take(t *testing.T) {
	t.Parallel()
	a := newActivity()
	ctx := context.Background()
	decide := func(typ, tenant string, admitted, denied int) {
		key := throttle.Key{TaskType: typ, Tenant: tenant}
		for range admitted {
			a.decided(ctx, nil, key, throttle.Decision{Allowed: true})
		}
		for range denied {
			a.decided(ctx, nil, key, throttle.Decision{Allowed: false})
		}
	}
	decide("api:call", "globex", 5, 0)
	decide("api:call", "acme", 5, 12)
	decide("email:send", "", 1, 2)
	decide("api:call", "two words", 0, 3)

	want := []string{
		"api:call tenant=acme ran=5 throttled=12",
		"api:call tenant=globex ran=5 throttled=0",
		`api:call tenant="two words" ran=0 throttled=3`,
		`email:send tenant="" ran=1 throttled=2`,
	}
	if got := a.take(); !reflect.DeepEqual(got, want) {
		t.Errorf("first interval:\n got %q\nwant %q", got, want)
	}
	if got := a.take(); len(got) != 0 {
		t.Errorf("idle interval: got %q, want no lines", got)
	}
	decide("api:call", "acme", 0, 1)
	if got, want := a.take(), []string{"api:call tenant=acme ran=0 throttled=1"}; !reflect.DeepEqual(got, want) {
		t.Errorf("third interval: got %q, want %q", got, want)
	}
}

// TestActivity_handler checks that tasks of a type without a rule count as runs (the
// middleware does not decide them) and that handler errors count as failures.
func TestActivity_handler(t *testing.T) {
	t.Parallel()
	a := newActivity()
	fail := errors.New("boom")
	h := a.handler("tenant", asynq.HandlerFunc(func(_ context.Context, task *asynq.Task) error {
		if string(task.Payload()) == "fail" {
			return fail
		}
		return nil
	}))
	task := func(payload string) *asynq.Task {
		return asynq.NewTaskWithHeaders("report:build", []byte(payload), map[string]string{"tenant": "acme"})
	}
	ctx := context.Background()
	_ = h.ProcessTask(ctx, task("ok"))
	_ = h.ProcessTask(ctx, task("ok"))
	if err := h.ProcessTask(ctx, task("fail")); !errors.Is(err, fail) {
		t.Errorf("handler error = %v, want %v", err, fail)
	}
	want := []string{"report:build tenant=acme ran=3 throttled=0 failed=1"}
	if got := a.take(); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestAsynqLogger_dropsRevokeWarnings(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := newAsynqLogger(&buf)
	l.Warn("revoke task id=4f1c")
	l.Warn("Retry exhausted for task id=4f1c")
	l.Error("boom")
	out := buf.String()
	if strings.Contains(out, "revoke") || !strings.Contains(out, "asynq: ") ||
		!strings.Contains(out, "WARN: Retry exhausted for task id=4f1c\n") || !strings.Contains(out, "ERROR: boom\n") {
		t.Errorf("logged:\n%s", out)
	}
}
