package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
)

// report is the outcome of a run: the scenario and one result per strategy.
type report struct {
	Scenario scenario
	Results  map[string]result
}

// Timing of the parent's loops.
const (
	topUpInterval    = 100 * time.Millisecond // the producer tops the backlogs up
	progressInterval = 5 * time.Second        // a progress line on stderr
	readyTimeout     = 30 * time.Second       // for every worker process to start its server
	stopTimeout      = 20 * time.Second       // for a worker process to shut down, then it is killed
)

// run runs every strategy of sc in turn, on its own redis-server unless sc.RedisAddr is
// set, and returns the report. Progress and the workers' logs go to stderr. It stops
// early, killing what it started, when ctx ends.
func run(ctx context.Context, sc scenario, stderr io.Writer) (report, error) {
	stderr = &syncWriter{w: stderr} // the workers' logs and progress lines share it
	exe, err := os.Executable()
	if err != nil {
		return report{}, fmt.Errorf("find this binary to start workers: %w", err)
	}
	addr := sc.RedisAddr
	if addr == "" {
		srv, err := startRedis(ctx)
		if err != nil {
			return report{}, err
		}
		defer srv.stop()
		addr = srv.addr
		fmt.Fprintf(stderr, "throttlebench: redis-server on %s\n", addr)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return report{}, fmt.Errorf("Redis at %s: %w", addr, err)
	}
	harness := &callCounter{}
	rdb.AddHook(harness)
	var records io.Writer
	if sc.Records != "" {
		f, err := os.Create(sc.Records)
		if err != nil {
			return report{}, fmt.Errorf("-records: %w", err)
		}
		defer f.Close()
		bw := bufio.NewWriter(f)
		defer bw.Flush()
		records = bw
	}
	rep := report{Scenario: sc, Results: map[string]result{}}
	for _, strategy := range sc.Strategies {
		res, err := runStrategy(ctx, sc, strategy, exe, addr, rdb, harness, records, stderr)
		if err != nil {
			return report{}, fmt.Errorf("%s: %w", strategy, err)
		}
		rep.Results[strategy] = res
	}
	return rep, nil
}

// runStrategy runs the scenario once with strategy on a flushed Redis: it starts the
// worker processes, keeps the backlogs topped up for sc.Duration, waits for the drain,
// stops the workers and summarizes their records.
func runStrategy(ctx context.Context, sc scenario, strategy, exe, addr string, rdb redis.UniversalClient, harness *callCounter, records, stderr io.Writer) (result, error) {
	harnessBefore := harness.roundTrips.Load()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		return result{}, fmt.Errorf("flush Redis: %w", err)
	}
	before, err := readRedisCounters(ctx, rdb)
	if err != nil {
		return result{}, err
	}
	col := newCollector(strategy, records)
	args := make([][]string, sc.Workers)
	for i := range args {
		args[i] = workerArgs(sc, strategy, addr, i)
	}
	procs, err := startWorkers(ctx, exe, args, col, stderr)
	defer procs.stop() // on early returns; a no-op after the stop below
	if err != nil {
		return result{}, err
	}
	if err := procs.waitReady(ctx); err != nil {
		return result{}, err
	}
	fmt.Fprintf(stderr, "throttlebench: %s: %d workers ready; topping up %d tasks per tenant for %s\n",
		strategy, sc.Workers, sc.waiting(), sc.Duration)

	prod := &topUp{
		client:   asynq.NewClientFromRedisClient(rdb), // shares rdb: never closed here
		tenants:  sc.tenantNames(),
		target:   sc.waiting(),
		col:      col,
		enqueued: map[string][]time.Time{},
	}
	insp := asynq.NewInspectorFromRedisClient(rdb)
	start := time.Now()
	tick := time.NewTicker(topUpInterval)
	defer tick.Stop()
	lastProgress := start
	progress := func(phase string) {
		if time.Since(lastProgress) >= progressInterval {
			lastProgress = time.Now()
			completed, requeued := col.counts()
			fmt.Fprintf(stderr, "throttlebench: %s: %s %3.0fs: enqueued %d, completed %d, re-queued %d\n",
				strategy, phase, time.Since(start).Seconds(), prod.total(), completed, requeued)
		}
	}
	for first := true; time.Since(start) < sc.Duration; first = false {
		if err := prod.fill(ctx); err != nil {
			return result{}, err
		}
		if first { // a slow start shapes every later window: see the legend on lateness
			fmt.Fprintf(stderr, "throttlebench: %s: enqueued the first %d tasks in %s\n",
				strategy, prod.total(), time.Since(start).Round(time.Millisecond))
		}
		progress("top-up")
		select {
		case <-ctx.Done():
			return result{}, ctx.Err()
		case <-tick.C:
		}
	}

	// Drain: wait until every task completed, or asynq holds none that could still run.
	drainStart := time.Now()
	var undrained int
	var note string
	var lastCheck time.Time
	for {
		if completed, _ := col.counts(); completed >= prod.total() {
			break
		}
		if time.Since(lastCheck) >= time.Second {
			lastCheck = time.Now()
			info, err := insp.GetQueueInfo(queue)
			if err != nil {
				return result{}, fmt.Errorf("inspect queue %s: %w", queue, err)
			}
			if left := info.Pending + info.Active + info.Scheduled + info.Retry; left == 0 {
				break // the rest were archived or lost
			} else if time.Since(drainStart) >= sc.DrainTimeout {
				undrained = left
				note = fmt.Sprintf("%d tasks still queued after the %s drain timeout", left, sc.DrainTimeout)
				break
			}
		}
		progress("drain")
		select {
		case <-ctx.Done():
			return result{}, ctx.Err()
		case <-tick.C:
		}
	}
	procs.stop()
	wall := time.Since(start)
	after, err := readRedisCounters(ctx, rdb)
	if err != nil {
		return result{}, err
	}
	if err := col.err(); err != nil {
		return result{}, err
	}
	archived := 0
	if info, err := insp.GetQueueInfo(queue); err == nil {
		archived = info.Archived
	} else if prod.total() > 0 {
		return result{}, fmt.Errorf("inspect queue %s: %w", queue, err)
	}

	res := summarize(runData{Limit: sc.Limit, Tenants: prod.tenants, Enqueued: prod.enqueued, Records: col.all()})
	res.Archived = archived
	res.Lost = res.Enqueued - res.Completed - res.Archived
	res.Undrained, res.DrainNote = undrained, note
	res.RedisCommands = after.Commands - before.Commands
	if res.Completed > 0 {
		res.RedisCommandsPerTask = float64(res.RedisCommands) / float64(res.Completed)
		res.RedisCPUPerTaskUS = float64((after.CPU-before.CPU)/time.Microsecond) / float64(res.Completed)
	}
	res.RoundTrips = col.workerCalls()
	res.RoundTrips.Harness = harness.roundTrips.Load() - harnessBefore
	if res.Completed > 0 {
		n := float64(res.Completed)
		res.ThrottleRoundTripsPerTask = float64(res.RoundTrips.Throttle) / n
		res.AsynqRoundTripsPerTask = float64(res.RoundTrips.Asynq+res.RoundTrips.Harness) / n
	}
	res.WallSeconds = wall.Seconds()
	fmt.Fprintf(stderr, "throttlebench: %s: done in %s (drain %s): %d enqueued, %d completed, %d archived, %d lost\n",
		strategy, wall.Round(100*time.Millisecond), time.Since(drainStart).Round(100*time.Millisecond),
		res.Enqueued, res.Completed, res.Archived, res.Lost)
	return res, nil
}

// topUp is the producer: it keeps target tasks waiting (enqueued, not yet completed)
// for each tenant.
type topUp struct {
	client   *asynq.Client
	tenants  []string
	target   int
	col      *collector
	enqueued map[string][]time.Time // per tenant, the instant before each enqueue, by seq
}

// fill enqueues, for each tenant, as many tasks as it lacks to have target waiting,
// tenants interleaved.
func (p *topUp) fill(ctx context.Context) error {
	need := make([]int, len(p.tenants))
	most := 0
	for i, t := range p.tenants {
		need[i] = p.target - (len(p.enqueued[t]) - p.col.completedOf(t))
		most = max(most, need[i])
	}
	for k := 0; k < most; k++ {
		for i, t := range p.tenants {
			if k >= need[i] {
				continue
			}
			seq := len(p.enqueued[t])
			b, err := json.Marshal(payload{Tenant: t, Seq: seq})
			if err != nil {
				return err
			}
			at := time.Now()
			if _, err := producer.Enqueue(ctx, p.client, taskType, b, t, asynq.Queue(queue)); err != nil {
				return err
			}
			p.enqueued[t] = append(p.enqueued[t], at)
		}
	}
	return nil
}

// total is the number of tasks enqueued so far.
func (p *topUp) total() int {
	n := 0
	for _, e := range p.enqueued {
		n += len(e)
	}
	return n
}

// collector gathers the records of one strategy's workers as they come.
type collector struct {
	strategy string
	mu       sync.Mutex
	records  []record
	ran      map[taskID]bool
	done     map[string]int // per tenant, tasks that ran
	requeued int
	out      io.Writer // every record, with its strategy, as JSON lines; may be nil
	calls    calls     // the workers' round trips, summed
	firstErr error
}

func newCollector(strategy string, out io.Writer) *collector {
	return &collector{strategy: strategy, ran: map[taskID]bool{}, done: map[string]int{}, out: out}
}

// addCalls takes a worker's last line: its round trips.
func (c *collector) addCalls(line []byte) {
	var n calls
	err := json.Unmarshal(line, &n)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		c.fail(fmt.Errorf("bad calls line from a worker: %q: %w", line, err))
		return
	}
	c.calls.Throttle += n.Throttle
	c.calls.Asynq += n.Asynq
}

// workerCalls returns the round trips of the workers that have exited.
func (c *collector) workerCalls() calls {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls
}

// add takes one record line from a worker.
func (c *collector) add(line []byte) {
	var rec record
	err := json.Unmarshal(line, &rec)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		c.fail(fmt.Errorf("bad record line from a worker: %q: %w", line, err))
		return
	}
	rec.Strategy = c.strategy
	c.records = append(c.records, rec)
	switch rec.Outcome {
	case outcomeRan:
		id := taskID{rec.Tenant, rec.Seq}
		if !c.ran[id] {
			c.ran[id] = true
			c.done[rec.Tenant]++
		}
	case outcomeRequeued:
		c.requeued++
	}
	if c.out != nil {
		b, _ := json.Marshal(rec)
		if _, err := c.out.Write(append(b, '\n')); err != nil {
			c.fail(fmt.Errorf("-records: %w", err))
		}
	}
}

func (c *collector) fail(err error) {
	if c.firstErr == nil {
		c.firstErr = err
	}
}

func (c *collector) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.firstErr
}

// completedOf returns the number of tenant's tasks that ran.
func (c *collector) completedOf(tenant string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.done[tenant]
}

// counts returns the number of tasks that ran and of re-queued deliveries.
func (c *collector) counts() (completed, requeued int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ran), c.requeued
}

// all returns every record so far.
func (c *collector) all() []record {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]record(nil), c.records...)
}

// workerProc is one worker process and the goroutine reading its records.
type workerProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser // closed to ask the worker to shut down
	ready chan struct{}  // closed when the worker wrote readyLine
	read  chan struct{}  // closed when its stdout is read to the end
}

type workerProcs struct {
	procs   []*workerProc
	stopped bool
	stderr  io.Writer
}

// startWorkers starts one worker process per command line in args, each a
// re-execution of exe; their records go to col and their logs to stderr.
func startWorkers(ctx context.Context, exe string, args [][]string, col *collector, stderr io.Writer) (*workerProcs, error) {
	ws := &workerProcs{stderr: stderr}
	for i, a := range args {
		cmd := exec.Command(exe, a...)
		cmd.Stderr = stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return ws, err
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return ws, err
		}
		if err := cmd.Start(); err != nil {
			return ws, fmt.Errorf("start worker %d: %w", i, err)
		}
		w := &workerProc{cmd: cmd, stdin: stdin, ready: make(chan struct{}), read: make(chan struct{})}
		ws.procs = append(ws.procs, w)
		go func() {
			defer close(w.read)
			sc := bufio.NewScanner(stdout)
			sc.Buffer(make([]byte, 64<<10), 16<<20)
			for sc.Scan() {
				switch line := sc.Bytes(); {
				case string(line) == readyLine:
					close(w.ready)
				case bytes.HasPrefix(line, []byte(callsPrefix)):
					col.addCalls(line[len(callsPrefix):])
				default:
					col.add(line)
				}
			}
			_, _ = io.Copy(io.Discard, stdout) // after a scan error, let the worker finish
		}()
	}
	return ws, ctx.Err()
}

// waitReady waits until every worker has started its asynq server.
func (ws *workerProcs) waitReady(ctx context.Context) error {
	timeout := time.After(readyTimeout)
	for i, w := range ws.procs {
		select {
		case <-w.ready:
		case <-w.read:
			return fmt.Errorf("worker %d exited before it was ready (its log is above)", i)
		case <-timeout:
			return fmt.Errorf("worker %d not ready after %s", i, readyTimeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// stop asks every worker to shut down (it closes their stdin), waits for them to exit,
// killing those that take longer than stopTimeout, and reads their last records.
func (ws *workerProcs) stop() {
	if ws.stopped {
		return
	}
	ws.stopped = true
	for _, w := range ws.procs {
		_ = w.stdin.Close()
	}
	timeout := time.After(stopTimeout)
	for i, w := range ws.procs {
		select {
		case <-w.read:
		case <-timeout:
			fmt.Fprintf(ws.stderr, "throttlebench: worker %d did not stop within %s; killing it\n", i, stopTimeout)
			_ = w.cmd.Process.Kill()
			<-w.read
		}
		if err := w.cmd.Wait(); err != nil {
			fmt.Fprintf(ws.stderr, "throttlebench: worker %d: %v\n", i, err)
		}
	}
}

// syncWriter serializes writes to w.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
