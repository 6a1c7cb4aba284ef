package producer_test

import (
	"context"
	"log"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
)

// The enqueue side, in your web server or job scheduler: each task carries its tenant in
// a header (producer.TenantHeader) that survives retries, where the workers read it.
func Example() {
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"127.0.0.1:6379"}})
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)

	payload := []byte(`{"url":"https://api.example.com/v1/orders/42"}`)
	info, err := producer.Enqueue(context.Background(), client, "api:call", payload, "acme", asynq.MaxRetry(10))
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("enqueued task %s for tenant acme", info.ID)
}
