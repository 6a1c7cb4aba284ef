package throttle_test

import (
	"context"
	"runtime"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// benchCallers is about how many goroutines call Redis at once in the benchmark.
const benchCallers = 32

// BenchmarkLimiter_Allow measures, in one run against one server and one client, the rate
// of Limiter.Allow decisions and of plain PINGs at the same parallelism, and reports
// allow/ping: the share of a bare round trip's throughput that a decision keeps. op=ping
// runs first and every allow sub-benchmark compares itself with it. The limit is huge so
// that every call is an admission, which writes.
func BenchmarkLimiter_Allow(b *testing.B) {
	srv := redistest.StartServer(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 2 * benchCallers})
	b.Cleanup(func() { _ = rdb.Close() })
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	parallelism := (benchCallers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0)

	var pingPerSec float64 // from op=ping's last (largest) run
	b.Run("op=ping", func(b *testing.B) {
		b.SetParallelism(parallelism)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := rdb.Ping(ctx).Err(); err != nil {
					b.Error(err)
					return
				}
			}
		})
		pingPerSec = float64(b.N) / b.Elapsed().Seconds()
		b.ReportMetric(pingPerSec, "ops/s")
	})
	b.Run("op=allow", func(b *testing.B) {
		for _, tenants := range []int{1, 1000} {
			b.Run("tenants="+strconv.Itoa(tenants), func(b *testing.B) {
				quotas := []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.PerSecond(1 << 30)}}
				b.SetParallelism(parallelism)
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for i := 0; pb.Next(); i++ {
						req := throttle.Request{Key: throttle.Key{TaskType: "bench", Tenant: strconv.Itoa(i % tenants)}, Quotas: quotas}
						d, err := l.Allow(ctx, req)
						if err != nil || !d.Allowed {
							b.Errorf("Allow = %+v, %v; want an admission", d, err)
							return
						}
					}
				})
				perSec := float64(b.N) / b.Elapsed().Seconds()
				b.ReportMetric(perSec, "decisions/s")
				if pingPerSec > 0 {
					b.ReportMetric(perSec/pingPerSec, "allow/ping")
				}
			})
		}
	})
}
