package producer_test

import (
	"errors"
	"io"
	"log"
	"net/http"
	"strconv"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// reportHandler enqueues a report:build task for the tenant of the request (here the
// X-Tenant header; in your code, whoever authenticated): 202 Accepted, or 429 Too Many
// Requests with Retry-After once the tenant is past its enqueue quota.
func reportHandler(enq *producer.Enqueuer) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			http.Error(w, "cannot read the request", http.StatusBadRequest)
			return
		}
		_, err = enq.Enqueue(r.Context(), "report:build", body, r.Header.Get("X-Tenant"))
		var quota *producer.QuotaError
		switch {
		case errors.As(err, &quota):
			w.Header().Set("Retry-After", strconv.FormatInt(quota.RetryAfterSeconds(), 10))
			http.Error(w, quota.Error(), http.StatusTooManyRequests)
		case err != nil:
			log.Print(err)
			http.Error(w, "cannot enqueue now", http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusAccepted)
		}
	}
}

// At most 10,000 report:build tasks per tenant in any 24 hours.
func ExampleEnqueuer() {
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"127.0.0.1:6379"}})
	defer rdb.Close()
	enq, err := producer.NewEnqueuer(asynq.NewClientFromRedisClient(rdb), producer.EnqueuerConfig{
		Quotas: map[string][]throttle.Quota{
			"report:build": {{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 10000, Window: 24 * time.Hour}}},
		},
		Redis: rdb, // its keys start "throttle:enqueue:", apart from the workers' "throttle:{"
	})
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("POST /reports", reportHandler(enq))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", nil))
}
