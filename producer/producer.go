// Package producer tags asynq tasks with the tenant they run for, in the task header
// TenantHeader, which the throttling middleware of package worker reads to pick the
// tenant's quota.
//
// The tenant travels in an asynq header (asynq.NewTaskWithHeaders, asynq v0.26.0), not in
// the payload: it survives retries and re-queues, and handlers keep their own payload
// format. Tasks built here are ordinary *asynq.Task values; enqueue them with any
// *asynq.Client, or with Enqueue.
//
// An Enqueuer does the same with the tenant header of your choice (your workers'
// THROTTLE_TENANT_HEADER) and, optionally, enqueue quotas: it refuses a task past its
// tenant's quota (say 10,000 tasks per day) with a *QuotaError that carries the
// retry-after, which a web handler turns into its own HTTP 429. Its counts are kept by a
// throttle.Limiter under keys of their own, apart from the workers' execution quotas.
package producer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"unicode/utf8"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TenantHeader is the task header that carries the tenant, the default that worker.Config reads.
const TenantHeader = "tenant"

// NewTask returns an asynq task of taskType with payload whose TenantHeader is tenant
// (asynq.NewTaskWithHeaders, which carries headers through retries). opts are as for
// asynq.NewTask: they apply whenever the task is enqueued, before options given to
// Enqueue. The tenant is stored as given; an empty tenant is a present, empty header.
func NewTask(taskType string, payload []byte, tenant string, opts ...asynq.Option) *asynq.Task {
	return asynq.NewTaskWithHeaders(taskType, payload, map[string]string{TenantHeader: tenant}, opts...)
}

// WithTenant returns a copy of task (type, payload, headers) whose TenantHeader is
// tenant; other headers are kept, and task is not modified. The copy shares no memory
// with task.
//
// asynq.Task has no way to read the options it was created with, so the copy does not
// inherit them: opts are the copy's only options. Pass again any options task needs
// (queue, MaxRetry, ...), or give them to the Enqueue call instead.
func WithTenant(task *asynq.Task, tenant string, opts ...asynq.Option) *asynq.Task {
	headers := maps.Clone(task.Headers())
	if headers == nil {
		headers = make(map[string]string, 1)
	}
	headers[TenantHeader] = tenant
	return asynq.NewTaskWithHeaders(task.Type(), bytes.Clone(task.Payload()), headers, opts...)
}

// Tenant returns the task's TenantHeader value and whether the header is present.
// A nil task has no tenant.
func Tenant(task *asynq.Task) (tenant string, ok bool) {
	if task == nil {
		return "", false
	}
	tenant, ok = task.Headers()[TenantHeader]
	return tenant, ok
}

// Enqueue enqueues a task of taskType for tenant with c, as NewTask then
// c.EnqueueContext: opts are the enqueue options (queue, MaxRetry, ProcessIn, ...).
// ctx bounds the enqueue call only, not the task's processing. It first checks the task
// (CheckTask): a tenant or task type that is not valid UTF-8, or a tenant longer than
// throttle.MaxTenantBytes, is an ErrInvalidTask error naming the header, and nothing is
// sent. Otherwise the error wraps asynq's, so errors.Is finds asynq.ErrDuplicateTask and
// asynq.ErrTaskIDConflict.
func Enqueue(ctx context.Context, c *asynq.Client, taskType string, payload []byte, tenant string, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	task := NewTask(taskType, payload, tenant)
	if err := CheckTask(task, TenantHeader); err != nil {
		return nil, err
	}
	info, err := c.EnqueueContext(ctx, task, opts...)
	if err != nil {
		return nil, fmt.Errorf("producer: enqueue %s for tenant %s: %w", quote.Name(taskType), quote.Quote(tenant), err)
	}
	return info, nil
}

// ErrInvalidTask matches, under errors.Is, the error for a task that asynq cannot
// enqueue or that the workers could never decide (see CheckTask).
var ErrInvalidTask = errors.New("producer: invalid task")

// CheckTask returns an ErrInvalidTask error, naming the task type and the header, if task
// cannot be enqueued as it is: its type, a header's name or a header's value is not valid
// UTF-8 (asynq encodes them as protobuf strings, and its own error says only "cannot
// encode message"), or the header tenantHeader holds a tenant longer than
// throttle.MaxTenantBytes (1024), which the workers' limiter refuses: the middleware would
// archive the task. Enqueue and every Enqueuer method that enqueues or checks call it
// first, before any Redis command.
func CheckTask(task *asynq.Task, tenantHeader string) error {
	if !utf8.ValidString(task.Type()) {
		return fmt.Errorf("%w: task type %s is not valid UTF-8, which asynq cannot encode", ErrInvalidTask, quote.Quote(task.Type()))
	}
	for _, name := range slices.Sorted(maps.Keys(task.Headers())) { // the same error for the same task
		value := task.Headers()[name]
		switch {
		case !utf8.ValidString(name):
			return fmt.Errorf("%w: %s: header name %s is not valid UTF-8, which asynq cannot encode",
				ErrInvalidTask, quote.Name(task.Type()), quote.Quote(name))
		case !utf8.ValidString(value):
			return fmt.Errorf("%w: %s: header %s holds %s, which is not valid UTF-8 and which asynq cannot encode",
				ErrInvalidTask, quote.Name(task.Type()), quote.Quote(name), quote.Quote(value))
		case name == tenantHeader && len(value) > throttle.MaxTenantBytes:
			return fmt.Errorf("%w: %s: header %s holds a tenant of %d bytes, more than throttle.MaxTenantBytes (%d): workers would archive the task",
				ErrInvalidTask, quote.Name(task.Type()), quote.Quote(name), len(value), throttle.MaxTenantBytes)
		}
	}
	return nil
}
