package throttle_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

func TestHashTag(t *testing.T) { // the helper the key tests rely on
	t.Parallel()
	for key, want := range map[string]string{
		"a:{b}:c":     "b",
		"a:{b}:{c}":   "b",
		"a:{}:{c}":    "a:{}:{c}",
		"a:b":         "a:b",
		"{a{b}c}":     "a{b",
		"x:{%7Bx%7D}": "%7Bx%7D",
	} {
		if got := hashTag(key); got != want {
			t.Errorf("hashTag(%q) = %q, want %q", key, got, want)
		}
	}
}

func TestLimiter_RedisKey(t *testing.T) {
	t.Parallel()
	l, err := throttle.New(keysOnlyClient(t), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		key   throttle.Key
		scope throttle.Scope
		want  string
	}{
		{throttle.Key{TaskType: "api:call", Tenant: "acme"}, throttle.ScopeTenant, "throttle:{api:call}:tenant:acme"},
		{throttle.Key{TaskType: "api:call", Tenant: "acme"}, throttle.ScopeType, "throttle:{api:call}:type"},
		{throttle.Key{TaskType: "api:call", Tenant: ""}, throttle.ScopeTenant, "throttle:{api:call}:tenant:"},
		{throttle.Key{TaskType: "api:call", Tenant: "{x}"}, throttle.ScopeTenant, "throttle:{api:call}:tenant:%7Bx%7D"},
		{throttle.Key{TaskType: "api:call", Tenant: "a b/c%"}, throttle.ScopeTenant, "throttle:{api:call}:tenant:a%20b%2Fc%25"},
		{throttle.Key{TaskType: "}{", Tenant: "t"}, throttle.ScopeType, "throttle:{%7D%7B}:type"},
		// Tenants spelled like the words of the other keys stay in the tenant tail.
		{throttle.Key{TaskType: "api:call", Tenant: "pending:type"}, throttle.ScopeTenant, "throttle:{api:call}:tenant:pending:type"},
		{throttle.Key{TaskType: "api:call", Tenant: "leases"}, throttle.ScopeTenant, "throttle:{api:call}:tenant:leases"},
	}
	for _, tc := range tests {
		if got := l.RedisKey(tc.key, tc.scope); got != tc.want {
			t.Errorf("RedisKey(%+v, %s) = %q, want %q", tc.key, tc.scope, got, tc.want)
		}
	}
}

// TestLimiter_RedisKey_hostile checks, for task types and tenants chosen to break a key,
// that every log of a type shares one hash tag (the escaped type, never empty), that the
// tenant is the whole tail of its key, and that distinct (type, tenant, scope) never share
// a key. The keys beside the logs (pending and cost sets, the type's leases and fair
// state) are FuzzRedisKey's, which sees the functions that build them.
func TestLimiter_RedisKey_hostile(t *testing.T) {
	t.Parallel()
	l, err := throttle.New(keysOnlyClient(t), throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	types := []string{"api:call", "{x}", "}", "{", "a}b{c", "ü", "a b", "%41", "A", "x}:tenant:y", "api:call}:type", "x}:pending:type"}
	tenants := []string{"acme", "{x}", "}", "{", "{}", "a:b", "a b", "ü", "", strings.Repeat("x{}", 3414),
		"acme/x", "acme%2Fx", "%41", "A", "a", "%61", ":type", "x}:tenant:y", "\x00\n", "a:tenant:b",
		"pending:x", "costs:tenant:x", "leases", "fair", "fairstate", "#", "@1:x"}
	seen := map[string]string{} // key -> who made it
	add := func(key, who string) {
		if prev, ok := seen[key]; ok {
			t.Errorf("%s and %s share the key %q", prev, who, key)
		}
		seen[key] = who
	}
	for _, typ := range types {
		tag := url.PathEscape(typ)
		typeKey := l.RedisKey(throttle.Key{TaskType: typ, Tenant: "ignored"}, throttle.ScopeType)
		if got := hashTag(typeKey); got != tag || got == "" {
			t.Errorf("type %q: hash tag of %q is %q, want %q", typ, typeKey, got, tag)
		}
		if want := "throttle:{" + tag + "}:type"; typeKey != want {
			t.Errorf("type %q: type key %q, want %q", typ, typeKey, want)
		}
		add(typeKey, "type "+typ)
		for _, tenant := range tenants {
			key := l.RedisKey(throttle.Key{TaskType: typ, Tenant: tenant}, throttle.ScopeTenant)
			if got := hashTag(key); got != tag {
				t.Errorf("(%q, %q): hash tag %q, want %q (that of the type's other logs)", typ, tenant, got, tag)
			}
			tail, ok := strings.CutPrefix(key, "throttle:{"+tag+"}:tenant:")
			if !ok {
				t.Errorf("(%q, %q): key %q does not start with the type's tenant prefix", typ, tenant, key)
				continue
			}
			if got, err := url.PathUnescape(tail); err != nil || got != tenant {
				t.Errorf("(%q, %q): tail %q unescapes to %q, %v", typ, tenant, tail, got, err)
			}
			if strings.ContainsAny(tail, "{} /") {
				t.Errorf("(%q, %q): tail %q holds a brace, space or slash", typ, tenant, tail)
			}
			add(key, "("+typ+", "+tenant+")")
		}
	}
	if want := len(types) * (len(tenants) + 1); len(seen) != want {
		t.Errorf("%d distinct keys, want %d", len(seen), want)
	}
}

// TestLimiter_AllowAt_tenantsNeverShareALog: tenants whose names differ only in a way that
// escaping could blur each get a log, and a pending set, of their own.
func TestLimiter_AllowAt_tenantsNeverShareALog(t *testing.T) {
	t.Parallel()
	l, rdb := newLimiterClient(t, throttle.Config{})
	q := tenantQuota(1, time.Minute)
	pairs := [][2]string{{"a", "%61"}, {"A", "%41"}, {"acme/x", "acme%2Fx"}, {"a b", "a%20b"}, {"", "%"}, {"{x}", "%7Bx%7D"}, {"ü", "%C3%BC"},
		{"x", "pending:x"}, {"x", "costs:x"}}
	for i, p := range pairs {
		t.Run(fmt.Sprintf("%q|%q", p[0], p[1]), func(t *testing.T) {
			t.Parallel()
			typ := "pair:" + string(rune('a'+i))
			first := throttle.Request{Key: throttle.Key{TaskType: typ, Tenant: p[0]}, Quotas: []throttle.Quota{q}}
			second := throttle.Request{Key: throttle.Key{TaskType: typ, Tenant: p[1]}, Quotas: []throttle.Quota{q}}
			mustAdmit(t, l, first, 1000)
			mustAdmit(t, l, second, 1000)
			// Each reserves 61000 in its own log; the other's reservation does not count.
			for j, req := range []throttle.Request{first, second} {
				req.Reservation = fmt.Sprintf("r%d", j)
				wantOutcome(t, l, req, 1001, outcome{Reserved: true, Quota: q, Count: 1, RetryAfter: msd(60000 - 1), At: 1001})
				resvWantSet(t, rdb, resvSetKey(t, l, req.Key, throttle.ScopeTenant), map[string]int64{"1:" + req.Reservation: 61000})
			}
		})
	}
}

func TestScope_String(t *testing.T) {
	t.Parallel()
	for s, want := range map[throttle.Scope]string{
		throttle.ScopeTenant: "tenant",
		throttle.ScopeType:   "type",
		0:                    "Scope(0)",
		7:                    "Scope(7)",
	} {
		if got := s.String(); got != want {
			t.Errorf("Scope(%d).String() = %q, want %q", uint8(s), got, want)
		}
	}
}

func TestQuota_String(t *testing.T) {
	t.Parallel()
	tests := []struct {
		q    throttle.Quota
		want string
	}{
		{tenantQuota(5, 2*time.Second), "tenant=5/2s"},
		{throttle.Quota{Scope: throttle.ScopeType, Limit: throttle.PerMinute(100)}, "type=100/1m"},
		{throttle.Quota{Scope: throttle.ScopeTenant}, "tenant=none"},
	}
	for _, tc := range tests {
		if got := tc.q.String(); got != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.q, got, tc.want)
		}
	}
}

func TestQuota_Validate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		q  throttle.Quota
		ok bool
	}{
		{tenantQuota(5, 2*time.Second), true},
		{typeQuota(1, time.Millisecond), true},
		{throttle.Quota{Limit: throttle.PerSecond(1)}, false},
		{throttle.Quota{Scope: 3, Limit: throttle.PerSecond(1)}, false},
		{tenantQuota(0, time.Second), false},
		{typeQuota(1, 0), false},
	}
	for _, tc := range tests {
		if err := tc.q.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s.Validate() = %v, want ok=%v", tc.q, err, tc.ok)
		} else if err != nil && !strings.HasPrefix(err.Error(), "throttle: ") {
			t.Errorf("%s.Validate() = %q, want it to start with \"throttle: \"", tc.q, err)
		}
	}
}

// TestLimiter_tenantTooLong: a request whose tenant is longer than MaxTenantBytes is
// ErrInvalid, and the error names the tenant's length and shows only its first 64 bytes,
// quoted: a 1 MB tenant makes an error of 189 bytes, not of a megabyte.
func TestLimiter_tenantTooLong(t *testing.T) {
	t.Parallel()
	l, _ := newLimiterClient(t, throttle.Config{})
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: strings.Repeat("x", 1<<20)},
		Quotas: []throttle.Quota{tenantQuota(5, time.Second)}}
	_, err := l.AllowAt(context.Background(), req, ms(1000))
	want := `throttle: invalid request: api:call for tenant "` + strings.Repeat("x", 64) +
		`"...(1048576 bytes): tenant of 1048576 bytes, more than MaxTenantBytes (1024)`
	if err == nil || err.Error() != want || !errors.Is(err, throttle.ErrInvalid) {
		t.Errorf("err = %v\nwant %s (ErrInvalid)", err, want)
	}
	if err := l.Cancel(context.Background(), throttle.Request{Key: req.Key, Quotas: req.Quotas, Reservation: "task-1"}); err == nil || err.Error() != want {
		t.Errorf("Cancel: err = %v\nwant %s", err, want)
	}
}
