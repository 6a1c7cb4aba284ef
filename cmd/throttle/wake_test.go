package main

import (
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// TestReset_wake: a worker (the middleware on an asynq server, overrides read at the
// default interval) under "wk:call tenant=1/1m". acme's 3 tasks: 1 runs, 2 wait in retry
// for 1m and 2m; a 4th with MaxRetry(0) waits as a deferred copy (scheduled) for 3m.
// globex's 2: 1 runs, 1 waits. The type's quota is raised to tenant=10/1m: the waiting
// tasks would still come back at 1m, 2m and 3m (trial 4 saw such a tail run for 51 s).
// `throttle reset -type wk:call -tenant acme -wake -yes` releases acme's 3 reservations,
// deletes its 2 keys and runs its 3 waiting tasks at once, under the new quota; globex's
// waiting task is not acme's and stays in retry.
func TestReset_wake(t *testing.T) {
	srv := redistest.StartServer(t)
	setEnv(t, "REDIS_ADDR", srv.Addr)
	rdb := srv.Client()
	w := startWorker(t, rdb, "wk:call tenant=1/1m", func(c *worker.Config) { c.Concurrency = 10 })
	client := asynq.NewClientFromRedisClient(rdb)
	insp := asynq.NewInspectorFromRedisClient(rdb)
	// wait waits until acme and globex ran the given counts and the queue holds nothing
	// pending or active, retry tasks waiting and scheduled ones.
	wait := func(what string, acme, globex, retry, scheduled int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			qi, err := insp.GetQueueInfo("default")
			a, g := w.ran("acme"), w.ran("globex")
			if err == nil && qi.Pending == 0 && qi.Active == 0 && qi.Retry == retry && qi.Scheduled == scheduled && a == acme && g == globex {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: ran acme %d, globex %d, queue %+v (%v); want %d, %d, %d in retry, %d scheduled", what, a, g, qi, err, acme, globex, retry, scheduled)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	enqueue := func(tenant string, n int, opts ...asynq.Option) {
		t.Helper()
		for range n {
			if _, err := client.Enqueue(producer.NewTask("wk:call", nil, tenant, opts...)); err != nil {
				t.Fatal(err)
			}
		}
	}
	enqueue("acme", 3)
	wait("acme's 3", 1, 0, 2, 0)
	enqueue("acme", 1, asynq.MaxRetry(0))
	wait("acme's copy", 1, 0, 2, 1)
	enqueue("globex", 2)
	wait("globex's 2", 1, 1, 3, 1)

	if code, out, errOut := cli(t, "limits", "set", "type", "wk:call", "tenant=10/1m"); code != exitOK {
		t.Fatalf("limits set: exit %d, %s%s", code, out, errOut)
	}
	time.Sleep(pickUpBound)
	wantRun(t, []string{"reset", "-type", "wk:call", "-tenant", "acme", "-wake", "-yes"}, exitOK,
		`reset wk:call for tenant "acme": deleted 2 keys, released 3 reservations, ran 3 waiting tasks now`+"\n", "")
	wait("after reset -wake", 4, 1, 1, 0)
	// Nothing of a mistyped type to delete or wake: not found, as a plain reset.
	wantRun(t, []string{"reset", "-type", "wk:cal", "-wake", "-yes"}, exitNotFound, "",
		"throttle: reset: nothing to reset: no key of task type wk:cal and no task of it waiting\n")
}
