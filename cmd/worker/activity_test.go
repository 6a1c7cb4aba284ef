package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	decide("api:call", "z"+strings.Repeat("x", 10239), 0, 1) // cut to 64 bytes (internal/quote)
	decide("bad type", "evil\ntenant=acme", 0, 1)            // quoted: the newline stays in the line

	want := []string{
		`api:call tenant="acme" ran=5 throttled=12`,
		`api:call tenant="globex" ran=5 throttled=0`,
		`api:call tenant="two words" ran=0 throttled=3`,
		`api:call tenant="z` + strings.Repeat("x", 63) + `"...(10240 bytes) ran=0 throttled=1`,
		`"bad type" tenant="evil\ntenant=acme" ran=0 throttled=1`,
		`email:send tenant="" ran=1 throttled=2`,
	}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
		t.Errorf("first interval:\n got %q\nwant %q", got, want)
	}
	if got := a.take(20); len(got) != 0 {
		t.Errorf("idle interval: got %q, want no lines", got)
	}
	decide("api:call", "acme", 0, 1)
	if got, want := a.take(20), []string{`api:call tenant="acme" ran=0 throttled=1`}; !reflect.DeepEqual(got, want) {
		t.Errorf("third interval: got %q, want %q", got, want)
	}
}

// TestActivity_takeCapped has 5,000 tenants active in one interval, 3 of them busier than
// the rest: with 3 lines at most, those 3 get a line, sorted by name, and one line sums up
// the other 4,997.
func TestActivity_takeCapped(t *testing.T) {
	t.Parallel()
	a := newActivity()
	ctx := context.Background()
	for i := range 5000 {
		key := throttle.Key{TaskType: "api:call", Tenant: fmt.Sprintf("t%04d", i)}
		a.decided(ctx, nil, key, throttle.Decision{Allowed: true})
		a.decided(ctx, nil, key, throttle.Decision{})
		if i == 4000 || i == 17 || i == 2500 {
			a.decided(ctx, nil, key, throttle.Decision{})
		}
	}
	want := []string{
		`api:call tenant="t0017" ran=1 throttled=2`,
		`api:call tenant="t2500" ran=1 throttled=2`,
		`api:call tenant="t4000" ran=1 throttled=2`,
		`... and 4997 more (task type, tenant) pairs: ran=4997 throttled=4997`,
	}
	if got := a.take(3); !reflect.DeepEqual(got, want) {
		t.Errorf("got %q\nwant %q", got, want)
	}
	// Ties are broken by name: with all equal, the first in name order get the lines.
	for _, tenant := range []string{"c", "a", "b"} {
		a.decided(ctx, nil, throttle.Key{TaskType: "x", Tenant: tenant}, throttle.Decision{Allowed: true})
	}
	want = []string{`x tenant="a" ran=1 throttled=0`, `... and 2 more (task type, tenant) pairs: ran=2 throttled=0`}
	if got := a.take(1); !reflect.DeepEqual(got, want) {
		t.Errorf("ties: got %q\nwant %q", got, want)
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
	want := []string{`report:build tenant="acme" ran=3 throttled=0 failed=1`}
	if got := a.take(20); !reflect.DeepEqual(got, want) {
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
