package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/rs/xid"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// taskType is the asynq task type of the demo's tasks: one call to the fake API.
const taskType = "demo:call"

// retention keeps completed tasks in Redis so the run can count them (and, with -keep,
// so asynqmon can show them).
const retention = time.Hour

// payload is the payload of a demo task. The tenant travels in the task header
// (producer.TenantHeader), where the throttling middleware reads it; Seq tells a tenant's
// tasks apart.
type payload struct {
	Tenant string `json:"tenant"`
	Seq    int    `json:"seq"`
}

// workerLimit is the per-tenant limit the worker enforces so that calls fit the API's
// limit of events per window: the same count in a window widened by margin.
//
// A request admitted at t reaches the API at t + latency. If latency varies by up to J,
// two requests admitted W apart can arrive only W - J apart: the later one left late, the
// earlier one early. So admissions spaced a full API window W apart can still land in one
// API window. Admitting at most L per W + J keeps any L+1 admissions more than W + J
// apart, hence their arrivals more than W apart: never more than L in one API window.
// The margin costs throughput (at best W/(W+J) of the API's limit) and buys no 429s.
func workerLimit(o options) throttle.Limit {
	return throttle.Limit{Events: o.APILimit, Window: o.APIWindow + o.Margin}
}

// pingTimeout bounds the check that Redis answers, before anything is enqueued.
const pingTimeout = 5 * time.Second

// run executes one demo on be: it starts the fake API and a throttled asynq worker,
// enqueues the tasks, waits until all are completed, the -timeout passes or ctx ends,
// stops the worker, and reports what happened. An error means the run could not happen
// (Redis unreachable, an enqueue failed); a run that happened but went wrong is a Report
// that is not OK. Progress goes to prog, asynq's warnings and task failures to logw.
func run(ctx context.Context, o options, be *backend, prog progress, logw io.Writer) (Report, error) {
	start := time.Now()
	apiLimit := throttle.Limit{Events: o.APILimit, Window: o.APIWindow}
	wl := workerLimit(o)
	ruleText := taskType + " tenant=" + wl.String()
	rules, err := worker.ParseRules(ruleText)
	if err != nil {
		return Report{}, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, pingTimeout)
	err = be.ping(pingCtx)
	cancel()
	if err != nil {
		return Report{}, fmt.Errorf("%s: %w", be.name, err)
	}

	api := newFakeAPI(o.APILimit, o.APIWindow, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Report{}, fmt.Errorf("fake API: %w", err)
	}
	hs := &http.Server{Handler: api, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()

	j := newJournal()
	lim, err := throttle.New(be.rdb, throttle.Config{})
	if err != nil {
		return Report{}, err
	}
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: be.rdb, DecisionFunc: j.decided, NoEvictionCheck: be.embedded,
		// Wake re-queued tasks as early as this server's forwarder (100ms, below) and
		// asynq's whole-second retry times need: 1s + 100ms + 250ms for polling.
		WakeLead: time.Second + 100*time.Millisecond + 250*time.Millisecond})
	if err != nil {
		return Report{}, err
	}
	h := &handler{
		url:    "http://" + ln.Addr().String() + "/call",
		client: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: o.Concurrency}},
		jitter: o.Jitter,
		j:      j,
	}
	defer h.client.CloseIdleConnections()
	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.Handle(taskType, h)

	queue := "throttle-demo-" + xid.New().String()
	logger := log.New(logw, "demo: ", 0)
	srv := asynq.NewServerFromRedisClient(be.rdb, worker.WrapConfig(asynq.Config{
		Concurrency: o.Concurrency,
		Queues:      map[string]int{queue: 1},
		// Snappy for a demo: an idle worker looks for tasks every ~50ms, and the
		// forwarder moves due re-queued tasks back every 100ms (asynq: 1s and 5s).
		TaskCheckInterval:        50 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		ShutdownTimeout:          10 * time.Second,
		LogLevel:                 asynq.WarnLevel,
		Logger:                   asynqLogger{logger},
		ErrorHandler: asynq.ErrorHandlerFunc(func(_ context.Context, _ *asynq.Task, err error) {
			logger.Printf("task failed: %v", err) // WrapConfig keeps denials out of here
		}),
	}))
	insp := asynq.NewInspectorFromRedisClient(be.rdb)
	if !o.Keep {
		defer func() {
			if err := deleteQueue(insp, be.rdb, queue, start); err != nil {
				logger.Printf("could not delete queue %s: %v", queue, err)
			}
		}()
	}

	enqueued, err := enqueue(ctx, asynq.NewClientFromRedisClient(be.rdb), queue, o)
	if err != nil {
		return Report{}, err
	}
	total := len(o.Tenants) * o.PerTenant
	if err := srv.Start(mux); err != nil {
		return Report{}, fmt.Errorf("start asynq server: %w", err)
	}
	stopped, doneThen := waitDone(ctx, o.Timeout, start, total, j, api, prog)
	elapsed := time.Since(start)
	srv.Shutdown()
	if done, _ := j.counts(); stopped != "" && done != doneThen {
		// Tasks running when it stopped finish during Shutdown: the report's counts,
		// read after it, include them.
		stopped += fmt.Sprintf(", %d once the shutdown let the running ones finish", done)
	}

	states, err := inspect(insp, queue)
	if err != nil {
		return Report{}, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	admissions, throttled := j.snapshot()
	return buildReport(runData{
		Backend:     be.name,
		Queue:       queue,
		TaskType:    taskType,
		APILimit:    apiLimit,
		WorkerLimit: wl,
		Rule:        ruleText,
		Jitter:      o.Jitter,
		Tenants:     o.Tenants,
		Enqueued:    enqueued,
		Admissions:  admissions,
		Throttled:   throttled,
		API:         api.stats(),
		States:      states,
		Elapsed:     elapsed,
		Stopped:     stopped,
	}), nil
}

// enqueue puts o.PerTenant tasks per tenant in queue, interleaved (acme 0, globex 0, ...,
// acme 1, ...), each kept for retention after it completes, and returns the count per
// tenant.
func enqueue(ctx context.Context, c *asynq.Client, queue string, o options) (map[string]int, error) {
	n := make(map[string]int, len(o.Tenants))
	for seq := range o.PerTenant {
		for _, tenant := range o.Tenants {
			b, err := json.Marshal(payload{Tenant: tenant, Seq: seq})
			if err != nil {
				return nil, err
			}
			if _, err := producer.Enqueue(ctx, c, taskType, b, tenant, asynq.Queue(queue), asynq.Retention(retention)); err != nil {
				return nil, err
			}
			n[tenant]++
		}
	}
	return n, nil
}

// waitDone shows progress until total tasks have completed, and returns "" then, or why
// it stopped waiting: ctx ended (interrupted) or timeout passed since start; and the
// tasks completed by then.
func waitDone(ctx context.Context, timeout time.Duration, start time.Time, total int, j *journal, api *fakeAPI, prog progress) (string, int) {
	defer prog.finish()
	deadline := time.NewTimer(timeout - time.Since(start))
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		done, throttled := j.counts()
		prog.update(done, total, throttled, api.rejectedTotal(), time.Since(start))
		if done >= total {
			return "", done
		}
		select {
		case <-ctx.Done():
			return fmt.Sprintf("interrupted with %d of %d tasks completed by then", done, total), done
		case <-deadline.C:
			return fmt.Sprintf("timed out after %s with %d of %d tasks completed by then", timeout, done, total), done
		case <-tick.C:
		}
	}
}

// handler calls the fake API once per task, as a real worker would call a third party.
type handler struct {
	url    string
	client *http.Client
	jitter time.Duration
	j      *journal
}

// ProcessTask logs the admission instant the limiter decided on (worker.DecisionFrom),
// POSTs the payload to the API with the tenant header, and fails the task on a non-2xx
// answer: a real failure, retried by asynq with its usual backoff.
func (h *handler) ProcessTask(ctx context.Context, t *asynq.Task) error {
	d, ok := worker.DecisionFrom(ctx)
	if !ok {
		return fmt.Errorf("task %s ran without a throttle decision: %w", t.Type(), asynq.SkipRetry)
	}
	tenant := t.Headers()[producer.TenantHeader]
	var p payload
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		return fmt.Errorf("task %s: bad payload %q: %v: %w", t.Type(), t.Payload(), err, asynq.SkipRetry)
	}
	h.j.admitted(tenant, d.At)
	if h.jitter > 0 {
		select {
		case <-time.After(rand.N(h.jitter + 1)):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.url, bytes.NewReader(t.Payload()))
	if err != nil {
		return err
	}
	req.Header.Set(APITenantHeader, tenant)
	req.Header.Set("Content-Type", "application/json")
	resp, err := h.client.Do(req)
	if err != nil {
		return fmt.Errorf("call API for tenant %q seq %d: %w", tenant, p.Seq, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("API answered %s to tenant %q seq %d", resp.Status, tenant, p.Seq)
	}
	h.j.completed(tenant, p.Seq)
	return nil
}

// journal records what the worker saw, per tenant. Safe for concurrent use.
type journal struct {
	mu         sync.Mutex
	admissions map[string][]time.Time // decision instants of handler runs
	throttled  map[string]int         // denials
	done       map[string]map[int]bool
	doneN      int // distinct (tenant, seq) completed
	throttledN int
}

func newJournal() *journal {
	return &journal{admissions: map[string][]time.Time{}, throttled: map[string]int{}, done: map[string]map[int]bool{}}
}

// decided is the worker's DecisionFunc: it counts denials.
func (j *journal) decided(_ context.Context, _ *asynq.Task, key throttle.Key, d throttle.Decision) {
	if d.Allowed {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.throttled[key.Tenant]++
	j.throttledN++
}

func (j *journal) admitted(tenant string, at time.Time) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.admissions[tenant] = append(j.admissions[tenant], at)
}

func (j *journal) completed(tenant string, seq int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.done[tenant] == nil {
		j.done[tenant] = map[int]bool{}
	}
	if !j.done[tenant][seq] {
		j.done[tenant][seq] = true
		j.doneN++
	}
}

func (j *journal) counts() (done, throttled int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.doneN, j.throttledN
}

func (j *journal) snapshot() (map[string][]time.Time, map[string]int) {
	j.mu.Lock()
	defer j.mu.Unlock()
	adm := make(map[string][]time.Time, len(j.admissions))
	for t, ts := range j.admissions {
		adm[t] = append([]time.Time(nil), ts...)
	}
	thr := make(map[string]int, len(j.throttled))
	for t, n := range j.throttled {
		thr[t] = n
	}
	return adm, thr
}

// inspect counts each tenant's distinct tasks (tenant header, payload seq) in queue by
// state. A task is counted once, in the first of completed, archived, and pending
// (pending, active, scheduled, retry) that holds it, so a revoked original and its
// re-enqueued copy are one task.
func inspect(insp *asynq.Inspector, queue string) (map[string]taskStates, error) {
	type list func(string, ...asynq.ListOption) ([]*asynq.TaskInfo, error)
	seen := map[string]map[int]bool{}
	out := map[string]taskStates{}
	for i, l := range []list{insp.ListCompletedTasks, insp.ListArchivedTasks,
		insp.ListPendingTasks, insp.ListActiveTasks, insp.ListScheduledTasks, insp.ListRetryTasks} {
		const size = 500
		for page := 1; ; page++ {
			infos, err := l(queue, asynq.PageSize(size), asynq.Page(page))
			if err != nil {
				return nil, err
			}
			for _, info := range infos {
				var p payload
				if info.Type != taskType || json.Unmarshal(info.Payload, &p) != nil {
					continue
				}
				tenant := info.Headers[producer.TenantHeader]
				if seen[tenant] == nil {
					seen[tenant] = map[int]bool{}
				}
				if seen[tenant][p.Seq] {
					continue
				}
				seen[tenant][p.Seq] = true
				st := out[tenant]
				switch i {
				case 0:
					st.Completed++
				case 1:
					st.Archived++
				default:
					st.Pending++
				}
				out[tenant] = st
			}
			if len(infos) < size {
				break
			}
		}
	}
	return out, nil
}

// deleteQueue removes queue, its tasks and its counters. asynq's DeleteQueue leaves
// completed tasks behind (and nothing would ever expire them without a server on the
// queue), so they go first; it also leaves the queue's processed and failed counters,
// the totals without a TTL and one of each per UTC day for 90 days, which asynq's
// Inspector cannot delete: they go last, by the names asynq gives them
// ("asynq:{<queue>}:processed", "...:processed:<YYYY-MM-DD>", and the same for failed),
// for every day from start to now. The queue's name is the run's own.
func deleteQueue(insp *asynq.Inspector, rdb redis.UniversalClient, queue string, start time.Time) error {
	if _, err := insp.DeleteAllCompletedTasks(queue); err != nil {
		return err
	}
	if err := insp.DeleteQueue(queue, true); err != nil {
		return err
	}
	prefix := "asynq:{" + queue + "}:"
	keys := []string{prefix + "processed", prefix + "failed"}
	for day := start.UTC().Truncate(24 * time.Hour); !day.After(time.Now().UTC()); day = day.Add(24 * time.Hour) {
		d := day.Format("2006-01-02")
		keys = append(keys, prefix+"processed:"+d, prefix+"failed:"+d)
	}
	return rdb.Del(context.Background(), keys...).Err() // one slot on a Redis Cluster: the queue's hash tag
}

// asynqLogger is an asynq.Logger that writes through a *log.Logger.
type asynqLogger struct{ l *log.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Print(append([]any{"asynq debug: "}, args...)...) }
func (a asynqLogger) Info(args ...any)  { a.l.Print(append([]any{"asynq info: "}, args...)...) }
func (a asynqLogger) Warn(args ...any)  { a.l.Print(append([]any{"asynq warning: "}, args...)...) }
func (a asynqLogger) Error(args ...any) { a.l.Print(append([]any{"asynq error: "}, args...)...) }
func (a asynqLogger) Fatal(args ...any) { a.l.Fatal(append([]any{"asynq fatal: "}, args...)...) }

var _ asynq.Logger = asynqLogger{}
