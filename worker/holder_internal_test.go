package worker

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// TestHolderOf: a holder names the queue and the task id, whatever either holds.
func TestHolderOf(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ queue, id string }{
		{"default", "5a0f2c1e-7d3b-4f4e-9c2a-1b2c3d4e5f60"},
		{"a:b/c", "mail-42:deferred:3"},
		{"", "x"},
		{"9:", "12:ab"},
	} {
		h := strconv.Itoa(len(c.queue)) + ":" + c.queue + c.id
		q, id, ok := holderOf(h)
		if !ok || q != c.queue || id != c.id {
			t.Errorf("holderOf(%q) = %q, %q, %v; want %q, %q, true", h, q, id, ok, c.queue, c.id)
		}
	}
	for _, bad := range []string{"", "x", "5:abc", "-1:a", ":a"} {
		if _, _, ok := holderOf(bad); ok {
			t.Errorf("holderOf(%q) ok, want not", bad)
		}
	}
}

// TestWaitFor: a task waits at most MaxWait (never, if negative), and no later than 100ms
// before its deadline.
func TestWaitFor(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	m := &middleware{now: func() time.Time { return now }}
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(time.Second))
	defer cancel()
	for _, c := range []struct {
		ctx  context.Context
		d    time.Duration
		want time.Duration
	}{
		{context.Background(), 2 * time.Second, 2 * time.Second},
		{context.Background(), -time.Second, 0},
		{ctx, 2 * time.Second, 900 * time.Millisecond},
		{ctx, 300 * time.Millisecond, 300 * time.Millisecond},
	} {
		if got := m.waitFor(c.ctx, c.d); got != c.want {
			t.Errorf("waitFor(%v) = %v, want %v", c.d, got, c.want)
		}
	}
}
