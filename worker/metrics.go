package worker

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes counted by Metrics.Decisions, one label value each.
const (
	OutcomeAdmitted    = "admitted"    // the handler ran
	OutcomeDenied      = "denied"      // retried later by asynq, retry budget untouched
	OutcomeWaited      = "waited"      // a short wait sat out in the handler, then decided again
	OutcomeDeferred    = "deferred"    // no retry left: replaced by a copy due later
	OutcomeUnavailable = "unavailable" // the limiter could not decide; the task waits (fail closed)
	OutcomeFailedOpen  = "failed_open" // the limiter could not decide; the task ran (Config.FailOpen)
	OutcomeRejected    = "rejected"    // the task can never fit (bad cost, cost over a limit): archived
	OutcomeOverdue     = "overdue"     // it would wait past Rule.MaxDelay or its deadline: Rule.Overdue applied
)

// Metrics are the middleware's Prometheus metrics. Create them once per registry with
// NewMetrics and share them between middlewares.
type Metrics struct {
	// Decisions counts tasks by task_type and outcome (the Outcome* constants).
	Decisions *prometheus.CounterVec
	// SkewFallbacks counts decisions, by task_type, made by the Redis server's clock
	// because the local clock was further than throttle.Config.MaxSkew from it.
	SkewFallbacks *prometheus.CounterVec
	// ClockSkew is the local clock minus the Redis server's TIME at the last decision, in
	// seconds (it includes part of the round trip).
	ClockSkew prometheus.Gauge
}

// NewMetrics creates the metrics and registers them with reg under the names
// asynq_throttle_decisions_total, asynq_throttle_clock_skew_fallbacks_total and
// asynq_throttle_clock_skew_seconds. It returns reg's error if one is already registered,
// and then leaves none of them registered.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "asynq_throttle_decisions_total",
			Help: "Throttled tasks by task type and outcome: admitted, waited, denied, deferred, unavailable, failed_open, rejected, overdue.",
		}, []string{"task_type", "outcome"}),
		SkewFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "asynq_throttle_clock_skew_fallbacks_total",
			Help: "Decisions made by the Redis server's clock because the worker's clock was off by more than the tolerance.",
		}, []string{"task_type"}),
		ClockSkew: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "asynq_throttle_clock_skew_seconds",
			Help: "The worker's clock minus the Redis server's TIME at the last decision.",
		}),
	}
	collectors := []prometheus.Collector{m.Decisions, m.SkewFallbacks, m.ClockSkew}
	for i, c := range collectors {
		if err := reg.Register(c); err != nil {
			for _, done := range collectors[:i] { // all or nothing, so that a retry can work
				reg.Unregister(done)
			}
			return nil, errors.Join(errors.New("worker: register metrics"), err)
		}
	}
	return m, nil
}

// count adds one decision; m may be nil.
func (m *Metrics) count(taskType, outcome string) {
	if m != nil {
		m.Decisions.WithLabelValues(taskType, outcome).Inc()
	}
}
