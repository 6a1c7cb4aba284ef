package worker_test

import (
	"context"
	"log"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// The server side: an asynq server whose tasks of type api:call run at most 5 per 2s per
// tenant and 20 per second in all, and email:send 100 per hour per tenant.
func Example() {
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"127.0.0.1:6379"}})
	defer rdb.Close()

	lim, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		log.Fatal(err)
	}
	rules, err := worker.ParseRules("api:call tenant=5/2s type=20/1s; email:send tenant=100/1h")
	if err != nil {
		log.Fatal(err)
	}
	// Concurrency: the asynq server's, below: at most 19 handlers wait for a slot ahead,
	// and a backlog's reservations are spread so that they can.
	mw, err := worker.New(lim, worker.Config{Rules: rules, Redis: rdb, Concurrency: 20})
	if err != nil {
		log.Fatal(err)
	}

	mux := asynq.NewServeMux()
	mux.Use(mw)
	mux.HandleFunc("api:call", func(ctx context.Context, task *asynq.Task) error {
		tenant, _ := producer.Tenant(task)
		log.Printf("calling the API for tenant %q with %s", tenant, task.Payload())
		return nil
	})

	// WrapConfig: a throttled task is not a failure, spends no retry, comes back on time.
	srv := asynq.NewServerFromRedisClient(rdb, worker.WrapConfig(asynq.Config{Concurrency: 20}))
	// Run blocks until SIGINT or SIGTERM, then waits for the running tasks up to
	// ShutdownTimeout (asynq's default: 8s) and puts those still running back in their queue.
	if err := srv.Run(mux); err != nil {
		log.Fatal(err)
	}
}
