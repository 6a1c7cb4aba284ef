package throttle

import (
	"fmt"
	"net/url"
)

// Key names the business context of one event: its task type and its tenant.
// Both are user data; the Redis key encodes them so that no value can forge another
// key (see Limiter.RedisKey).
type Key struct {
	TaskType string // the asynq task type, e.g. "api:call"; must not be empty
	Tenant   string // the tenant the event counts against; "" is a tenant like any other
}

// MaxTenantBytes is the longest Key.Tenant a Request may have: Allow, AllowAt and Cancel
// return ErrInvalid, naming the tenant's length, for a longer one. A tenant is part of
// the key of its window log and of each reservation's lease, and is quoted in errors: a
// megabyte-long tenant would make megabyte-long keys, leases and errors. Tenants are ids
// (an account, an API key's owner), and 1024 bytes leaves room for any of those.
const MaxTenantBytes = 1024

// Scope says which events share a window log.
type Scope uint8

const (
	// ScopeTenant gives each (task type, tenant) pair a window log of its own: a per-tenant quota.
	ScopeTenant Scope = iota + 1
	// ScopeType gives the whole task type one window log, shared by all its tenants.
	ScopeType
)

// String returns "tenant" or "type", the words THROTTLE_RULES uses.
func (s Scope) String() string {
	switch s {
	case ScopeTenant:
		return "tenant"
	case ScopeType:
		return "type"
	}
	return fmt.Sprintf("Scope(%d)", uint8(s))
}

// Quota is one Limit applied at one Scope: "5 per 2s for each tenant" is
// Quota{ScopeTenant, Limit{5, 2 * time.Second}}.
type Quota struct {
	Scope Scope // whose events the quota counts: each tenant's (ScopeTenant) or the task type's (ScopeType)
	Limit Limit // how many events (cost units) per window
}

// String formats q as THROTTLE_RULES writes it: "tenant=5/2s".
func (q Quota) String() string { return q.Scope.String() + "=" + q.Limit.String() }

// Validate returns an error unless the Scope is ScopeTenant or ScopeType and the Limit is
// valid (Limit.Validate).
func (q Quota) Validate() error {
	if q.Scope != ScopeTenant && q.Scope != ScopeType {
		return fmt.Errorf("throttle: quota %s: scope must be ScopeTenant or ScopeType", q)
	}
	return q.Limit.Validate()
}

// DefaultPrefix starts every Redis key of a Limiter whose Config.Prefix is empty.
const DefaultPrefix = "throttle"

// redisKey returns the Redis key of the window log that holds key's events at scope:
//
//	<prefix>:{<task type>}:tenant:<tenant>   ScopeTenant
//	<prefix>:{<task type>}:type              ScopeType
//
// Quotas at one scope with different windows share that log. Task type and tenant are
// escaped with url.PathEscape, which escapes '{', '}', '%', '/', spaces, control bytes and
// non-ASCII, and keeps ':' readable. So the hash tag (the text between the first '{' and
// the next '}', all that Redis Cluster hashes) is exactly the escaped task type: never
// empty, never cut short by a tenant, so every key of a type lands in one slot. The tenant
// is the whole tail after ":tenant:", and escaping is injective, so no (type, tenant) pair
// spells another's key.
//
// Beside each log, two sets put a word of their own after the hash tag, where log keys
// have "tenant:" or "type": pendingKey and costsKey. A task type has three more keys:
// leasesKey, fairQueueKey and fairStateKey.
// Limiter.TryLock's locks put "lock:" there: "<prefix>:{<task type>}:lock:<name>". In
// durable mode a repeated call writes "<prefix>:{<task type>}:ack" (ackKeyWord).
func redisKey(prefix string, key Key, scope Scope) string {
	return keyBase(prefix, key.TaskType) + scopePart(key, scope)
}

// keyBase is "<prefix>:{<escaped task type>}:", the start of every key of the type.
func keyBase(prefix, taskType string) string {
	return prefix + ":{" + url.PathEscape(taskType) + "}:"
}

// pendingKey returns the key of the sorted set of the reservations pending (not yet
// claimed) in the log redisKey(prefix, key, scope), scored by their instants:
//
//	<prefix>:{<task type>}:pending:tenant:<tenant>   ScopeTenant
//	<prefix>:{<task type>}:pending:type              ScopeType
func pendingKey(prefix string, key Key, scope Scope) string {
	return keyBase(prefix, key.TaskType) + "pending:" + scopePart(key, scope)
}

// costsKey returns the key of the sorted set that carries, as running sums, the costs of
// the log's entries of cost > 1: "costs:" after the hash tag, as in pendingKey.
func costsKey(prefix string, key Key, scope Scope) string {
	return keyBase(prefix, key.TaskType) + "costs:" + scopePart(key, scope)
}

// leasesKey returns the key of the hash that records every reservation of a task type
// (its cost, scopes, tenant and holder), so that it can be released by its token alone:
// "<prefix>:{<task type>}:leases".
func leasesKey(prefix, taskType string) string { return keyBase(prefix, taskType) + "leases" }

// fairQueueKey returns the key of the sorted set of the fair tags of the reservations
// pending on a task type's type-wide log: "<prefix>:{<task type>}:fair".
func fairQueueKey(prefix, taskType string) string { return keyBase(prefix, taskType) + "fair" }

// fairStateKey returns the key of the hash with the type-wide log's virtual time and each
// tenant's latest fair tag: "<prefix>:{<task type>}:fairstate".
func fairStateKey(prefix, taskType string) string {
	return keyBase(prefix, taskType) + "fairstate"
}

func scopePart(key Key, scope Scope) string {
	if scope == ScopeType {
		return "type"
	}
	return "tenant:" + url.PathEscape(key.Tenant)
}
