package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisServer is a redis-server process this command started on a loopback port.
type redisServer struct {
	addr   string
	cmd    *exec.Cmd
	exited chan struct{}
}

// startRedis runs `redis-server --port <free port> --bind 127.0.0.1 --save "" --appendonly
// no` and waits until it answers PING (at most 10s). The caller stops it.
func startRedis(ctx context.Context) (*redisServer, error) {
	path, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not on PATH (install it, e.g. apt-get install redis-server or brew install redis, or pass -redis-addr): %w", err)
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ { // another process may take the free port first
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		s := &redisServer{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), exited: make(chan struct{})}
		s.cmd = exec.Command(path, "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no")
		if err := s.cmd.Start(); err != nil {
			return nil, fmt.Errorf("start redis-server: %w", err)
		}
		go func() { _ = s.cmd.Wait(); close(s.exited) }()
		if lastErr = s.waitForPong(ctx); lastErr == nil {
			return s, nil
		}
		s.stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
	return nil, fmt.Errorf("redis-server did not start: %w", lastErr)
}

func (s *redisServer) waitForPong(ctx context.Context) error {
	rdb := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := rdb.Ping(pctx).Err()
		cancel()
		select {
		case <-s.exited:
			return fmt.Errorf("redis-server on %s exited before answering PING (port taken?)", s.addr)
		default:
		}
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case time.Now().After(deadline):
			return fmt.Errorf("redis-server on %s did not answer PING within 10s: %w", s.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop kills the server and waits for it to exit.
func (s *redisServer) stop() {
	_ = s.cmd.Process.Kill()
	<-s.exited
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// redisCounters are the server-wide counters read from INFO.
type redisCounters struct {
	Commands int64         // total_commands_processed
	CPU      time.Duration // used_cpu_user + used_cpu_sys
}

// readRedisCounters reads INFO stats and cpu.
func readRedisCounters(ctx context.Context, rdb redis.UniversalClient) (redisCounters, error) {
	text, err := rdb.Info(ctx, "stats", "cpu").Result()
	if err != nil {
		return redisCounters{}, fmt.Errorf("redis INFO: %w", err)
	}
	var c redisCounters
	var found int
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		if !ok {
			continue
		}
		switch k {
		case "total_commands_processed":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return redisCounters{}, fmt.Errorf("redis INFO %s=%q: %w", k, v, err)
			}
			c.Commands = n
			found++
		case "used_cpu_user", "used_cpu_sys":
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return redisCounters{}, fmt.Errorf("redis INFO %s=%q: %w", k, v, err)
			}
			c.CPU += time.Duration(f * float64(time.Second))
			found++
		}
	}
	if found != 3 {
		return redisCounters{}, fmt.Errorf("redis INFO stats cpu: want total_commands_processed, used_cpu_user and used_cpu_sys in %q", text)
	}
	return c, nil
}
