package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func ExampleDeniedError() {
	err := fmt.Errorf("process task: %w", &throttle.DeniedError{
		Key:        throttle.Key{TaskType: "email:send", Tenant: "acme"},
		Quota:      throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.PerMinute(100)},
		RetryAfter: 1500 * time.Millisecond,
	})
	var denied *throttle.DeniedError
	if errors.As(err, &denied) {
		fmt.Println("retry in", denied.RetryAfter, errors.Is(err, throttle.ErrDenied))
	}
	fmt.Println(err)
	// Output:
	// retry in 1.5s true
	// process task: throttle: email:send for tenant "acme" over tenant=100/1m, retry after 1.5s
}

func ExampleParseLimit() {
	for _, s := range []string{"5/2s", "100/1h", "10/1m30s", "0/1s", "5/2"} {
		l, err := throttle.ParseLimit(s)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(l, l.Events, l.Window)
	}
	// Output:
	// 5/2s 5 2s
	// 100/1h 100 1h0m0s
	// 10/1m30s 10 1m30s
	// throttle: limit "0/1s": events must be at least 1, got 0
	// throttle: limit "5/2": window "2" is not a Go duration such as 2s, 1m or 1h
}

// ExampleLimiter_Allow decides one task against a per-tenant and a type-wide quota at once.
// It needs a Redis server, so it only compiles.
func ExampleLimiter_Allow() {
	lim, err := throttle.New(redis.NewClient(&redis.Options{Addr: "localhost:6379"}), throttle.Config{})
	if err != nil {
		log.Fatal(err)
	}
	d, err := lim.Allow(context.Background(), throttle.Request{
		Key: throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quotas: []throttle.Quota{
			{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)},
			{Scope: throttle.ScopeType, Limit: throttle.PerMinute(100)},
		},
	})
	switch {
	case err != nil:
		log.Fatal(err) // never read an error as an admission
	case d.Allowed:
		fmt.Println("run it;", d.Remaining, "left under", d.Quota)
	default:
		fmt.Println("over", d.Quota, "- retry at", d.RetryAt())
	}
}
