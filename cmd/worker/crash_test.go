package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
)

// crashChildEnv, set only in the child of TestRun_killedWorkerCostsNoRetry, makes
// TestCrashChild run the worker.
const crashChildEnv = "WORKER_CRASH_CHILD"

// TestCrashChild is the worker process that TestRun_killedWorkerCostsNoRetry kills: this
// test binary run again, whose run reads the environment the parent set. Unless told by
// crashChildEnv that it is that child, it does nothing.
func TestCrashChild(t *testing.T) {
	if os.Getenv(crashChildEnv) == "" {
		return
	}
	os.Exit(run(context.Background(), nil, os.Stdout, os.Stderr))
}

// TestRun_killedWorkerCostsNoRetry is issue 9's capability 9: a worker process (this
// binary's run, in a child process) works 30 "api:call" tasks under "tenant=5/1s" with
// WORKER_WORK_TIME=0, so a task that asynq holds active is one the middleware holds:
// waiting in its handler for a slot ahead, or being decided. Once 3 or more are active it
// is killed (SIGKILL). A second worker, started at once in this process, finishes the
// other tasks; asynq's recoverer finds the killed worker's tasks when their lease (30 s,
// extended every 5 s) has been expired for 30 s, in its scan every minute from the
// start: 60 s after the second worker started, its second scan. Then:
//   - every task completes, none is archived;
//   - the tasks the kill interrupted were recovered: each completed 55 s or more after the
//     kill (60.1 s measured, 3 tasks), and no task spent a retry: Retried is 0 on all 30 (before
//     WrapConfig's IsFailure said no to asynq.ErrLeaseExpired, 1 on each recovered task).
func TestRun_killedWorkerCostsNoRetry(t *testing.T) {
	const n = 30
	redisSrv := redistest.StartServer(t)
	rdb := redisSrv.Client()
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range n {
		if _, err := producer.Enqueue(context.Background(), client, "api:call", nil, "acme",
			asynq.TaskID(fmt.Sprintf("t%02d", i)), asynq.MaxRetry(3), asynq.Retention(time.Hour)); err != nil {
			t.Fatal(err)
		}
	}
	env := []string{crashChildEnv + "=1", "REDIS_ADDR=" + redisSrv.Addr,
		"THROTTLE_RULES=api:call tenant=5/1s", "WORKER_WORK_TIME=0s", "WORKER_FORWARDER_INTERVAL=100ms"}
	child := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	child.Env = append(os.Environ(), env...)
	var childOut syncBuffer
	child.Stdout, child.Stderr = &childOut, &childOut
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = child.Wait(); close(exited) }()
	t.Cleanup(func() { _ = child.Process.Kill(); <-exited })

	insp := asynq.NewInspectorFromRedisClient(rdb)
	active := func() []*asynq.TaskInfo {
		ts, err := insp.ListActiveTasks("default")
		if err != nil {
			return nil
		}
		return ts
	}
	waitFor(t, 20*time.Second, "3 tasks are active in the child", func() bool { return len(active()) >= 3 })
	if err := child.Process.Kill(); err != nil { // SIGKILL: no shutdown, no requeue
		t.Fatal(err)
	}
	<-exited
	killedAt := time.Now()
	interrupted := map[string]bool{}
	for _, ti := range active() {
		interrupted[ti.ID] = true
	}
	if len(interrupted) == 0 {
		t.Fatalf("no task was active when the worker was killed; its output:\n%s", childOut.String())
	}

	for _, kv := range env[1:] {
		k, v, _ := cutEnv(kv)
		t.Setenv(k, v)
	}
	w := startWorker(t)
	defer w.stop(t, 15*time.Second)
	// The second scan of its recoverer, 60 s after it started, finds them; allow 30 s more.
	waitFor(t, 90*time.Second, "every task completed", func() bool {
		qi, err := insp.GetQueueInfo("default")
		return err == nil && qi.Completed+qi.Archived == n
	})
	t.Logf("%d tasks interrupted by the kill; all %d done %s after it", len(interrupted), n, time.Since(killedAt).Round(100*time.Millisecond))
	if qi, _ := insp.GetQueueInfo("default"); qi.Archived != 0 || qi.Completed != n {
		t.Errorf("queue: %d completed, %d archived; want %d completed, none archived", qi.Completed, qi.Archived, n)
	}
	for i := range n {
		id := fmt.Sprintf("t%02d", i)
		ti, err := insp.GetTaskInfo("default", id)
		if err != nil {
			t.Errorf("task %s: %v", id, err)
			continue
		}
		if ti.Retried != 0 {
			t.Errorf("task %s: Retried %d (last error %q), want 0: a crash costs no retry", id, ti.Retried, ti.LastErr)
		}
		// An interrupted task stays active until the recoverer finds it: its lease, at least
		// 25 s left at the kill (extended to 30 s every 5 s), plus the recoverer's 30 s.
		if interrupted[id] && ti.CompletedAt.Before(killedAt.Add(55*time.Second)) {
			t.Errorf("task %s, interrupted by the kill, completed %s after it, want >= 55s (recovered by asynq's recoverer)",
				id, ti.CompletedAt.Sub(killedAt).Round(time.Second))
		}
	}
}

// cutEnv splits "KEY=value".
func cutEnv(kv string) (string, string, bool) {
	for i := range len(kv) {
		if kv[i] == '=' {
			return kv[:i], kv[i+1:], true
		}
	}
	return kv, "", false
}
