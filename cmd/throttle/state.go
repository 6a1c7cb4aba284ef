package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/quote"
	"github.com/asynq-throttle/asynq-throttle/throttle"
	"github.com/asynq-throttle/asynq-throttle/worker"
)

// This file holds what inspect, explain, pause, resume and reset share: the limiter, the
// rules, the names of the keys (README.md, Keys) and how to read a window log.

// floorScore is the lowest score of an entry of a window log: every sentinel ("#", "#f",
// "#p", "#e") is scored below it (lua/sliding_window.lua, SKEW), every event at or above.
const floorScore = "-1125899906842624" // -2^50

// count is n and word, plural unless n is 1: "1 key", "2 keys".
func count(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}

// timeLayout prints instants: UTC, to the millisecond, as the limiter keeps them.
const timeLayout = "2006-01-02T15:04:05.000Z07:00"

func fmtTime(t time.Time) string { return t.UTC().Format(timeLayout) }

// ms returns t truncated to the millisecond, in UTC: how the limiter keeps instants, and
// how the JSON output shows them.
func ms(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()).UTC() }

// limiter returns a Limiter on the environment's Redis with the workers' prefix.
func (e *env) limiter() (*throttle.Limiter, int) {
	rdb, err := e.redis()
	if err != nil {
		return nil, e.fail(redisExit(err), "%v", err)
	}
	lim, err := throttle.New(rdb, throttle.Config{Prefix: e.vars.Prefix})
	if err != nil {
		return nil, e.fail(exitUsage, "%v", err)
	}
	return lim, exitOK
}

// ruleSet is what the workers decide by: their default rules and the overrides stored in
// Redis.
type ruleSet struct {
	defaults []worker.Rule
	known    bool // the default rules were given (-rules or THROTTLE_RULES)
	o        *worker.Overrides
}

// rules reads the workers' default rules, from the -rules flag if set, else
// THROTTLE_RULES, and the overrides stored in Redis.
func (e *env) rules(flagRules optString) (ruleSet, int) {
	text, from := e.vars.Rules, "THROTTLE_RULES"
	if flagRules.set {
		text, from = flagRules.v, "-rules"
	}
	var rs ruleSet
	rs.known = text != "" || flagRules.set
	if text != "" {
		var err error
		if rs.defaults, err = worker.ParseRules(text); err != nil {
			return rs, e.fail(exitUsage, "%s=%q: %v", from, text, err)
		}
	}
	s, code := e.store()
	if s == nil {
		return rs, code
	}
	o, err := s.Load(e.ctx)
	if err != nil {
		return rs, e.fail(exitRedis, "read the overrides: %v", err)
	}
	rs.o = o
	return rs, exitOK
}

// effective is what a task of key is decided with, and false if its type has no rule.
func (rs ruleSet) effective(key throttle.Key) (worker.Effective, bool) {
	return rs.o.Effective(rs.defaults, key)
}

// typeRule is the rule of taskType alone (its own, without any tenant's overrides).
func (rs ruleSet) typeRule(taskType string) (worker.Effective, bool) {
	return (&worker.Overrides{Types: rs.o.Types}).Effective(rs.defaults, throttle.Key{TaskType: taskType})
}

// ruleKnown reports whether the rule of taskType can be known here: the defaults were
// given, or the type has a type override.
func (rs ruleSet) ruleKnown(taskType string) bool {
	_, ok := rs.o.Types[taskType]
	return rs.known || ok
}

// unknownRules is the error for a task type whose rule cannot be known.
func unknownRules(taskType string) string {
	return fmt.Sprintf("the rule of %s is unknown: THROTTLE_RULES is unset and no type override is stored; give the workers' rules with -rules or THROTTLE_RULES",
		display(taskType))
}

// quotasAt returns the quotas of quotas at scope.
func quotasAt(quotas []throttle.Quota, scope throttle.Scope) []throttle.Quota {
	var out []throttle.Quota
	for _, q := range quotas {
		if q.Scope == scope {
			out = append(out, q)
		}
	}
	return out
}

// keyNames are the Redis keys of one task type (README.md, Keys), named from the
// limiter's own log key so that the prefix and the escaping are the limiter's.
type keyNames struct {
	base string // "<prefix>:{<escaped task type>}:"
}

func namesOf(lim *throttle.Limiter, taskType string) keyNames {
	return keyNames{base: strings.TrimSuffix(lim.RedisKey(throttle.Key{TaskType: taskType}, throttle.ScopeType), "type")}
}

// part is the scope part of a log key: "tenant:<escaped tenant>" or "type".
func (n keyNames) part(lim *throttle.Limiter, key throttle.Key, scope throttle.Scope) string {
	return strings.TrimPrefix(lim.RedisKey(key, scope), n.base)
}

func (n keyNames) log(part string) string     { return n.base + part }
func (n keyNames) pending(part string) string { return n.base + "pending:" + part }
func (n keyNames) costs(part string) string   { return n.base + "costs:" + part }
func (n keyNames) leases() string             { return n.base + "leases" }
func (n keyNames) fair() string               { return n.base + "fair" }
func (n keyNames) fairState() string          { return n.base + "fairstate" }

// decisionKeys are every key a decision for key may read or write: the tenant's and the
// type's logs, the pending: and costs: sets beside each, the leases, fair and fairstate.
func (n keyNames) decisionKeys(lim *throttle.Limiter, key throttle.Key) []string {
	t, ty := n.part(lim, key, throttle.ScopeTenant), n.part(lim, key, throttle.ScopeType)
	return []string{n.log(t), n.pending(t), n.costs(t), n.log(ty), n.pending(ty), n.costs(ty), n.leases(), n.fair(), n.fairState()}
}

// parsedKey is a key of the workers' prefix, read back.
type parsedKey struct {
	key      string
	taskType string
	part     string // after "}:": "type", "tenant:<escaped>", "pending:...", "leases", ...
	scope    throttle.Scope
	tenant   string // for a tenant log
}

// parseKey reads a key "<prefix>:{<escaped task type>}:<part>"; ok is false for a key of
// another shape. scope is set for a window log (a tenant's or the type's).
func parseKey(prefix, key string) (parsedKey, bool) {
	rest, ok := strings.CutPrefix(key, prefix+":{")
	if !ok {
		return parsedKey{}, false
	}
	escType, part, ok := strings.Cut(rest, "}:")
	if !ok {
		return parsedKey{}, false
	}
	tt, err := url.PathUnescape(escType)
	if err != nil || tt == "" {
		return parsedKey{}, false
	}
	p := parsedKey{key: key, taskType: tt, part: part}
	switch {
	case part == "type":
		p.scope = throttle.ScopeType
	case strings.HasPrefix(part, "tenant:"):
		tenant, err := url.PathUnescape(strings.TrimPrefix(part, "tenant:"))
		if err != nil {
			return parsedKey{}, false
		}
		p.scope, p.tenant = throttle.ScopeTenant, tenant
	}
	return p, true
}

// globEscape escapes s for SCAN MATCH.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// scanKeys calls fn for every key matching match (SCAN, 500 a page), on every master of a
// Redis Cluster. fn may be called from several goroutines on a cluster, never at once.
func scanKeys(ctx context.Context, rdb redis.UniversalClient, match string, fn func(string)) error {
	var mu sync.Mutex
	scan := func(ctx context.Context, c redis.Cmdable) error {
		iter := c.Scan(ctx, 0, match, 500).Iterator()
		for iter.Next(ctx) {
			mu.Lock()
			fn(iter.Val())
			mu.Unlock()
		}
		return iter.Err()
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return scan(ctx, c) })
	}
	return scan(ctx, rdb)
}

// entry is one entry of a window log.
type entry struct {
	at   time.Time
	kind string // "admission", "reservation" or "released" (a released reservation of cost > 1 that counts until it leaves its window)
	cost int
}

// entryOf reads a window log member (lua/sliding_window.lua, STATE) scored score.
func entryOf(member string, score float64) entry {
	e := entry{at: time.UnixMilli(int64(score)).UTC(), kind: "admission", cost: 1}
	if member == "" {
		return e
	}
	switch member[0] {
	case '@':
		e.kind = "reservation"
	case '~':
		e.kind = "released"
	case '*':
	default:
		return e
	}
	if n, _, ok := strings.Cut(member[1:], ":"); ok {
		if c, err := strconv.Atoi(n); err == nil {
			e.cost = c
		}
	}
	return e
}

// oldestNewest returns the oldest and newest entries of the log (nil if it has none).
func oldestNewest(ctx context.Context, rdb redis.UniversalClient, log string) (oldest, newest *entry, err error) {
	first, err := rdb.ZRangeByScoreWithScores(ctx, log, &redis.ZRangeBy{Min: "(" + floorScore, Max: "+inf", Count: 1}).Result()
	if err != nil {
		return nil, nil, err
	}
	last, err := rdb.ZRevRangeByScoreWithScores(ctx, log, &redis.ZRangeBy{Min: "(" + floorScore, Max: "+inf", Count: 1}).Result()
	if err != nil {
		return nil, nil, err
	}
	if len(first) == 1 {
		e := entryOf(first[0].Member.(string), first[0].Score)
		oldest = &e
	}
	if len(last) == 1 {
		e := entryOf(last[0].Member.(string), last[0].Score)
		newest = &e
	}
	return oldest, newest, nil
}

// slotsIn returns the slots used in the window (a, b] (ms) of a log: its entries there
// plus, from its costs: set, the sum of cost - 1 of those of cost > 1, as the script
// counts them (a difference of two running sums: O(log N)).
func slotsIn(ctx context.Context, rdb redis.UniversalClient, log, costs string, a, b int64) (int64, error) {
	n, err := rdb.ZCount(ctx, log, "("+strconv.FormatInt(a, 10), strconv.FormatInt(b, 10)).Result()
	if err != nil {
		return 0, err
	}
	last := func(x string) (string, error) {
		r, err := rdb.ZRevRangeByScore(ctx, costs, &redis.ZRangeBy{Min: floorScore, Max: x, Count: 1}).Result()
		if err != nil || len(r) == 0 {
			return "", err
		}
		return r[0], nil
	}
	hb, err := last(strconv.FormatInt(b, 10))
	if err != nil || hb == "" {
		return n, err
	}
	ha, err := last(strconv.FormatInt(a, 10))
	if err != nil {
		return 0, err
	}
	if ha != "" {
		return n + cumOf(hb) - cumOf(ha), nil
	}
	first, err := rdb.ZRange(ctx, costs, 0, 0).Result()
	if err != nil || len(first) == 0 {
		return n, err
	}
	c := int64(1)
	if len(first[0]) > 17 {
		c = int64(entryOf(first[0][17:], 0).cost)
	}
	return n + cumOf(hb) - cumOf(first[0]) + c - 1, nil
}

// cumOf reads the running sum that starts a costs: member ("<16 digits>|<log member>").
func cumOf(m string) int64 {
	if len(m) < 16 {
		return 0
	}
	n, _ := strconv.ParseInt(m[:16], 10, 64)
	return n
}

// firstAfter returns the oldest entry of the log scored after a (ms), nil if none.
func firstAfter(ctx context.Context, rdb redis.UniversalClient, log string, a int64) (*entry, error) {
	r, err := rdb.ZRangeByScoreWithScores(ctx, log, &redis.ZRangeBy{Min: "(" + strconv.FormatInt(a, 10), Max: "+inf", Count: 1}).Result()
	if err != nil || len(r) == 0 {
		return nil, err
	}
	e := entryOf(r[0].Member.(string), r[0].Score)
	return &e, nil
}

// reservationsByTenant counts the reservations held on taskType's logs by tenant, and in
// all.
func reservationsByTenant(ctx context.Context, lim *throttle.Limiter, taskType string) (map[string]int, int, error) {
	by, total := map[string]int{}, 0
	err := lim.Reservations(ctx, taskType, func(r throttle.Reservation) bool {
		by[r.Key.Tenant]++
		total++
		return true
	})
	return by, total, err
}

// timeFlag is a flag holding an RFC 3339 instant.
type timeFlag struct {
	t   time.Time
	set bool
}

func (f *timeFlag) String() string {
	if !f.set {
		return ""
	}
	return f.t.Format(time.RFC3339Nano)
}

func (f *timeFlag) Set(s string) error {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return errors.New("want an RFC 3339 instant, e.g. 2026-12-01T12:00:00Z")
	}
	if t.Before(time.UnixMilli(0)) || !t.Before(throttle.MaxTime) { // the limiter's scores hold no other
		return fmt.Errorf("want an instant from 1970-01-01T00:00:00Z to before %s (throttle.MaxTime)", throttle.MaxTime.Format(time.RFC3339Nano))
	}
	f.t, f.set = t, true
	return nil
}

// instant is the -at flag's instant, else the local clock.
func (f *timeFlag) instant() time.Time {
	if f.set {
		return f.t
	}
	return time.Now()
}

// durationFlag is a time.Duration flag whose parse error says what to write (the flag
// package's own says only "parse error").
type durationFlag time.Duration

func (f *durationFlag) String() string { return time.Duration(*f).String() }

func (f *durationFlag) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("want a duration such as 90s, 5m or 1h30m")
	}
	*f = durationFlag(d)
	return nil
}

// targetFlags are the -type and -tenant flags that name a window log.
type targetFlags struct {
	taskType, tenant optString
}

func (tf *targetFlags) register(fs *flag.FlagSet) {
	fs.Var(&tf.taskType, "type", "")
	fs.Var(&tf.tenant, "tenant", "")
}

// check returns an error for a -type or -tenant that no task can have: not UTF-8
// (producer.CheckTask refuses such a task type or tenant header before it is enqueued), or
// a tenant longer than throttle.MaxTenantBytes (the limiter refuses it, ErrInvalid). Such
// a name would only reach keys that no worker ever writes (a pause there would pause
// nothing).
func (tf *targetFlags) check() error {
	switch {
	case !utf8.ValidString(tf.taskType.v):
		return fmt.Errorf("-type %s is not valid UTF-8, which no task's type can be", quote.Name(tf.taskType.v))
	case !utf8.ValidString(tf.tenant.v):
		return fmt.Errorf("-tenant %s is not valid UTF-8, which no task's tenant can be", quote.Quote(tf.tenant.v))
	case len(tf.tenant.v) > throttle.MaxTenantBytes:
		return fmt.Errorf("-tenant of %d bytes: at most throttle.MaxTenantBytes (%d)", len(tf.tenant.v), throttle.MaxTenantBytes)
	}
	return nil
}

// key is the task type and tenant named, and the scope: the tenant's log with -tenant,
// the type's without.
func (tf *targetFlags) key() (throttle.Key, throttle.Scope) {
	scope := throttle.ScopeType
	if tf.tenant.set {
		scope = throttle.ScopeTenant
	}
	return throttle.Key{TaskType: tf.taskType.v, Tenant: tf.tenant.v}, scope
}

// what names the log of key at scope for people: `api:call for tenant "acme"`, or
// `api:call (the task type, every tenant)`.
func what(key throttle.Key, scope throttle.Scope) string {
	if scope == throttle.ScopeTenant {
		return fmt.Sprintf("%s for tenant %q", display(key.TaskType), key.Tenant)
	}
	return display(key.TaskType) + " (the task type's log: every tenant)"
}

// tenantPtr is the tenant of a log for JSON: nil for the type's log.
func tenantPtr(key throttle.Key, scope throttle.Scope) *string {
	if scope != throttle.ScopeTenant {
		return nil
	}
	t := key.Tenant
	return &t
}
