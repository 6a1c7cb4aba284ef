package worker_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// clusterLogger is an asynq.Logger that keeps what asynq logs at Error and Fatal level:
// a command asynq cannot run on a cluster (CROSSSLOT, a script touching keys of other
// slots) shows there even when tasks still get through.
type clusterLogger struct {
	mu     sync.Mutex
	errors []string
}

func (l *clusterLogger) Debug(...any) {}
func (l *clusterLogger) Info(...any)  {}
func (l *clusterLogger) Warn(...any)  {}
func (l *clusterLogger) Error(args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, fmt.Sprint(args...))
}
func (l *clusterLogger) Fatal(args ...any) { l.Error(args...) }

func (l *clusterLogger) logged() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errors...)
}

var _ asynq.Logger = (*clusterLogger)(nil)

// clusterPayload is the payload of TestEndToEndCluster's tasks.
type clusterPayload struct {
	Tenant string `json:"tenant"`
	Seq    int    `json:"seq"`
}

// TestEndToEndCluster runs the whole path on a 3-master Redis Cluster through one
// redis.ClusterClient shared by asynq's server (NewServerFromRedisClient), client and
// inspector, the limiter and the middleware: rule "e2e:cluster tenant=3/1s", 2 tenants x 9
// tasks, with reservations. The ninth task of each tenant has
// MaxRetry(0) and is enqueued once its tenant's first 3 ran, so it is denied and replaced
// by a copy. Every task completes exactly once, none is archived, no retry is spent,
// each tenant has exactly 3 admissions in its busiest 1s window, and asynq logs no error.
func TestEndToEndCluster(t *testing.T) {
	t.Parallel()
	endToEndHA(t, redistest.StartCluster(t, 3).Client(), "e2e:cluster")
}
