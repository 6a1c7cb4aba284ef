package worker

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/producer"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// OverrideKind names one kind of entry of the overrides: the word the admin CLI takes
// (cmd/throttle limits set <kind> <name> <text>) and the start of its field in Redis.
type OverrideKind string

// The kinds of override, each a field "<kind>:<name>" of the overrides hash.
const (
	// OverrideType replaces the default rule of the task type <name>; its text is the
	// rule without the task type, as ParseRules reads it: "tenant=5/2s type=20/1s".
	OverrideType OverrideKind = "type"
	// OverrideTier defines the tier <name> (ValidTierName); its text is read by
	// ParseTenantLimits: "tenant=50/1s weight=3".
	OverrideTier OverrideKind = "tier"
	// OverrideTenant gives the tenant <name> its own limits, which win over its tier's;
	// its text is read by ParseTenantLimits.
	OverrideTenant OverrideKind = "tenant"
	// OverrideTenantTier assigns the tenant <name> to a tier; its text is the tier's name.
	OverrideTenantTier OverrideKind = "tenant-tier"
)

// OverrideKinds lists every OverrideKind, in the order the admin CLI shows them.
var OverrideKinds = []OverrideKind{OverrideType, OverrideTier, OverrideTenant, OverrideTenantTier}

// Errors of OverrideStore's changes, matched with errors.Is.
var (
	// ErrInvalidOverride: the text, name or kind of a change is not valid; nothing was
	// stored. The error says what is wrong.
	ErrInvalidOverride = errors.New("worker: invalid override")
	// ErrOverrideNotFound: Delete found nothing stored under that kind and name.
	ErrOverrideNotFound = errors.New("worker: override not found")
	// ErrTierNotFound: a tenant was assigned to a tier that does not exist.
	ErrTierNotFound = errors.New("worker: tier not found")
	// ErrTierInUse: a tier that tenants are assigned to cannot be deleted.
	ErrTierInUse = errors.New("worker: tier in use")
)

// overridesVersionField is the field of the overrides hash that counts changes.
const overridesVersionField = "version"

// OverridesKey returns the Redis key of the overrides of a Limiter whose prefix is prefix
// ("" means throttle.DefaultPrefix): "<prefix>:overrides", a hash with a field
// "<kind>:<name>" per override (see OverrideKind) and "version", which every change
// increments. It has no TTL: it is configuration, not state. Window logs put "{" after
// the prefix, so no log key can be this one.
func OverridesKey(prefix string) string {
	if prefix == "" {
		prefix = throttle.DefaultPrefix
	}
	return prefix + ":overrides"
}

// OverrideStore reads and changes the overrides kept in Redis under OverridesKey. Every
// change is validated before it is stored, by the parsers that the middleware reads it
// with, and increments the version, so that a reader (the middleware, see
// Config.Overrides) needs one HGET per poll to see whether anything changed. It is safe
// for concurrent use, also by several processes: a change that depends on another entry
// (a tenant's tier must exist; a tier in use cannot be deleted) is checked and made in one
// transaction (WATCH, MULTI).
type OverrideStore struct {
	rdb redis.UniversalClient
	key string
}

// NewOverrideStore returns the store of the overrides in rdb under OverridesKey(prefix),
// prefix being the Limiter's (throttle.Config.Prefix, THROTTLE_PREFIX). It returns an
// error if rdb is nil, prefix contains '{' or '}' (as throttle.New does), or prefix
// cannot be a workers' prefix because its keys would be enqueue quotas'
// (producer.CheckPrefix).
func NewOverrideStore(rdb redis.UniversalClient, prefix string) (*OverrideStore, error) {
	if rdb == nil {
		return nil, errors.New("worker: NewOverrideStore: nil Redis client")
	}
	if strings.ContainsAny(prefix, "{}") {
		return nil, fmt.Errorf("worker: NewOverrideStore: prefix %q must not contain '{' or '}'", prefix)
	}
	if err := producer.CheckPrefix(prefix); err != nil {
		return nil, fmt.Errorf("worker: NewOverrideStore: %w", err)
	}
	return &OverrideStore{rdb: rdb, key: OverridesKey(prefix)}, nil
}

// Key returns the Redis key of the overrides hash.
func (s *OverrideStore) Key() string { return s.key }

// Version returns the number of changes stored so far, 0 if none (or if the key was
// deleted). The error is Redis's, or says that the field is not an integer.
func (s *OverrideStore) Version(ctx context.Context) (int64, error) {
	v, err := s.rdb.HGet(ctx, s.key, overridesVersionField).Result()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("worker: read the version of overrides %s: %w", s.key, err)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("worker: overrides %s: field %q=%q is not an integer", s.key, overridesVersionField, v)
	}
	return n, nil
}

// Load reads every override (one HGETALL) and parses it as the middleware does. No key
// gives empty Overrides at Version 0. Fields of unknown kinds are ignored (a newer
// version's). The error is Redis's, or names the field that does not parse or the tenant
// whose tier does not exist (someone wrote the hash by hand): the middleware then keeps
// the overrides it read last.
func (s *OverrideStore) Load(ctx context.Context) (*Overrides, error) {
	fields, err := s.rdb.HGetAll(ctx, s.key).Result()
	if err != nil {
		return nil, fmt.Errorf("worker: read overrides %s: %w", s.key, err)
	}
	o, err := parseOverrides(fields)
	if err != nil {
		return nil, fmt.Errorf("worker: overrides %s: %w", s.key, err)
	}
	return o, nil
}

// parseOverrides reads the fields of the overrides hash.
func parseOverrides(fields map[string]string) (*Overrides, error) {
	o := &Overrides{Types: map[string]Rule{}, Tiers: map[string][]TenantLimits{},
		Tenants: map[string][]TenantLimits{}, TenantTiers: map[string]string{}}
	for f, v := range fields {
		if f == overridesVersionField {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("field %q=%q is not an integer", f, v)
			}
			o.Version = n
			continue
		}
		kind, name, ok := strings.Cut(f, ":")
		if !ok || !knownKind(OverrideKind(kind)) {
			continue
		}
		if err := o.add(OverrideKind(kind), name, v); err != nil {
			return nil, fmt.Errorf("field %q=%q: %w", f, v, err)
		}
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	return o, nil
}

func knownKind(k OverrideKind) bool {
	for _, known := range OverrideKinds {
		if k == known {
			return true
		}
	}
	return false
}

// add parses one override into o.
func (o *Overrides) add(kind OverrideKind, name, text string) error {
	switch kind {
	case OverrideType:
		r, err := parseTypeOverride(name, text)
		if err != nil {
			return err
		}
		o.Types[name] = r
	case OverrideTier: // the caller names the tier
		if err := checkTierName(name); err != nil {
			return err
		}
		entries, err := parseEntries(text)
		if err != nil {
			return err
		}
		o.Tiers[name] = entries
	case OverrideTenant:
		entries, err := parseEntries(text)
		if err != nil {
			return err
		}
		o.Tenants[name] = entries
	case OverrideTenantTier:
		if err := ValidTierName(text); err != nil {
			return err
		}
		o.TenantTiers[name] = text
	default:
		return fmt.Errorf("unknown kind %q; want type, tier, tenant or tenant-tier", kind)
	}
	return nil
}

// parseTypeOverride reads the rule of taskType from text, the rule without its type.
func parseTypeOverride(taskType, text string) (Rule, error) {
	if taskType == "" || strings.ContainsAny(taskType, "=;") || strings.ContainsFunc(taskType, unicode.IsSpace) {
		return Rule{}, fmt.Errorf("task type %q: want a non-empty task type without spaces, '=' or ';'", taskType)
	}
	if strings.Contains(text, ";") {
		return Rule{}, fmt.Errorf("rule of %s %q: one rule, without ';'", taskType, text)
	}
	rules, err := ParseRules(taskType + " " + text)
	if err != nil {
		return Rule{}, err
	}
	if len(rules) != 1 || rules[0].TaskType != taskType {
		return Rule{}, fmt.Errorf("rule of %s %q: want the quotas of one rule, e.g. \"tenant=5/2s type=20/1s\"", taskType, text)
	}
	return rules[0], nil
}

// parseEntries reads a tier's or tenant's text: at least one entry.
func parseEntries(text string) ([]TenantLimits, error) {
	entries, err := ParseTenantLimits(text)
	if err != nil {
		return nil, err
	}
	if len(entries) == 0 {
		return nil, errors.New(`no entry; want e.g. "tenant=50/1s weight=3" or "api:call tenant=50/1s"`)
	}
	return entries, nil
}

// Change is one change made by OverrideStore.Set or Delete.
type Change struct {
	Kind    OverrideKind `json:"kind"`              // what was changed: a type's rule, a tier, a tenant's limits
	Name    string       `json:"name"`              // the task type, tier or tenant changed
	Text    string       `json:"text,omitempty"`    // as stored (normalized, e.g. "1000ms" as "1s"); "" for a deletion
	Deleted bool         `json:"deleted,omitempty"` // Delete removed it
	Version int64        `json:"version"`           // the overrides' version after the change
}

// Canonical returns the text that Set would store for kind and name: text parsed as the
// middleware will read it and printed back, so "tenant=50/1000ms weight=3" becomes
// "tenant=50/1s weight=3". The error wraps ErrInvalidOverride and says what is wrong.
func Canonical(kind OverrideKind, name, text string) (string, error) {
	o := &Overrides{Types: map[string]Rule{}, Tiers: map[string][]TenantLimits{},
		Tenants: map[string][]TenantLimits{}, TenantTiers: map[string]string{}}
	if !knownKind(kind) {
		return "", fmt.Errorf("%w: unknown kind %q; want type, tier, tenant or tenant-tier", ErrInvalidOverride, kind)
	}
	if !utf8.ValidString(name) { // asynq cannot encode such a task type or header: no task has it
		return "", fmt.Errorf("%w: %s %s: not valid UTF-8, which no task's type or tenant can be (asynq cannot encode it)",
			ErrInvalidOverride, kind, quote.Quote(name))
	}
	if (kind == OverrideTenant || kind == OverrideTenantTier) && len(name) > throttle.MaxTenantBytes {
		// The limiter refuses such a tenant (throttle.ErrInvalid): its tasks are archived,
		// never decided, so an override for it could never apply.
		return "", fmt.Errorf("%w: %s %s: %d bytes, more than throttle.MaxTenantBytes (%d): its tasks are never decided",
			ErrInvalidOverride, kind, quote.Quote(name), len(name), throttle.MaxTenantBytes)
	}
	if err := o.add(kind, name, text); err != nil {
		return "", fmt.Errorf("%w: %s %s: %s", ErrInvalidOverride, kind, quote.Quote(name), strings.TrimPrefix(err.Error(), "worker: "))
	}
	switch kind {
	case OverrideType:
		r := o.Types[name]
		return strings.TrimPrefix(r.String(), r.TaskType+" "), nil
	case OverrideTier:
		return FormatTenantLimits(o.Tiers[name]), nil
	case OverrideTenant:
		return FormatTenantLimits(o.Tenants[name]), nil
	default:
		return o.TenantTiers[name], nil
	}
}

// Set stores the override of kind for name (a task type, tier or tenant), replacing the
// one stored before, after validating text (see Canonical and OverrideKind), and returns
// the change with the new version. A tenant-tier text must name a stored tier. The error
// wraps ErrInvalidOverride or ErrTierNotFound (nothing was stored), or is Redis's.
func (s *OverrideStore) Set(ctx context.Context, kind OverrideKind, name, text string) (Change, error) {
	canon, err := Canonical(kind, name, text)
	if err != nil {
		return Change{}, err
	}
	field := string(kind) + ":" + name
	var check func(context.Context, *redis.Tx) error
	if kind == OverrideTenantTier {
		check = func(ctx context.Context, tx *redis.Tx) error {
			ok, err := tx.HExists(ctx, s.key, string(OverrideTier)+":"+canon).Result()
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("%w: tenant %s cannot be assigned to tier %s, which does not exist; store the tier first",
					ErrTierNotFound, quote.Quote(name), quote.Quote(canon))
			}
			return nil
		}
	}
	v, err := s.update(ctx, check, func(p redis.Pipeliner) { p.HSet(ctx, s.key, field, canon) })
	if err != nil {
		return Change{}, err
	}
	return Change{Kind: kind, Name: name, Text: canon, Version: v}, nil
}

// Delete removes the override of kind for name and returns the change with the new
// version. A tier can be deleted only while no tenant is assigned to it. The error wraps
// ErrInvalidOverride (an unknown kind), ErrOverrideNotFound or ErrTierInUse (nothing was
// changed), or is Redis's.
func (s *OverrideStore) Delete(ctx context.Context, kind OverrideKind, name string) (Change, error) {
	if !knownKind(kind) {
		return Change{}, fmt.Errorf("%w: unknown kind %q; want type, tier, tenant or tenant-tier", ErrInvalidOverride, kind)
	}
	field := string(kind) + ":" + name
	check := func(ctx context.Context, tx *redis.Tx) error {
		ok, err := tx.HExists(ctx, s.key, field).Result()
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%w: no %s override %s is stored", ErrOverrideNotFound, kind, quote.Quote(name))
		}
		if kind != OverrideTier {
			return nil
		}
		fields, err := tx.HGetAll(ctx, s.key).Result()
		if err != nil {
			return err
		}
		var users []string
		for f, v := range fields {
			if t, ok := strings.CutPrefix(f, string(OverrideTenantTier)+":"); ok && v == name {
				users = append(users, quote.Quote(t))
			}
		}
		if len(users) > 0 {
			sort.Strings(users)
			more := ""
			if len(users) > 5 {
				more, users = fmt.Sprintf(" and %d more", len(users)-5), users[:5]
			}
			return fmt.Errorf("%w: tier %q still has tenants %s%s; assign them elsewhere or delete their tenant-tier first",
				ErrTierInUse, name, strings.Join(users, ", "), more)
		}
		return nil
	}
	v, err := s.update(ctx, check, func(p redis.Pipeliner) { p.HDel(ctx, s.key, field) })
	if err != nil {
		return Change{}, err
	}
	return Change{Kind: kind, Name: name, Deleted: true, Version: v}, nil
}

// maxTxAttempts bounds the optimistic retries of a change that raced another; each retry
// waits a random time up to 1ms times the attempts so far, so racing writers spread out.
const maxTxAttempts = 50

// update runs check (if not nil) and then write and the version's increment in one
// transaction on the overrides key, and returns the new version. With a check, the key
// is watched from the check to the write, and the whole is retried while another change
// interferes; without one, write and increment are one MULTI. check's error is returned
// as it is.
func (s *OverrideStore) update(ctx context.Context, check func(context.Context, *redis.Tx) error, write func(redis.Pipeliner)) (int64, error) {
	var version int64
	txf := func(tx *redis.Tx) error {
		if check != nil {
			if err := check(ctx, tx); err != nil {
				return err
			}
		}
		var incr *redis.IntCmd
		_, err := tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
			write(p)
			incr = p.HIncrBy(ctx, s.key, overridesVersionField, 1)
			return nil
		})
		if err != nil {
			return err
		}
		version = incr.Val()
		return nil
	}
	if check == nil {
		var incr *redis.IntCmd
		_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			write(p)
			incr = p.HIncrBy(ctx, s.key, overridesVersionField, 1)
			return nil
		})
		if err != nil {
			return 0, fmt.Errorf("worker: change overrides %s: %w", s.key, err)
		}
		return incr.Val(), nil
	}
	for attempt := range maxTxAttempts {
		err := s.rdb.Watch(ctx, txf, s.key)
		if errors.Is(err, redis.TxFailedErr) {
			select {
			case <-ctx.Done():
				return 0, fmt.Errorf("worker: change overrides %s: %w", s.key, ctx.Err())
			case <-time.After(rand.N(time.Duration(attempt+1) * time.Millisecond)):
			}
			continue
		}
		if err != nil && !errors.Is(err, ErrTierNotFound) && !errors.Is(err, ErrOverrideNotFound) && !errors.Is(err, ErrTierInUse) {
			return 0, fmt.Errorf("worker: change overrides %s: %w", s.key, err)
		}
		return version, err
	}
	return 0, fmt.Errorf("worker: change overrides %s: %d attempts raced other changes", s.key, maxTxAttempts)
}
