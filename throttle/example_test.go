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
		MaxWait: 50 * time.Millisecond, // a slot this close ahead is taken and waited for
	})
	switch {
	case err != nil:
		log.Fatal(err) // never read an error as an admission
	case d.Allowed:
		time.Sleep(d.Delay) // the slot admitted for: zero, or up to MaxWait ahead
		fmt.Println("run it;", d.Remaining, "left under", d.Quota)
	default:
		fmt.Println("over", d.Quota, "- retry at", d.RetryAt())
	}
}

// ExampleLimiter_Allow_reservation holds a slot for a denied task and claims it when the
// task comes back; Release gives it up if the task goes away. It needs a Redis server, so
// it only compiles.
func ExampleLimiter_Allow_reservation() {
	lim, err := throttle.New(redis.NewClient(&redis.Options{Addr: "localhost:6379"}), throttle.Config{})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	req := throttle.Request{
		Key:         throttle.Key{TaskType: "api:call", Tenant: "acme"},
		Quotas:      []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(5)}},
		Reservation: "task-42",              // the waiting task's id: its slot is kept for it
		ClaimWait:   100 * time.Millisecond, // come back this early and wait the rest
	}
	for {
		d, err := lim.Allow(ctx, req)
		if err != nil {
			log.Fatal(err)
		}
		if d.Allowed {
			time.Sleep(d.Delay)
			fmt.Println("run it")
			return
		}
		if !d.Reserved { // no slot could be held: give up
			if _, err := lim.Release(ctx, req.Key.TaskType, req.Reservation); err != nil {
				log.Print(err)
			}
			return
		}
		time.Sleep(time.Until(d.RetryAt().Add(-req.ClaimWait)))
	}
}
