package worker_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// scriptReply delays the reply of script calls on an api:call key that succeed (not a
// NOSCRIPT) by delay, while on. With lose, only the first such call, whose reply it then
// reports failed, as a reply lost on the way back (or, in durable mode, an admission
// acknowledged late) looks to the caller: the script decided, the caller does not know
// what; done says it happened. Without, every call while on: a slow reply.
type scriptReply struct {
	delay time.Duration
	lose  bool
	on    atomic.Bool
	done  atomic.Bool
}

func (h *scriptReply) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		name := strings.ToLower(cmd.Name())
		if (name != "evalsha" && name != "eval") || err != nil || !h.on.Load() || !strings.Contains(fmt.Sprint(cmd.Args()), "{api:call}") {
			return err
		}
		if !h.lose {
			time.Sleep(h.delay)
			return nil
		}
		if h.done.CompareAndSwap(false, true) {
			time.Sleep(h.delay)
			err = errors.New("test: the reply was lost")
			cmd.SetErr(err)
		}
		return err
	}
}

func (h *scriptReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestAllow_lateReplay: a task's first limiter call admits it (rule tenant=1/1s, an empty
// log) but its reply is lost for 300ms; the middleware asks again with the same event
// id 50ms later and finds the admission (a replay), now 350ms past its instant. Started
// then, the task would run 350ms after the instant the log counts it at, so an upstream
// with the same limit could see 2 calls within 1s: the middleware asks again as a new
// event instead, which is admitted for the next slot, when the first admission leaves the
// window. So the handler runs once, about 1s after the first call, on a decision that is
// not a replay, and the log holds both admissions, 1s apart (the first one's slot is lost).
func TestAllow_lateReplay(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	hook := &scriptReply{delay: 300 * time.Millisecond, lose: true}
	hook.on.Store(true)
	lrdb := redis.NewClient(&redis.Options{Addr: rdb.Options().Addr})
	t.Cleanup(func() { _ = lrdb.Close() })
	lim := newLimiter(t, lrdb)
	lrdb.AddHook(hook)
	var mu sync.Mutex
	var decisions []throttle.Decision
	mw, err := worker.New(lim, worker.Config{
		Rules: mustRules(t, "api:call tenant=1/1s"), Redis: rdb, NoReservations: true, SweepInterval: -1,
		Logger: slog.New(slog.NewTextHandler(&syncBuffer{}, nil)),
		DecisionFunc: func(_ context.Context, _ *asynq.Task, _ throttle.Key, d throttle.Decision) {
			mu.Lock()
			decisions = append(decisions, d)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var ran []time.Time
	h := mw(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		mu.Lock()
		ran = append(ran, time.Now())
		mu.Unlock()
		return nil
	}))
	start := time.Now()
	if err := h.ProcessTask(context.Background(), producer.NewTask("api:call", nil, "acme")); err != nil {
		t.Fatalf("ProcessTask = %v, want nil (run once, for the next slot)", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !hook.done.Load() {
		t.Fatal("no script call was answered as lost: the test did not run its case")
	}
	if len(ran) != 1 || ran[0].Sub(start) < 950*time.Millisecond {
		t.Fatalf("handler runs %v after the first call, want one, about 1s after it (not at the replay, 350ms)", sinceAll(start, ran))
	}
	if len(decisions) != 1 || !decisions[0].Allowed || decisions[0].Replay || decisions[0].Delay <= 0 {
		t.Errorf("decisions %+v, want one admission for a slot ahead, not a replay", decisions)
	}
	logged := admissions(t, rdb, lim.RedisKey(throttle.Key{TaskType: "api:call", Tenant: "acme"}, throttle.ScopeTenant))
	if len(logged) != 2 || logged[1]-logged[0] != 1000 {
		t.Errorf("admissions in the log at %v ms, want 2, 1000 ms apart (the lost reply's, then the new event's)", logged)
	}
}

// sinceAll returns each of ts less start, rounded to the ms.
func sinceAll(start time.Time, ts []time.Time) []time.Duration {
	var ds []time.Duration
	for _, t := range ts {
		ds = append(ds, t.Sub(start).Round(time.Millisecond))
	}
	return ds
}
