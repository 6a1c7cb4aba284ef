package worker

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynq-throttle/asynq-throttle/throttle"
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
	// OutcomeBackpressure: the handler ran and returned a *BackpressureError (the API
	// answered 429 or 503); its quota was paused and the task re-queued for the
	// Retry-After, retry budget untouched (see Backpressure).
	OutcomeBackpressure = "backpressure"
	// OutcomePaused: denied because its quota is paused (throttle.Decision.Paused, after a
	// backpressure here or on another worker, or cmd/throttle pause); re-queued for the
	// pause's end, retry budget untouched, or replaced by a copy if it had no retry left.
	OutcomePaused = "paused"
)

// Limiter calls timed by Metrics.ScriptDuration and counted by Metrics.RedisErrors, one
// value each of their "call" label.
const (
	CallAllow        = "allow"        // throttle.Limiter.Allow: one decision (one script call)
	CallCancel       = "cancel"       // throttle.Limiter.Cancel: an overdue task gives up its reservation
	CallReservations = "reservations" // throttle.Limiter.Reservations, listed at scrape time (RedisErrors only)
	CallPause        = "pause"        // throttle.Limiter.Pause: a handler's BackpressureError pauses a quota
)

// Values of the "result" label of Metrics.OverrideReloads.
const (
	ReloadOK    = "ok"    // the overrides were read and applied
	ReloadError = "error" // they could not be read or were invalid; the last good set stays
)

// OtherTenant is the tenant label value of every tenant past MetricsConfig.MaxTenants.
// A tenant whose name is "other" is counted under the same label.
const OtherTenant = "other"

// Defaults and bounds of MetricsConfig.
const (
	// DefaultMaxTenants is MetricsConfig.MaxTenants when left zero.
	DefaultMaxTenants = 100
	// MaxTenantLabelBytes is the longest tenant label value: a longer tenant is cut to its
	// first MaxTenantLabelBytes bytes (at a character boundary), and bytes that are not
	// UTF-8 become U+FFFD, as Prometheus label values must be UTF-8. Tenants that agree on
	// their first MaxTenantLabelBytes bytes share a label.
	MaxTenantLabelBytes = 64
)

// reservationsTimeout bounds the listing of reservations at each scrape.
const reservationsTimeout = 5 * time.Second

// MetricsConfig configures NewMetricsWithConfig. The zero value is NewMetrics: no tenant
// label.
type MetricsConfig struct {
	// TenantLabel adds a "tenant" label to asynq_throttle_decisions_total (Decisions),
	// after task_type and outcome. Tenants are user data: every distinct label value is a
	// series kept in memory by this process and by Prometheus, so the label is capped by
	// MaxTenants. Defaults to false: decisions are counted by task type and outcome only.
	TenantLabel bool
	// MaxTenants is the most distinct tenant label values: the first MaxTenants tenants
	// this process counts keep their own label for its lifetime, and every later one is
	// counted as OtherTenant ("other"). Defaults to DefaultMaxTenants; ignored without
	// TenantLabel. NewMetricsWithConfig returns an error if it is negative.
	MaxTenants int
}

// Metrics are the middleware's Prometheus metrics. Create them once per registry with
// NewMetrics (or NewMetricsWithConfig) and share them between middlewares: each
// middleware given them in Config.Metrics records into them. Every field is registered by
// NewMetrics under a fixed name, so dashboards can rely on the names before any event.
type Metrics struct {
	// Decisions counts tasks by task_type and outcome (the Outcome* constants), and by
	// tenant with MetricsConfig.TenantLabel: labels (task_type, outcome[, tenant]).
	// asynq_throttle_decisions_total.
	Decisions *prometheus.CounterVec
	// SkewFallbacks counts decisions, by task_type, made by the Redis server's clock
	// because the local clock was further than throttle.Config.MaxSkew from it.
	// asynq_throttle_clock_skew_fallbacks_total.
	SkewFallbacks *prometheus.CounterVec
	// ClockSkew is the local clock minus the Redis server's TIME at the last decision, in
	// seconds (it includes part of the round trip). asynq_throttle_clock_skew_seconds.
	ClockSkew prometheus.Gauge
	// ThrottleDelay is the delay, in seconds, that the throttle gave a task it held back,
	// by task_type and outcome: "waited", the Decision.Delay sat out in the handler;
	// "denied" and "deferred", the Decision.RetryAfter until its slot (its reservation's
	// instant), re-queued meanwhile; "paused", the Decision.RetryAfter until its quota's
	// pause ends; "backpressure", the BackpressureError's RetryAfter.
	// asynq_throttle_delay_seconds, buckets from 5ms to 1h.
	ThrottleDelay *prometheus.HistogramVec
	// ScriptDuration is the time, in seconds, of each limiter call as the worker sees it
	// (the round trip and the script), by task_type and call (CallAllow, CallCancel,
	// CallPause);
	// calls that fail are included. A task whose decision is retried while Redis cannot
	// answer makes one call per attempt. asynq_throttle_script_duration_seconds, buckets
	// from 100us to 2.5s.
	ScriptDuration *prometheus.HistogramVec
	// TasksWaiting is the number of tasks sitting out a Decision.Delay in their handler
	// now, by task_type: each holds a worker slot (asynq.Config.Concurrency) and, with
	// Config.Concurrency set, one of its Concurrency - 1 waiting slots, so the sum over
	// task types never exceeds that. (A task admitted without a waiting slot still sits
	// out the few ms of its clock's skew, uncounted.)
	// asynq_throttle_tasks_waiting.
	TasksWaiting *prometheus.GaugeVec
	// RedisErrors counts limiter calls that failed with a Redis error (unreachable,
	// timed out, or a context that ended), by task_type and call (CallAllow, CallCancel,
	// CallReservations, CallPause). Invalid requests (throttle.ErrInvalid) are not Redis errors.
	// asynq_throttle_redis_errors_total.
	RedisErrors *prometheus.CounterVec
	// PausesActive is the number of pauses (upstream backpressure: a tenant's or a task
	// type's quota paused until an instant) that middlewares using these metrics set
	// (a handler returned a *BackpressureError) and whose end has not passed: one per
	// window log, however often it was paused again. Pauses set by other processes (other
	// workers, cmd/throttle pause) are not counted, and a cmd/throttle resume is not seen:
	// aggregate with sum over workers for the pauses in force, roughly. NewMetrics starts
	// it at 0. asynq_throttle_pauses_active.
	PausesActive prometheus.Gauge
	// OverrideReloads counts the reloads of runtime overrides and tiers, by result
	// (ReloadOK, ReloadError). It is a hook: increment it from Config.OverrideReloadFunc,
	// as cmd/worker does; NewMetrics starts both results at 0.
	// asynq_throttle_override_reloads_total.
	OverrideReloads *prometheus.CounterVec
	// EvictionPolicyUnsafe is 1 once a check at start (New, CheckEvictionPolicy) found a
	// Redis whose maxmemory-policy is not NoEviction, so that a full Redis may evict the
	// limiter's window logs; 0 otherwise, also when the policy could not be read (New
	// logs that). asynq_throttle_eviction_policy_unsafe.
	EvictionPolicyUnsafe prometheus.Gauge

	reservations *reservationsGauge // asynq_throttle_reservations_held, read at scrape time
	tenants      *tenantLabels      // nil without MetricsConfig.TenantLabel
	pauses       *pauseSet          // the pauses behind PausesActive
}

// NewMetrics is NewMetricsWithConfig(reg, MetricsConfig{}): no tenant label.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	return NewMetricsWithConfig(reg, MetricsConfig{})
}

// NewMetricsWithConfig creates the metrics and registers them with reg under the names
// asynq_throttle_decisions_total, asynq_throttle_clock_skew_fallbacks_total,
// asynq_throttle_clock_skew_seconds, asynq_throttle_delay_seconds,
// asynq_throttle_script_duration_seconds, asynq_throttle_tasks_waiting,
// asynq_throttle_redis_errors_total, asynq_throttle_pauses_active,
// asynq_throttle_override_reloads_total, asynq_throttle_eviction_policy_unsafe and
// asynq_throttle_reservations_held.
//
// asynq_throttle_reservations_held{task_type} is read at each scrape: the reservations
// held on the logs of each task type that a middleware using these metrics throttles, as
// throttle.Limiter.Reservations lists them (one HSCAN per 200 reservations, within 5s; a
// lapsed reservation is listed until the next decision on its log removes it). It counts
// every worker's reservations, so every worker reports the same value: aggregate it with
// max, not sum. A task type whose listing fails is left out of that scrape and counted in
// RedisErrors.
//
// It returns an error if reg is nil or cfg.MaxTenants is negative, or reg's error if a metric is already
// registered, and then leaves none of them registered.
func NewMetricsWithConfig(reg prometheus.Registerer, cfg MetricsConfig) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("worker: NewMetrics: a nil prometheus.Registerer")
	}
	if cfg.MaxTenants < 0 {
		return nil, fmt.Errorf("worker: MetricsConfig.MaxTenants %d < 0", cfg.MaxTenants)
	}
	decisionLabels := []string{"task_type", "outcome"}
	m := &Metrics{}
	if cfg.TenantLabel {
		decisionLabels = append(decisionLabels, "tenant")
		m.tenants = &tenantLabels{max: cfg.MaxTenants, seen: map[string]bool{}}
		if m.tenants.max == 0 {
			m.tenants.max = DefaultMaxTenants
		}
	}
	m.Decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "asynq_throttle_decisions_total",
		Help: "Throttled tasks by task type and outcome: admitted, waited, denied, deferred, unavailable, failed_open, rejected, overdue, shadow_denied, backpressure, paused.",
	}, decisionLabels)
	m.SkewFallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "asynq_throttle_clock_skew_fallbacks_total",
		Help: "Decisions made by the Redis server's clock because the worker's clock was off by more than the tolerance.",
	}, []string{"task_type"})
	m.ClockSkew = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "asynq_throttle_clock_skew_seconds",
		Help: "The worker's clock minus the Redis server's TIME at the last decision.",
	})
	m.ThrottleDelay = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "asynq_throttle_delay_seconds",
		Help:    "Delay the throttle gave a task: waited (sat out in the handler), denied or deferred (until its slot, re-queued), paused or backpressure (until the pause ends).",
		Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600},
	}, []string{"task_type", "outcome"})
	m.ScriptDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "asynq_throttle_script_duration_seconds",
		Help:    "Time of each limiter call (allow, cancel, pause) as the worker sees it, round trip included; shadow rules' calls too.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5},
	}, []string{"task_type", "call"})
	m.TasksWaiting = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "asynq_throttle_tasks_waiting",
		Help: "Tasks waiting in their handler for a slot a little ahead, each holding a worker slot.",
	}, []string{"task_type"})
	m.RedisErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "asynq_throttle_redis_errors_total",
		Help: "Limiter calls that failed with a Redis error, by task type and call (allow, cancel, pause, reservations).",
	}, []string{"task_type", "call"})
	m.PausesActive = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "asynq_throttle_pauses_active",
		Help: "Quota pauses (upstream backpressure) that this worker set and whose end has not passed.",
	})
	m.pauses = newPauseSet(m.PausesActive, time.Now)
	m.OverrideReloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "asynq_throttle_override_reloads_total",
		Help: "Reloads of runtime overrides and tiers, by result (ok, error: the last good set stays).",
	}, []string{"result"})
	m.OverrideReloads.WithLabelValues(ReloadOK)    // both series exist from the start,
	m.OverrideReloads.WithLabelValues(ReloadError) // so that rate() and alerts see 0
	m.EvictionPolicyUnsafe = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "asynq_throttle_eviction_policy_unsafe",
		Help: "1 if Redis's maxmemory-policy, read at start, is not noeviction: a full Redis may evict the limiter's window logs.",
	})
	m.reservations = &reservationsGauge{
		desc: prometheus.NewDesc("asynq_throttle_reservations_held",
			"Reservations held on the task type's window logs (all workers'), read at scrape time.",
			[]string{"task_type"}, nil),
		errors: m.RedisErrors,
	}
	// m.RedisErrors is registered through m.reservations, which collects it after its own
	// listing: a scrape whose listing fails reports that failure in the same scrape.
	collectors := []prometheus.Collector{m.Decisions, m.SkewFallbacks, m.ClockSkew, m.ThrottleDelay,
		m.ScriptDuration, m.TasksWaiting, m.PausesActive, m.OverrideReloads, m.EvictionPolicyUnsafe, m.reservations}
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

// count adds one decision for key; m may be nil.
func (m *Metrics) count(key throttle.Key, outcome string) {
	if m == nil {
		return
	}
	if m.tenants == nil {
		m.Decisions.WithLabelValues(key.TaskType, outcome).Inc()
		return
	}
	m.Decisions.WithLabelValues(key.TaskType, outcome, m.tenants.label(key.Tenant)).Inc()
}

// delayed counts one decision for key that held the task back by delay, and observes the
// delay; m may be nil.
func (m *Metrics) delayed(key throttle.Key, outcome string, delay time.Duration) {
	if m == nil {
		return
	}
	m.count(key, outcome)
	m.ThrottleDelay.WithLabelValues(key.TaskType, outcome).Observe(delay.Seconds())
}

// called observes one limiter call of taskType that began at start and returned err;
// m may be nil.
func (m *Metrics) called(taskType, call string, start time.Time, err error) {
	if m == nil {
		return
	}
	m.ScriptDuration.WithLabelValues(taskType, call).Observe(time.Since(start).Seconds())
	if err != nil && !errors.Is(err, throttle.ErrInvalid) {
		m.RedisErrors.WithLabelValues(taskType, call).Inc()
	}
}

// waiting adds delta to the tasks of taskType waiting in their handler; m may be nil.
func (m *Metrics) waiting(taskType string, delta float64) {
	if m != nil {
		m.TasksWaiting.WithLabelValues(taskType).Add(delta)
	}
}

// throttles sets up the series of taskTypes, which a middleware on lim throttles: the
// gauge of tasks waiting and the Redis error counters start at 0, so that dashboards and
// alerts see them before the first event, and, with reservations, makes
// asynq_throttle_reservations_held report those that lim holds for them. m may be nil.
func (m *Metrics) throttles(lim *throttle.Limiter, taskTypes []string, reservations bool) {
	if m == nil {
		return
	}
	for _, tt := range taskTypes {
		m.TasksWaiting.WithLabelValues(tt)
		m.RedisErrors.WithLabelValues(tt, CallAllow)
		m.RedisErrors.WithLabelValues(tt, CallCancel)
		m.RedisErrors.WithLabelValues(tt, CallPause)
		if reservations {
			m.RedisErrors.WithLabelValues(tt, CallReservations)
		}
	}
	if reservations {
		m.reservations.watch(lim, taskTypes)
	}
}

// paused records that key's log (a Redis key) is paused until until; m may be nil.
func (m *Metrics) paused(key string, until time.Time) {
	if m != nil {
		m.pauses.add(key, until)
	}
}

// pauseSet is the set of pauses behind Metrics.PausesActive: the latest end of each
// paused window log. It is safe for concurrent use.
type pauseSet struct {
	gauge prometheus.Gauge
	now   func() time.Time

	mu    sync.Mutex
	until map[string]time.Time // by log key; none whose end has passed after a refresh
}

func newPauseSet(g prometheus.Gauge, now func() time.Time) *pauseSet {
	return &pauseSet{gauge: g, now: now, until: map[string]time.Time{}}
}

// add records a pause of key until until (a later end than one recorded wins, as in the
// limiter), sets the gauge, and arranges a refresh once it ends.
func (p *pauseSet) add(key string, until time.Time) {
	p.mu.Lock()
	if until.After(p.until[key]) {
		p.until[key] = until
	}
	now := p.now()
	p.refreshLocked(now)
	p.mu.Unlock()
	if wait := until.Sub(now); wait > 0 {
		time.AfterFunc(wait+time.Millisecond, p.refresh)
	}
}

// refresh forgets the pauses that have ended and sets the gauge to those left.
func (p *pauseSet) refresh() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refreshLocked(p.now())
}

func (p *pauseSet) refreshLocked(now time.Time) {
	for k, u := range p.until {
		if !u.After(now) {
			delete(p.until, k)
		}
	}
	p.gauge.Set(float64(len(p.until)))
}

// tenantLabels caps the distinct tenant label values. It is safe for concurrent use.
type tenantLabels struct {
	max  int
	mu   sync.Mutex
	seen map[string]bool // label values given out, at most max
}

// label returns tenant's label value: tenant made valid UTF-8 and cut to
// MaxTenantLabelBytes, or OtherTenant once max other values were given out.
func (t *tenantLabels) label(tenant string) string {
	v := tenantLabelValue(tenant)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.seen[v] {
		return v
	}
	if len(t.seen) >= t.max {
		return OtherTenant
	}
	t.seen[v] = true
	return v
}

// tenantLabelValue is tenant as a Prometheus label value: invalid UTF-8 replaced by
// U+FFFD, then cut to at most MaxTenantLabelBytes bytes without splitting a character.
func tenantLabelValue(tenant string) string {
	v := strings.ToValidUTF8(tenant, "\uFFFD")
	if len(v) <= MaxTenantLabelBytes {
		return v
	}
	cut := MaxTenantLabelBytes
	for cut > 0 && !utf8.RuneStart(v[cut]) {
		cut--
	}
	return v[:cut]
}

// reservationsGauge is the collector of asynq_throttle_reservations_held: at each
// scrape it counts the reservations of every (limiter, task type) it watches. It also
// collects asynq_throttle_redis_errors_total (errors), after the listing, so that a
// scrape counts its own failed listings: registered apart, the counter could be collected
// (in a goroutine of its own) before the listing failed, and lag a scrape behind.
type reservationsGauge struct {
	desc   *prometheus.Desc
	errors *prometheus.CounterVec // Metrics.RedisErrors

	mu      sync.Mutex
	sources []reservationSource // no duplicates
}

type reservationSource struct {
	lim      *throttle.Limiter
	taskType string
}

func (g *reservationsGauge) watch(lim *throttle.Limiter, taskTypes []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, tt := range taskTypes {
		s := reservationSource{lim: lim, taskType: tt}
		found := false
		for _, have := range g.sources {
			found = found || have == s
		}
		if !found {
			g.sources = append(g.sources, s)
		}
	}
}

// Describe implements prometheus.Collector: the gauge's and the Redis errors' descriptions.
func (g *reservationsGauge) Describe(ch chan<- *prometheus.Desc) {
	ch <- g.desc
	g.errors.Describe(ch)
}

// Collect implements prometheus.Collector: one gauge per task type, the sum over the
// limiters that throttle it; a task type whose listing failed is left out, and counted
// in the Redis errors, which it then collects.
func (g *reservationsGauge) Collect(ch chan<- prometheus.Metric) {
	g.mu.Lock()
	sources := append([]reservationSource(nil), g.sources...)
	g.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), reservationsTimeout)
	defer cancel()
	held, failed := map[string]int{}, map[string]bool{}
	for _, s := range sources {
		n := 0
		err := s.lim.Reservations(ctx, s.taskType, func(throttle.Reservation) bool { n++; return true })
		if err != nil {
			g.errors.WithLabelValues(s.taskType, CallReservations).Inc()
			failed[s.taskType] = true
			continue
		}
		held[s.taskType] += n
	}
	g.errors.Collect(ch) // with this scrape's failures
	types := make([]string, 0, len(held))
	for tt := range held {
		if !failed[tt] {
			types = append(types, tt)
		}
	}
	sort.Strings(types)
	for _, tt := range types {
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, float64(held[tt]), tt)
	}
}
