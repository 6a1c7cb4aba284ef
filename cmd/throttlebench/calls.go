package main

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// callCounter is a go-redis hook that counts the round trips a client makes to Redis: a
// command, or a pipeline, is one. Redis's own count, total_commands_processed, also
// counts the commands that scripts run inside Redis.
type callCounter struct {
	roundTrips atomic.Int64
}

var _ redis.Hook = (*callCounter)(nil)

func (c *callCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *callCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.roundTrips.Add(1)
		return next(ctx, cmd)
	}
}

func (c *callCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.roundTrips.Add(1)
		return next(ctx, cmds)
	}
}

// calls are the round trips made to Redis, by who made them.
type calls struct {
	Throttle int64 `json:"throttle"` // the limiter's client in the workers
	Asynq    int64 `json:"asynq"`    // the workers' asynq client (servers and the middleware's re-enqueues)
	Harness  int64 `json:"harness"`  // the parent: the producer's enqueues, the Inspector, INFO
}

// callsPrefix starts the line a worker writes last, on stdout: "calls " and a JSON calls
// object (Harness zero).
const callsPrefix = "calls "
