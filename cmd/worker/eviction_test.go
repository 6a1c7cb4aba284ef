package main

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
)

// evictionWarningLine matches the line the worker logs to stderr at start on a Redis whose
// maxmemory-policy is allkeys-lru (worker.New's, through a slog text handler).
var evictionWarningLine = regexp.MustCompile(`^time=\S+ level=WARN msg="throttle: Redis maxmemory-policy is not noeviction: ` +
	`a full Redis evicts the limiter's window logs \(volatile-\* policies first, as all of them have a TTL; allkeys-\* asynq's tasks too\), ` +
	`and throttled tasks run over their limits" policy=allkeys-lru maxmemory=0\n$`)

// TestRun_evictionPolicyWarning runs the worker on a redis-server with
// --maxmemory-policy allkeys-lru: at start it logs exactly one line to stderr, the
// warning, and serves asynq_throttle_eviction_policy_unsafe 1; then it runs as usual and
// exits 0. (On noeviction, TestRun_endToEnd and TestRun_metrics see an empty stderr and 0.)
func TestRun_evictionPolicyWarning(t *testing.T) {
	redisSrv := redistest.StartServer(t, "--maxmemory-policy", "allkeys-lru")
	clearEnv(t, "REDIS_ADDR", redisSrv.Addr, "METRICS_ADDR", "127.0.0.1:0")
	w := startWorker(t)
	stdout, stderr := &w.stdout, &w.stderr
	url := w.metricsURL(t)
	waitFor(t, 10*time.Second, "the worker has started", func() bool { return strings.Contains(stdout.String(), " handler sleeps ") })
	if got := scrape(t, url)["asynq_throttle_eviction_policy_unsafe"].GetMetric(); len(got) != 1 || got[0].GetGauge().GetValue() != 1 {
		t.Errorf("asynq_throttle_eviction_policy_unsafe = %v, want one series at 1", got)
	}
	w.stop(t, 15*time.Second)
	if !evictionWarningLine.MatchString(stderr.String()) {
		t.Errorf("stderr:\n%s\nwant exactly one line matching %s", stderr.String(), evictionWarningLine)
	}
}
