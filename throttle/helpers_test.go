package throttle_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Helpers shared by the limiter, reservation, key, cluster and stress tests.

// keysOnlyClient is a client that never dials (no call is made through it): for a
// Limiter whose keys alone a test reads (RedisKey). throttle.New refuses a nil one.
func keysOnlyClient(tb testing.TB) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	tb.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func tenantQuota(events int, window time.Duration) throttle.Quota {
	return throttle.Quota{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: events, Window: window}}
}

func typeQuota(events int, window time.Duration) throttle.Quota {
	return throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: events, Window: window}}
}

func newLimiter(t *testing.T) *throttle.Limiter {
	t.Helper()
	l, _ := newLimiterClient(t, throttle.Config{})
	return l
}

// newLimiterClient starts a redis-server of the test's own and returns a Limiter on it
// and a client to inspect the server with.
func newLimiterClient(t *testing.T, cfg throttle.Config) (*throttle.Limiter, *redis.Client) {
	t.Helper()
	rdb := redistest.Start(t)
	l, err := throttle.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l, rdb
}

// ms is the instant n milliseconds after the Unix epoch.
func ms(n int64) time.Time { return time.UnixMilli(n) }

// msd is n milliseconds.
func msd(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

// outcome is every field of a Decision that a call determines, except ServerTime and
// SkewFallback, to compare with ==. At is in ms since the epoch.
type outcome struct {
	Allowed, Replay, Reserved, Held, Paused bool
	Quota                                   throttle.Quota
	Count, Remaining                        int
	RetryAfter, Delay                       time.Duration
	At                                      int64
}

func outcomeOf(d throttle.Decision) outcome {
	return outcome{Allowed: d.Allowed, Replay: d.Replay, Reserved: d.Reserved, Held: d.Held, Paused: d.Paused, Quota: d.Quota,
		Count: d.Count, Remaining: d.Remaining, RetryAfter: d.RetryAfter, Delay: d.Delay, At: d.At.UnixMilli()}
}

func (o outcome) String() string {
	s := "denied"
	switch {
	case o.Replay:
		s = "replay"
	case o.Allowed:
		s = "admitted"
	case o.Reserved:
		s = "denied+reserved"
	}
	if o.Held {
		s += "(held)"
	}
	if o.Paused {
		s += "(paused)"
	}
	return fmt.Sprintf("%s at=%d quota=%s count=%d remaining=%d retry=%dms delay=%dms",
		s, o.At, o.Quota, o.Count, o.Remaining, o.RetryAfter.Milliseconds(), o.Delay.Milliseconds())
}

// allowAt decides req at the instant at (ms since the epoch) and fails the test on an
// error. It checks what holds of every decision: it is made for at or later (later when
// the logs' high-water instant is after at, or for a slot ahead); an admission (not a
// replay) has Delay = At - at and no RetryAfter; a denial has no Delay and a RetryAfter of
// at least 1ms counted from at; RetryAt is At when allowed, else at + RetryAfter.
func allowAt(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d, err := l.AllowAt(context.Background(), req, ms(at))
	if err != nil {
		t.Fatalf("AllowAt(%s/%q, t=%d): %v", req.Key.TaskType, req.Key.Tenant, at, err)
	}
	o := outcomeOf(d)
	switch {
	case d.Allowed && d.Replay:
		if d.Delay != 0 || d.RetryAfter != 0 || d.Reserved || !d.RetryAt().Equal(d.At) {
			t.Fatalf("t=%d: replay %s, RetryAt %d: want no Delay, no RetryAfter, RetryAt = At", at, o, d.RetryAt().UnixMilli())
		}
	case d.Allowed:
		if d.At.Before(ms(at)) || d.Delay != d.At.Sub(ms(at)) || d.RetryAfter != 0 || d.Reserved || !d.RetryAt().Equal(d.At) {
			t.Fatalf("t=%d: admission %s, RetryAt %d: want At >= %d, Delay = At - %d, no RetryAfter, RetryAt = At", at, o, d.RetryAt().UnixMilli(), at, at)
		}
	default:
		if d.At.Before(ms(at)) || d.Delay != 0 || d.RetryAfter < time.Millisecond || !d.RetryAt().Equal(ms(at).Add(d.RetryAfter)) {
			t.Fatalf("t=%d: denial %s, RetryAt %d: want At >= %d, no Delay, RetryAfter >= 1ms, RetryAt = %d + RetryAfter", at, o, d.RetryAt().UnixMilli(), at, at)
		}
	}
	return d
}

// mustAdmit decides req at at and fails the test unless it is a fresh admission for that
// very instant: not a replay, At = at, no Delay.
func mustAdmit(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if !d.Allowed || d.Replay || d.At.UnixMilli() != at || d.Delay != 0 {
		t.Fatalf("t=%d %s/%q: got %s, want an admission at %d", at, req.Key.TaskType, req.Key.Tenant, outcomeOf(d), at)
	}
	return d
}

// wantOutcome decides req at at and compares the whole outcome.
func wantOutcome(t *testing.T, l *throttle.Limiter, req throttle.Request, at int64, want outcome) throttle.Decision {
	t.Helper()
	d := allowAt(t, l, req, at)
	if got := outcomeOf(d); got != want {
		t.Errorf("t=%d %s/%q cost %d:\n got %s\nwant %s", at, req.Key.TaskType, req.Key.Tenant, req.Cost, got, want)
	}
	return d
}

// logFloor is below every instant and above the sentinels "#", "#f" and "#p" that a window
// log keeps at scores below -2^50: ZCOUNT from it counts a log's entries only.
const logFloor = "-1e15"

// isSentinel reports whether a window log's member is a sentinel or its pause.
func isSentinel(member string) bool {
	return member == "#" || member == "#f" || member == "#p" || member == "#e"
}

// zcard is the number of entries (events and reservations) in the window log key, not
// counting its sentinels. For a set that is not a window log it is its ZCARD.
func zcard(t *testing.T, rdb redis.Cmdable, key string) int64 {
	t.Helper()
	n, err := rdb.ZCount(context.Background(), key, logFloor, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// zsetOf returns the whole sorted set key, sentinels and all.
func zsetOf(t *testing.T, rdb redis.Cmdable, key string) []redis.Z {
	t.Helper()
	z, err := rdb.ZRangeWithScores(context.Background(), key, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	return z
}

// entriesOf returns the members of the sorted set key with their scores (ms), without
// the window logs' sentinels.
func entriesOf(t *testing.T, rdb redis.Cmdable, key string) map[string]int64 {
	t.Helper()
	got := map[string]int64{}
	for _, z := range zsetOf(t, rdb, key) {
		if m := z.Member.(string); !isSentinel(m) {
			got[m] = int64(z.Score)
		}
	}
	return got
}

func pttl(t *testing.T, rdb redis.Cmdable, key string) time.Duration {
	t.Helper()
	d, err := rdb.PTTL(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// infoInt reads one integer field of INFO section.
func infoInt(t *testing.T, rdb *redis.Client, section, field string) int64 {
	t.Helper()
	s, err := rdb.Info(context.Background(), section).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(s, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s: %s: %v", section, line, err)
			}
			return n
		}
	}
	t.Fatalf("INFO %s has no field %s", section, field)
	return 0
}

// dirty is the number of writes the server has made (it only grows: persistence is off).
func dirty(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	return infoInt(t, rdb, "persistence", "rdb_changes_since_last_save")
}

// commandsDuring returns how many commands the server processed while fn ran, not
// counting the INFO calls that measure it. Nothing else may use the server meanwhile.
func commandsDuring(t *testing.T, rdb *redis.Client, fn func()) int64 {
	t.Helper()
	first := infoInt(t, rdb, "stats", "total_commands_processed")
	before := infoInt(t, rdb, "stats", "total_commands_processed")
	infoCost := before - first
	fn()
	after := infoInt(t, rdb, "stats", "total_commands_processed")
	return after - before - infoCost
}

// hashTag returns what Redis Cluster hashes: the text between the first '{' and the next
// '}', if that is not empty; else the whole key.
func hashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	n := strings.IndexByte(key[open+1:], '}')
	if n <= 0 {
		return key
	}
	return key[open+1 : open+1+n]
}

// resvSetKey returns the key of the pending set beside the window log
// l.RedisKey(key, scope): "pending:" right after the hash tag.
func resvSetKey(t *testing.T, l *throttle.Limiter, key throttle.Key, scope throttle.Scope) string {
	t.Helper()
	return resvBeside(t, l, key, scope, "pending:")
}

// resvCostsKey returns the key of the cost set (the running sums of the weighted entries)
// beside the window log l.RedisKey(key, scope): "costs:" right after the hash tag.
func resvCostsKey(t *testing.T, l *throttle.Limiter, key throttle.Key, scope throttle.Scope) string {
	t.Helper()
	return resvBeside(t, l, key, scope, "costs:")
}

func resvBeside(t *testing.T, l *throttle.Limiter, key throttle.Key, scope throttle.Scope, word string) string {
	t.Helper()
	log := l.RedisKey(key, scope)
	i := strings.Index(log, "}:")
	if i < 0 {
		t.Fatalf("log key %q has no hash tag", log)
	}
	return log[:i+2] + word + log[i+2:]
}

// resvTypeKey returns the key of one of a task type's own keys: name is "leases" (the
// hash of its reservations), "fair" (their fair tags) or "fairstate" (its virtual time
// and each tenant's latest tag), right after the hash tag.
func resvTypeKey(t *testing.T, l *throttle.Limiter, taskType, name string) string {
	t.Helper()
	log := l.RedisKey(throttle.Key{TaskType: taskType}, throttle.ScopeType)
	base, ok := strings.CutSuffix(log, "}:type")
	if !ok {
		t.Fatalf("type log key %q does not end in }:type", log)
	}
	return base + "}:" + name
}
