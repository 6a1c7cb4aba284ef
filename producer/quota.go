package producer

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// EnqueuerConfig configures NewEnqueuer. The zero value tags tasks with TenantHeader and
// checks no quota.
type EnqueuerConfig struct {
	// TenantHeader is the task header that names the tenant: the header tasks are tagged
	// with, and read by Check. Defaults to TenantHeader ("tenant"). Set it to your
	// workers' worker.Config.TenantHeader (THROTTLE_TENANT_HEADER).
	TenantHeader string
	// Quotas are the enqueue quotas, by task type: each enqueue of a task of that type must
	// fit every one of them, ScopeTenant quotas counted per (task type, tenant), ScopeType
	// quotas per task type, all tenants together. "10,000 tasks per day per tenant" is
	// {Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 10000, Window: 24 * time.Hour}}.
	// The window slides: a day is any 24h, not a calendar day. Task types without an entry
	// are enqueued without a check. See ParseQuotas for the text form.
	Quotas map[string][]throttle.Quota
	// Redis is where the quotas' window logs live; it may be asynq's Redis. Required when
	// Quotas is not empty.
	Redis redis.UniversalClient
	// Prefix is the key prefix of the workers' limiter (throttle.Config.Prefix,
	// THROTTLE_PREFIX). Defaults to throttle.DefaultPrefix. Enqueue quotas live under
	// Prefix + EnqueueKeyInfix, never under Prefix itself; see Enqueuer.RedisKey.
	Prefix string
	// NowFunc, if set, is the clock of every check: each is decided at NowFunc() with
	// throttle.Limiter.AllowAt, which trusts the time it is given (no skew check against
	// Redis). Tests pass explicit times with it. Defaults to nil: throttle.Limiter.Allow
	// on the local clock, which falls back to the Redis server's TIME when the local
	// clock is more than throttle.DefaultMaxSkew away from it.
	NowFunc func() time.Time
}

// EnqueueKeyInfix follows the workers' prefix in the key prefix of every enqueue quota:
// "throttle" + ":enqueue". A worker's keys continue "<prefix>:{", never
// "<prefix>:enqueue:", so enqueue quotas and execution quotas with the same prefix never
// share a key, even for the same task type, tenant and window; and no worker prefix ends
// in ":enqueue" (CheckPrefix), so neither do those of two different prefixes.
const EnqueueKeyInfix = ":enqueue"

// CheckPrefix returns an error if prefix cannot be the key prefix of the workers'
// limiter (throttle.Config.Prefix, THROTTLE_PREFIX) without letting their execution
// quotas share keys with enqueue quotas: if its last ':'-separated segment is "enqueue"
// (EnqueueKeyInfix), as in "throttle:enqueue", a worker's keys under it,
// "throttle:enqueue:{<task type>}:...", are those of the enqueue quotas of the prefix
// "throttle". NewEnqueuer refuses such a Prefix, worker.NewOverrideStore such a prefix,
// and cmd/worker and cmd/enqueue such a THROTTLE_PREFIX.
func CheckPrefix(prefix string) error {
	if prefix == EnqueueKeyInfix[1:] || strings.HasSuffix(prefix, EnqueueKeyInfix) {
		return fmt.Errorf("producer: prefix %s: its last ':'-separated segment is %q, which enqueue quotas put after the workers' prefix "+
			"(\"<prefix>%s:{<task type>}:...\"): a worker's keys under it would be enqueue quotas' keys; choose another",
			quote.Quote(prefix), EnqueueKeyInfix[1:], EnqueueKeyInfix)
	}
	return nil
}

// Enqueuer enqueues asynq tasks tagged with their tenant and, for task types with enqueue
// quotas, refuses a task past its tenant's quota with a *QuotaError. It is safe for
// concurrent use by multiple goroutines.
//
// Enqueue quotas count what producers submit, not what workers run: a web handler turns a
// refusal into its own HTTP 429, so a tenant cannot queue a day's backlog in a minute. They
// are decided by a throttle.Limiter exactly as execution quotas are (a sliding window log
// per key, one atomic script call per check, all quotas of a task or none), under their
// own keys (EnqueueKeyInfix).
type Enqueuer struct {
	client *asynq.Client
	header string
	quotas map[string][]throttle.Quota
	lim    *throttle.Limiter // nil without quotas
	now    func() time.Time
}

// NewEnqueuer returns an Enqueuer that enqueues with client. It returns an error if client
// is nil; if a quota's task type is empty, its list empty, a quota invalid
// (throttle.Quota.Validate) or two quotas of a type have the same scope and window (the
// larger would never decide anything); if Quotas is not empty and Redis is nil; or if
// Prefix contains '{' or '}', or cannot be a workers' prefix (CheckPrefix).
func NewEnqueuer(client *asynq.Client, cfg EnqueuerConfig) (*Enqueuer, error) {
	if client == nil {
		return nil, errors.New("producer: NewEnqueuer: nil asynq.Client")
	}
	if err := CheckPrefix(cfg.Prefix); err != nil {
		return nil, fmt.Errorf("producer: NewEnqueuer: EnqueuerConfig.Prefix: %w", err)
	}
	e := &Enqueuer{client: client, header: cfg.TenantHeader, quotas: make(map[string][]throttle.Quota, len(cfg.Quotas)), now: cfg.NowFunc}
	if e.header == "" {
		e.header = TenantHeader
	}
	for taskType, qs := range cfg.Quotas {
		if err := checkQuotas(taskType, qs); err != nil {
			return nil, err
		}
		e.quotas[taskType] = append([]throttle.Quota(nil), qs...)
	}
	if len(e.quotas) == 0 {
		return e, nil
	}
	if cfg.Redis == nil {
		return nil, errors.New("producer: NewEnqueuer: EnqueuerConfig.Redis is nil; enqueue quotas need a Redis")
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = throttle.DefaultPrefix
	}
	lim, err := throttle.New(cfg.Redis, throttle.Config{Prefix: prefix + EnqueueKeyInfix})
	if err != nil {
		return nil, fmt.Errorf("producer: NewEnqueuer: %w", err)
	}
	e.lim = lim
	return e, nil
}

// checkQuotas validates the enqueue quotas of one task type.
func checkQuotas(taskType string, qs []throttle.Quota) error {
	if taskType == "" {
		return errors.New("producer: enqueue quotas for an empty task type")
	}
	if len(qs) == 0 {
		return fmt.Errorf("producer: task type %q: empty list of enqueue quotas", taskType)
	}
	for i, q := range qs {
		if err := q.Validate(); err != nil {
			return fmt.Errorf("producer: task type %q: enqueue quota %d: %w", taskType, i+1, err)
		}
		for _, p := range qs[:i] {
			if p.Scope == q.Scope && p.Limit.Window == q.Limit.Window {
				return fmt.Errorf("producer: task type %q: enqueue quotas %s and %s have the same scope and window; keep one", taskType, p, q)
			}
		}
	}
	return nil
}

// TenantHeader returns the task header the Enqueuer tags tasks with and reads tenants from.
func (e *Enqueuer) TenantHeader() string { return e.header }

// Quotas returns a copy of the enqueue quotas of taskType, nil if it has none.
func (e *Enqueuer) Quotas(taskType string) []throttle.Quota {
	return append([]throttle.Quota(nil), e.quotas[taskType]...)
}

// NewTask returns a task of taskType with payload whose TenantHeader() is tenant, as the
// package function NewTask does with TenantHeader.
func (e *Enqueuer) NewTask(taskType string, payload []byte, tenant string, opts ...asynq.Option) *asynq.Task {
	return asynq.NewTaskWithHeaders(taskType, payload, map[string]string{e.header: tenant}, opts...)
}

// Enqueue checks a task of taskType for tenant against its enqueue quotas (Check) and, if
// it fits, enqueues it: NewTask then EnqueueTask. opts are asynq's enqueue options.
// Errors are as for EnqueueTask.
func (e *Enqueuer) Enqueue(ctx context.Context, taskType string, payload []byte, tenant string, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	return e.EnqueueTask(ctx, e.NewTask(taskType, payload, tenant), opts...)
}

// EnqueueTask checks task (CheckTask) and against its type's enqueue quotas (Check) and,
// if it fits, enqueues it with the asynq client, with opts. A refusal is a *QuotaError
// (errors.Is ErrQuotaExceeded), and nothing is enqueued; a task that CheckTask refuses is
// an ErrInvalidTask error. Any other error of Check is returned
// (nothing enqueued: it fails closed), and so is asynq's, wrapped so that errors.Is finds
// asynq.ErrDuplicateTask and asynq.ErrTaskIDConflict.
//
// A task that passed the check keeps its slot even if asynq then fails to enqueue it:
// the limiter cannot take an admission back. Give the task an asynq.TaskID in opts to
// retry such an enqueue: the check of the same task id is a replay, not a second slot.
func (e *Enqueuer) EnqueueTask(ctx context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	if err := e.Check(ctx, task, opts...); err != nil {
		return nil, err
	}
	tenant := task.Headers()[e.header]
	info, err := e.client.EnqueueContext(ctx, task, opts...)
	if err != nil {
		return nil, fmt.Errorf("producer: enqueue %s for tenant %s: %w", quote.Name(task.Type()), quote.Quote(tenant), err)
	}
	return info, nil
}

// Check takes one slot of every enqueue quota of task's type for the tenant in its
// TenantHeader() (a task without the header counts against the tenant "", as workers
// count it), or none if one of them is full: then it returns a *QuotaError saying which
// quota and until when. It returns nil at once for a task type without quotas. Use it to
// enqueue by other means than EnqueueTask, just before the enqueue.
//
// If opts hold an asynq.TaskID, the check is made under that id (hashed): checking the
// same id again within the window replays the first admission and takes no second
// slot. A TaskID given to asynq.NewTask rather than in opts cannot be read from the task.
//
// Other errors: a nil task; an ErrInvalidTask error (CheckTask with TenantHeader()),
// before any Redis command, whether or not the task type has quotas, so that no slot is
// taken by a task asynq would then refuse; or a Redis error (wrapped), never to be read as
// an admission.
func (e *Enqueuer) Check(ctx context.Context, task *asynq.Task, opts ...asynq.Option) error {
	if task == nil {
		return errors.New("producer: enqueue a nil task")
	}
	if err := CheckTask(task, e.header); err != nil {
		return err
	}
	qs := e.quotas[task.Type()]
	if len(qs) == 0 {
		return nil
	}
	key := throttle.Key{TaskType: task.Type(), Tenant: task.Headers()[e.header]}
	req := throttle.Request{Key: key, Quotas: qs, Member: memberOf(opts)}
	var d throttle.Decision
	var err error
	if e.now != nil {
		d, err = e.lim.AllowAt(ctx, req, e.now())
	} else {
		d, err = e.lim.Allow(ctx, req)
	}
	if err != nil {
		return fmt.Errorf("producer: enqueue quota of %s for tenant %s: %w", quote.Name(key.TaskType), quote.Quote(key.Tenant), err)
	}
	if d.Allowed {
		return nil
	}
	return &QuotaError{TaskType: key.TaskType, Tenant: key.Tenant, Quota: d.Quota, RetryAfter: d.RetryAfter, RetryAt: d.RetryAt()}
}

// RedisKey returns the Redis key of the window log that counts the enqueues of taskType
// for tenant at scope: "<prefix>:enqueue:{<task type>}:tenant:<tenant>" for ScopeTenant,
// "<prefix>:enqueue:{<task type>}:type" for ScopeType, both parts escaped as in
// throttle.Limiter.RedisKey. It returns "" for an Enqueuer without quotas.
func (e *Enqueuer) RedisKey(taskType, tenant string, scope throttle.Scope) string {
	if e.lim == nil {
		return ""
	}
	return e.lim.RedisKey(throttle.Key{TaskType: taskType, Tenant: tenant}, scope)
}

// memberOf returns the limiter event id for an enqueue with opts: derived from the last
// asynq.TaskID among them (asynq applies the last), or "" (a fresh id) without one. The
// id is hashed, so any task id fits the limiter's member rules, and prefixed with "t",
// which throttle.NewMember's base64url ids of 16 characters cannot clash with (ours are 25).
func memberOf(opts []asynq.Option) string {
	id := ""
	for _, o := range opts {
		if o != nil && o.Type() == asynq.TaskIDOpt {
			id, _ = o.Value().(string)
		}
	}
	if id == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(id))
	return "t" + base64.RawURLEncoding.EncodeToString(sum[:18])
}

// ErrQuotaExceeded matches every *QuotaError under errors.Is.
var ErrQuotaExceeded = errors.New("producer: enqueue quota exceeded")

// QuotaError reports that a task was not enqueued because its tenant (or its task type,
// for a ScopeType quota) is over an enqueue quota. Read it with errors.As; a web handler
// answers 429 with the header Retry-After: RetryAfterSeconds().
type QuotaError struct {
	TaskType string         // the refused task's type
	Tenant   string         // and its tenant (its TenantHeader's value)
	Quota    throttle.Quota // the quota with no room that holds it back longest (throttle.Decision.Quota)
	// RetryAfter is how long after the check, at least 1ms, every quota of the task will
	// have room again if nothing else is enqueued meanwhile: for a full ScopeTenant quota
	// of 10,000 per 24h, until the oldest of its 10,000 enqueues is 24h old.
	RetryAfter time.Duration
	// RetryAt is the check's instant (NowFunc's, or the local clock's) plus RetryAfter.
	RetryAt time.Time
}

// Error names the task type, the tenant, the quota and the wait.
func (e *QuotaError) Error() string {
	return fmt.Sprintf("producer: %s for tenant %s over enqueue quota %s, retry after %s",
		quote.Name(e.TaskType), quote.Quote(e.Tenant), e.Quota, e.RetryAfter)
}

// Is reports whether target is ErrQuotaExceeded.
func (e *QuotaError) Is(target error) bool { return target == ErrQuotaExceeded }

// RetryAfterSeconds is RetryAfter in whole seconds, rounded up (at least 1): the value of
// an HTTP Retry-After header (RFC 9110, section 10.2.3), which counts whole seconds. A
// client that waits that long is not refused again for the same quota unless others
// enqueued meanwhile.
func (e *QuotaError) RetryAfterSeconds() int64 {
	return max(int64((e.RetryAfter+time.Second-1)/time.Second), 1)
}

// ParseQuotas reads enqueue quotas written as THROTTLE_RULES writes a rule's quotas,
// without its task type: "scope=events/window" items separated by spaces, scope "tenant"
// (each tenant's own count) or "type" (all tenants of the task type together), window a
// Go duration of at least 1ms. "tenant=10000/24h" is 10,000 tasks per tenant in any 24h;
// "tenant=100/1m tenant=10000/24h type=1000000/24h" combines three. The error quotes s
// and names the wrong item: not scope=events/window, an unknown scope, a limit that
// throttle.ParseLimit rejects, two quotas with the same scope and window, or no quota.
func ParseQuotas(s string) ([]throttle.Quota, error) {
	var qs []throttle.Quota
	for _, f := range strings.Fields(s) {
		scope, limit, ok := strings.Cut(f, "=")
		if !ok && strings.Contains(f, ":") && !strings.Contains(f, "/") { // "api:call tenant=5/1s": a rule's task type, not "tenant:5/1s"
			return nil, fmt.Errorf("producer: quotas %q: %q: want scope=events/window; quotas name no task type "+
				"(the enqueuer applies them to the task type they are given for), e.g. tenant=10000/24h", s, f)
		}
		if !ok || scope == "" || limit == "" { // "tenant = 5/1s" splits into three fields
			return nil, fmt.Errorf("producer: quotas %q: %q: want scope=events/window, with no space around '=', e.g. tenant=10000/24h", s, f)
		}
		q := throttle.Quota{Scope: throttle.ScopeTenant}
		switch scope {
		case "tenant":
		case "type":
			q.Scope = throttle.ScopeType
		default:
			return nil, fmt.Errorf("producer: quotas %q: %q: unknown scope %q; want tenant or type", s, f, scope)
		}
		l, err := throttle.ParseLimit(limit)
		if err != nil {
			return nil, fmt.Errorf("producer: quotas %q: %q: %w", s, f, err)
		}
		q.Limit = l
		for _, p := range qs {
			if p.Scope == q.Scope && p.Limit.Window == q.Limit.Window {
				return nil, fmt.Errorf("producer: quotas %q: %s and %s have the same scope and window; keep one", s, p, q)
			}
		}
		qs = append(qs, q)
	}
	if len(qs) == 0 {
		return nil, fmt.Errorf("producer: quotas %q: no quota; want e.g. tenant=10000/24h", s)
	}
	return qs, nil
}
