package worker_test

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// This file checks that a copy which replaces a denied task with no retry left (see
// deferTask) keeps what asynq promised about the task: Unique, TaskID, and a TaskID reused
// after a copy completed and was kept by Retention. Each test runs a real asynq server.

// doneRuns returns the handler runs per task id and the admission instants, in order.
func doneRuns(rec *resvRecorder) (map[string]int, []time.Time) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return maps.Clone(rec.done), slices.Clone(rec.starts)
}

// TestDeferredCopy_unique: a Unique(1h) task with MaxRetry(0), denied under tenant=1/3s
// (the window filled at t0), is replaced by U:deferred:1 and the uniqueness lock goes to
// the copy: enqueueing the same type and payload again while it waits returns
// ErrDuplicateTask, the work runs once (only the copy runs, at t0 + 3s exactly), and once
// the copy is done the lock is gone and the same task may be enqueued again.
func TestDeferredCopy_unique(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rule := resvRule(1, 3*time.Second)
	rec := resvStart(t, rdb, lim, rule, worker.Config{}, 2)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	fill := resvFill(t, lim, rule)
	unique := func() *asynq.Task {
		return producer.NewTask("resv:call", []byte(`{"report":7}`), "acme", asynq.Unique(time.Hour), asynq.MaxRetry(0))
	}
	info, err := client.Enqueue(unique())
	if err != nil {
		t.Fatal(err)
	}
	copyID := info.ID + ":deferred:1"
	waitState(t, insp, copyID, asynq.TaskStateScheduled)
	if _, err := insp.GetTaskInfo("default", info.ID); !errors.Is(err, asynq.ErrTaskNotFound) {
		t.Fatalf("original %s after its deferral: %v; want ErrTaskNotFound (revoked)", info.ID, err)
	}
	lock := "asynq:{default}:unique:resv:call:" + md5hex(`{"report":7}`)
	if got, err := rdb.Get(context.Background(), lock).Result(); err != nil || got != copyID {
		t.Fatalf("uniqueness lock %s = %q, %v; want %q (handed to the copy)", lock, got, err, copyID)
	}
	if ttl := rdb.TTL(context.Background(), lock).Val(); ttl <= 59*time.Minute || ttl > time.Hour+3*time.Second {
		t.Errorf("lock TTL %s; want what was left of the hour (plus at most the copy's 3s wait)", ttl)
	}
	if _, err := client.Enqueue(unique()); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("enqueue the same Unique task while its copy waits: %v; want ErrDuplicateTask", err)
	}
	resvWaitDone(t, rdb, rec, 1, 20*time.Second)
	done, starts := doneRuns(rec)
	if want := map[string]int{copyID: 1}; !maps.Equal(done, want) {
		t.Fatalf("handler runs %v; want %v (the work once, by the copy)", done, want)
	}
	if want := fill.At.Add(3 * time.Second); !starts[0].Equal(want) {
		t.Errorf("copy admitted at %s; want %s (the fill + 3s)", starts[0].Format(time.StampMilli), want.Format(time.StampMilli))
	}
	if n := rdb.Exists(context.Background(), lock).Val(); n != 0 {
		t.Errorf("lock exists (%d) after the copy completed; want it released", n)
	}
	if _, err := client.Enqueue(unique()); err != nil {
		t.Errorf("enqueue the Unique task after its copy completed: %v; want nil", err)
	}
}

// TestDeferredCopy_taskID: a TaskID("mail-42") task with MaxRetry(0), denied under
// tenant=1/6s, is replaced by mail-42:deferred:1 and revoked, so asynq no longer holds a
// task mail-42: enqueueing mail-42 again returns nil, not ErrTaskIDConflict (the README
// says so). The second mail-42 is denied too (the copy holds the next slot, 6s away, more
// than MaxWait) and finds its copy's id taken by a live copy: it is revoked as already
// enqueued. The work runs once, by the copy, at the fill + 6s.
func TestDeferredCopy_taskID(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rule := resvRule(1, 6*time.Second)
	rec := resvStart(t, rdb, lim, rule, worker.Config{}, 2)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	fill := resvFill(t, lim, rule)
	resvEnqueue(t, client, "mail-42", asynq.MaxRetry(0))
	waitState(t, insp, "mail-42:deferred:1", asynq.TaskStateScheduled)
	waitUntil(t, 5*time.Second, "mail-42 is revoked", func() bool {
		_, err := insp.GetTaskInfo("default", "mail-42")
		return errors.Is(err, asynq.ErrTaskNotFound)
	})
	if _, err := client.Enqueue(producer.NewTask("resv:call", nil, "acme", asynq.TaskID("mail-42"), asynq.MaxRetry(0))); err != nil {
		t.Fatalf("enqueue mail-42 again while its copy waits: %v; want nil (asynq holds no task mail-42)", err)
	}
	waitUntil(t, 5*time.Second, "the second mail-42 is revoked", func() bool { return len(rec.callsOf("mail-42")) == 2 })
	calls := rec.callsOf("mail-42")
	if err := calls[1].err; !errors.Is(err, asynq.RevokeTask) || !strings.Contains(err.Error(), "deferred as task mail-42:deferred:1, already enqueued") {
		t.Fatalf("second mail-42 returned %v; want RevokeTask, deferred as mail-42:deferred:1, already enqueued", err)
	}
	resvWaitDone(t, rdb, rec, 1, 20*time.Second)
	done, starts := doneRuns(rec)
	if want := map[string]int{"mail-42:deferred:1": 1}; !maps.Equal(done, want) {
		t.Fatalf("handler runs %v; want %v", done, want)
	}
	if want := fill.At.Add(6 * time.Second); !starts[0].Equal(want) {
		t.Errorf("copy admitted at %s; want %s (the fill + 6s)", starts[0].Format(time.StampMilli), want.Format(time.StampMilli))
	}
	if _, err := insp.GetTaskInfo("default", "mail-42:deferred:2"); !errors.Is(err, asynq.ErrTaskNotFound) {
		t.Errorf("mail-42:deferred:2: %v; want ErrTaskNotFound (no second copy)", err)
	}
}

// TestDeferredCopy_taskIDReusedAfterRetention: under tenant=1/3s, a task "blocker" runs
// (admitted at a), then TaskID("sync-acme") with MaxRetry(0) and Retention(1h) is denied
// and replaced by sync-acme:deferred:1, which runs at a + 3s and is kept, completed, for an
// hour. A new sync-acme enqueued then is denied too: its copy must not be taken for
// "already enqueued" because the completed copy holds sync-acme:deferred:1; it becomes
// sync-acme:deferred:2 and runs at a + 6s. 3 handler runs in all.
func TestDeferredCopy_taskIDReusedAfterRetention(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	lim := newLimiter(t, rdb)
	rule := resvRule(1, 3*time.Second)
	rec := resvStart(t, rdb, lim, rule, worker.Config{}, 2)
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	resvEnqueue(t, client, "blocker")
	waitUntil(t, 10*time.Second, "blocker ran", func() bool { return rec.completed() == 1 })
	syncAcme := func() {
		resvEnqueue(t, client, "sync-acme", asynq.MaxRetry(0), asynq.Retention(time.Hour))
	}
	syncAcme()
	waitState(t, insp, "sync-acme:deferred:1", asynq.TaskStateCompleted)
	syncAcme() // the first sync-acme was revoked: its ID is free
	waitState(t, insp, "sync-acme:deferred:2", asynq.TaskStateScheduled)
	resvWaitDone(t, rdb, rec, 3, 20*time.Second)
	done, starts := doneRuns(rec)
	want := map[string]int{"blocker": 1, "sync-acme:deferred:1": 1, "sync-acme:deferred:2": 1}
	if !maps.Equal(done, want) {
		t.Fatalf("handler runs %v; want %v", done, want)
	}
	for i, d := range []time.Duration{3 * time.Second, 6 * time.Second} {
		if want := starts[0].Add(d); !starts[i+1].Equal(want) {
			t.Errorf("run %d admitted at %s; want %s (blocker + %s)", i+2, starts[i+1].Format(time.StampMilli), want.Format(time.StampMilli), d)
		}
	}
	for n, id := range []string{"sync-acme:deferred:1", "sync-acme:deferred:2"} {
		info, err := insp.GetTaskInfo("default", id)
		if err != nil || info.State != asynq.TaskStateCompleted || info.Retention != time.Hour ||
			info.Headers[worker.HeaderOriginID] != "sync-acme" || info.Headers[worker.HeaderDeferrals] != []string{"1", "2"}[n] {
			t.Errorf("%s: %+v, %v; want completed, Retention 1h, origin sync-acme, deferrals %d", id, info, err, n+1)
		}
	}
	if ds := rec.decisionsOf("sync-acme"); len(ds) != 2 || ds[0].d.Allowed || ds[1].d.Allowed {
		t.Errorf("sync-acme's decisions: %+v; want two denials (one per task)", ds)
	}
}

// md5hex is the hex MD5 of s: asynq v0.26.0 names a Unique task's lock
// asynq:{<queue>}:unique:<type>:<md5 of the payload>.
func md5hex(s string) string {
	sum := md5.Sum([]byte(s))
	return hex.EncodeToString(sum[:])
}
