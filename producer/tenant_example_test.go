package producer_test

import (
	"context"
	"fmt"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
)

func ExampleNewTask() {
	task := producer.NewTask("email:send", []byte(`{"to":"ops@acme.example"}`), "acme", asynq.MaxRetry(5))
	fmt.Println(task.Type(), task.Headers()[producer.TenantHeader])
	tenant, ok := producer.Tenant(task)
	fmt.Println(tenant, ok)
	// Output:
	// email:send acme
	// acme true
}

func ExampleWithTenant() {
	task := asynq.NewTaskWithHeaders("email:send", nil, map[string]string{"trace": "t1"})
	tagged := producer.WithTenant(task, "globex")
	fmt.Println(tagged.Headers())
	_, ok := producer.Tenant(task)
	fmt.Println("original tagged:", ok)
	// Output:
	// map[tenant:globex trace:t1]
	// original tagged: false
}

// Enqueue needs a Redis server, so this example only compiles.
func ExampleEnqueue() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)
	info, err := producer.Enqueue(context.Background(), client, "api:call", []byte(`{}`), "acme",
		asynq.Queue("critical"))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("enqueued", info.ID)
}
