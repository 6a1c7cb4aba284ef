// Package redistest starts throwaway redis-server processes for tests: each on a free
// loopback port, persistence off, stopped by t.Cleanup. Tests own their servers, so they
// can flush, stop and restart them freely. StartCluster joins several into a Redis Cluster;
// StartSentinel starts a primary, a replica and 3 sentinels that monitor them;
// StartServerPinned binds one to a CPU core for benchmarks, and ReadStats reads what it
// reports in INFO about the work it did.
//
// Without redis-server (or, for a cluster, redis-cli) on PATH the calling test fails and
// says how to install it: a suite that skips its Redis tests has tested nothing.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is one redis-server process on 127.0.0.1. Stop and Restart it to simulate an
// outage; the address stays the same.
type Server struct {
	Addr string // "127.0.0.1:<port>"

	tb     testing.TB
	port   int
	dir    string   // working directory, kept across Restart so AOF or RDB files survive
	runner []string // command that runs redis-server, e.g. taskset -c 1; nil: run it directly
	head   []string // arguments before the defaults, kept across Restart: a config file, --sentinel
	mu     sync.Mutex
	cmd    *exec.Cmd     // nil while stopped
	exited chan struct{} // closed when cmd has exited
}

// Start runs a redis-server on a free loopback port and returns a client for it; t.Cleanup
// stops both.
func Start(tb testing.TB) *redis.Client {
	tb.Helper()
	return StartServer(tb).Client()
}

// StartServer runs a redis-server on a free loopback port, persistence off unless
// extraArgs turn it on (they follow the defaults, so they win), and waits until it
// answers PING (at most 10s). t.Cleanup kills it.
func StartServer(tb testing.TB, extraArgs ...string) *Server {
	tb.Helper()
	return startServer(tb, freePort, func(*Server) []string { return extraArgs })
}

// StartServerPinned is StartServer with the redis-server process, and every thread it
// starts, bound to CPU core cpu (numbered as the kernel numbers them, from 0) by
// "taskset -c <cpu>", so that a benchmark's client goroutines do not share that core with
// it. Restart keeps it bound. Without taskset on PATH, or if taskset cannot bind to cpu
// (no such core, or not allowed here), the server runs unpinned, unpinned says why, and
// tb.Logf logs it; unpinned is nil when the server is pinned.
func StartServerPinned(tb testing.TB, cpu int, extraArgs ...string) (s *Server, unpinned error) {
	tb.Helper()
	runner, err := tasksetRunner(cpu)
	if err != nil {
		tb.Logf("redistest: redis-server NOT pinned to CPU %d: %v", cpu, err)
	}
	return startServerWith(tb, freePort, runner, func(*Server) []string { return extraArgs }), err
}

// tasksetRunner returns the command prefix that runs a program on CPU core cpu, checked by
// running "taskset -c <cpu> true" once, or the reason it cannot.
func tasksetRunner(cpu int) ([]string, error) {
	taskset, err := exec.LookPath("taskset")
	if err != nil {
		return nil, errors.New("taskset is not on PATH (Debian/Ubuntu: it is in util-linux)")
	}
	runner := []string{taskset, "-c", strconv.Itoa(cpu)}
	if out, err := exec.Command(taskset, append(runner[1:], "true")...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("taskset -c %d true: %v: %s", cpu, err, strings.TrimSpace(string(out)))
	}
	return runner, nil
}

// startServer is StartServer with the port chosen by pickPort and extra arguments that
// may name the server's port or directory (argsFor is called once per attempt, before the
// server starts; it may also set s.head, e.g. to a config file it wrote in s.dir).
func startServer(tb testing.TB, pickPort func(testing.TB) int, argsFor func(s *Server) []string) *Server {
	tb.Helper()
	return startServerWith(tb, pickPort, nil, argsFor)
}

// startServerWith is startServer with redis-server run by runner (nil: directly).
func startServerWith(tb testing.TB, pickPort func(testing.TB) int, runner []string, argsFor func(s *Server) []string) *Server {
	tb.Helper()
	path := lookPath(tb)
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ { // another process may take the free port first
		s := &Server{tb: tb, port: pickPort(tb), dir: tb.TempDir(), runner: runner}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
		if lastErr = s.start(path, argsFor(s)); lastErr == nil {
			tb.Cleanup(s.kill)
			return s
		}
	}
	tb.Fatalf("redistest: redis-server did not start: %v", lastErr)
	return nil
}

// Client returns a new client for s, closed by t.Cleanup.
func (s *Server) Client() *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	s.tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// Stop kills the server: clients see connection errors until Restart.
func (s *Server) Stop() {
	s.tb.Helper()
	s.kill()
}

// Restart starts the server again on the same port and directory and waits until it
// answers PING. It comes back empty unless extraArgs (at start and restart) turned
// persistence on, e.g. "--appendonly", "yes".
func (s *Server) Restart(extraArgs ...string) {
	s.tb.Helper()
	if err := s.start(lookPath(s.tb), extraArgs); err != nil {
		s.tb.Fatalf("redistest: restart redis-server on %s: %v", s.Addr, err)
	}
}

func (s *Server) start(path string, extraArgs []string) error {
	args := slices.Concat(s.head, []string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir}, extraArgs)
	if len(s.runner) > 0 { // the runner execs redis-server: the process is still the server
		path, args = s.runner[0], slices.Concat(s.runner[1:], []string{path}, args)
	}
	cmd := exec.Command(path, args...)
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()

	rdb := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := rdb.Ping(ctx).Err()
		cancel()
		switch {
		case err == nil:
			return nil
		case isClosed(exited):
			return fmt.Errorf("redis-server on %s exited before answering PING (port taken?)", s.Addr)
		case time.Now().After(deadline):
			s.kill()
			return fmt.Errorf("redis-server on %s did not answer PING within 10s: %v", s.Addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill stops the process, if running, and waits for it to exit.
func (s *Server) kill() {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// freePort asks the kernel for a free loopback port. The port is released before
// redis-server binds it, so StartServer retries if another process takes it meanwhile.
func freePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("redistest: find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// lookPath finds redis-server or fails the test with how to install it.
func lookPath(tb testing.TB) string {
	tb.Helper()
	return lookPathOf(tb, "redis-server")
}

// lookPathOf finds the Redis program name (redis-server or redis-cli) or fails the test
// with how to install it.
func lookPathOf(tb testing.TB, name string) string {
	tb.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		tb.Fatalf("redistest: %s is not on PATH; the tests need a real Redis. "+
			"Install it (Debian/Ubuntu: sudo apt-get install redis-server, which brings redis-tools "+
			"with redis-cli; macOS: brew install redis) or run .ci/run, which installs it.", name)
	}
	return path
}
