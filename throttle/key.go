package throttle

import (
	"fmt"
	"hash/fnv"
	"net/url"
	"strconv"
)

// Key names the business context of one event: its task type and its tenant.
// Both are user data; the Redis key encodes them so that no value can forge another
// key (see Limiter.RedisKey).
type Key struct {
	TaskType string // the asynq task type, e.g. "api:call"; must not be empty
	Tenant   string // the tenant the event counts against; "" is a tenant like any other
}

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
	Scope Scope
	Limit Limit
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
// empty, never cut short by a tenant, so every log of a type lands in one slot. The tenant
// is the whole tail after ":tenant:", and escaping is injective, so no (type, tenant) pair
// spells another's key.
//
// The reservations held in a log (see Request.Reservation) are mirrored in a second set,
// reservationKey, whose name puts "reserved:" after the hash tag: no log key has it there.
func redisKey(prefix string, key Key, scope Scope) string {
	return prefix + ":{" + url.PathEscape(key.TaskType) + "}:" + scopePart(key, scope)
}

// reservationKey returns the Redis key of the set that mirrors the reservations held in
// the window log redisKey(prefix, key, scope):
//
//	<prefix>:{<task type>}:reserved:tenant:<tenant>   ScopeTenant
//	<prefix>:{<task type>}:reserved:type              ScopeType
func reservationKey(prefix string, key Key, scope Scope) string {
	return prefix + ":{" + url.PathEscape(key.TaskType) + "}:reserved:" + scopePart(key, scope)
}

// ownersKey returns the Redis key of the hash that names the tenant of each reservation
// on the type-wide log of key's task type, for fairness between tenants:
//
//	<prefix>:{<task type>}:owners
func ownersKey(prefix string, key Key) string {
	return prefix + ":{" + url.PathEscape(key.TaskType) + "}:owners"
}

// tenantTag is a short, fixed-size name for tenant in the owners hash: the FNV-1a hash of
// the tenant in hex. Two tenants with one tag would only share a fair share.
func tenantTag(tenant string) string {
	h := fnv.New64a()
	h.Write([]byte(tenant))
	return strconv.FormatUint(h.Sum64(), 16)
}

func scopePart(key Key, scope Scope) string {
	if scope == ScopeType {
		return "type"
	}
	return "tenant:" + url.PathEscape(key.Tenant)
}
