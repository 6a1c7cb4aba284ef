package throttle_test

import (
	"net/url"
	"strings"
	"testing"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// fuzzKeyBytes are the bytes url.PathEscape leaves as they are, plus '%' that starts its
// escapes: all an escaped task type or tenant can contain. None is '{', '}', a space, a
// control byte or a non-ASCII byte.
const fuzzKeyBytes = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~$&+,:;=@%"

// FuzzRedisKey checks, for two (task type, tenant) pairs at both scopes, what
// Limiter.RedisKey promises: two keys are equal iff they name the same log (same task
// type and scope, and for ScopeTenant the same tenant), so no tenant can forge or share
// another's log; a key is "throttle:{<tag>}:type" or "throttle:{<tag>}:tenant:<tenant>"
// with the tag url.PathEscape(task type) and the tenant url.PathEscape(tenant), which
// decode back to them; the hash tag that Redis Cluster hashes (between the first '{' and
// the next '}') is exactly that tag, never empty for a non-empty task type, so every log
// of a type lands in one slot; and no '{' or '}' follows it, nor appears in any escaped
// part, so nothing a tenant writes can move it. The tail after the tag starts with
// "type" or "tenant:", never with "reserved:", which starts the reservation sets' keys.
func FuzzRedisKey(f *testing.F) {
	for _, seed := range [][4]string{
		{"api:call", "acme", "api:call", "acme"},
		{"api:call", "acme", "api:call", "other"},
		{"api:call", "", "api:call", "acme"},
		{"{", "}", "}", "{"},
		{"a{b}c", "{x}", "a", "b}c:{x}"},
		{"x", "a:tenant:b", "x", "a"},
		{"x", ":type", "x", ""},
		{"x}:tenant:y", "z", "x", "y}:tenant:z"},
		{"%41", "%41", "A", "A"},
		{"ü", "ü", "%C3%BC", "%C3%BC"},
		{" ", " ", "%20", "+"},
		{"a/b", "c/d", "a%2Fb", "c%2Fd"},
		{"t", "reserved:tenant:x", "t", "x"},
		{"t", strings.Repeat("{}", 300), "t", strings.Repeat("}{", 300)},
		{"\x00", "\n", "\x00", "\r"},
	} {
		f.Add(seed[0], seed[1], seed[2], seed[3])
	}
	l, err := throttle.New(nil, throttle.Config{})
	if err != nil {
		f.Fatal(err)
	}
	scopes := []throttle.Scope{throttle.ScopeTenant, throttle.ScopeType}
	f.Fuzz(func(t *testing.T, type1, tenant1, type2, tenant2 string) {
		pairs := []throttle.Key{{TaskType: type1, Tenant: tenant1}, {TaskType: type2, Tenant: tenant2}}
		for _, k := range pairs {
			for _, s := range scopes {
				checkKeyShape(t, l.RedisKey(k, s), k, s)
			}
		}
		for _, s1 := range scopes {
			for _, s2 := range scopes {
				a, b := pairs[0], pairs[1]
				same := s1 == s2 && a.TaskType == b.TaskType && (s1 == throttle.ScopeType || a.Tenant == b.Tenant)
				ka, kb := l.RedisKey(a, s1), l.RedisKey(b, s2)
				if (ka == kb) != same {
					t.Errorf("RedisKey(%q, %s) = %q and RedisKey(%q, %s) = %q: equal = %v, want %v",
						a, s1, ka, b, s2, kb, ka == kb, same)
				}
			}
		}
	})
}

// checkKeyShape checks one key: its exact shape, its hash tag, and that it decodes back to
// k at scope.
func checkKeyShape(t *testing.T, key string, k throttle.Key, scope throttle.Scope) {
	t.Helper()
	rest, ok := strings.CutPrefix(key, "throttle:{")
	if !ok {
		t.Fatalf("RedisKey(%q, %s) = %q: want the prefix %q", k, scope, key, "throttle:{")
	}
	tag, tail, ok := strings.Cut(rest, "}")
	if !ok {
		t.Fatalf("RedisKey(%q, %s) = %q: no '}' closes the hash tag", k, scope, key)
	}
	// Redis Cluster hashes the text between the first '{' and the next '}', if not empty.
	open := strings.IndexByte(key, '{')
	end := open + 1 + strings.IndexByte(key[open+1:], '}')
	if clusterTag := key[open+1 : end]; clusterTag != tag || tag != url.PathEscape(k.TaskType) {
		t.Errorf("RedisKey(%q, %s) = %q: hash tag %q, want url.PathEscape(%q) = %q",
			k, scope, key, clusterTag, k.TaskType, url.PathEscape(k.TaskType))
	}
	if k.TaskType != "" && tag == "" {
		t.Errorf("RedisKey(%q, %s) = %q: empty hash tag: the key would hash whole, off its type's slot", k, scope, key)
	}
	if typ, err := url.PathUnescape(tag); err != nil || typ != k.TaskType {
		t.Errorf("RedisKey(%q, %s) = %q: tag %q decodes to %q, %v; want the task type", k, scope, key, tag, typ, err)
	}
	if strings.ContainsAny(tail, "{}") {
		t.Errorf("RedisKey(%q, %s) = %q: '{' or '}' after the hash tag", k, scope, key)
	}
	for _, part := range []string{tag, tail} {
		if i := strings.IndexFunc(part, func(r rune) bool { return !strings.ContainsRune(fuzzKeyBytes, r) }); i >= 0 {
			t.Errorf("RedisKey(%q, %s) = %q: byte %q of %q is not one url.PathEscape leaves", k, scope, key, part[i], part)
		}
	}
	switch scope {
	case throttle.ScopeType:
		if tail != ":type" {
			t.Errorf("RedisKey(%q, type) = %q: tail %q, want %q", k, key, tail, ":type")
		}
	case throttle.ScopeTenant:
		esc, ok := strings.CutPrefix(tail, ":tenant:")
		if !ok {
			t.Fatalf("RedisKey(%q, tenant) = %q: tail %q does not start with %q", k, key, tail, ":tenant:")
		}
		if tenant, err := url.PathUnescape(esc); err != nil || tenant != k.Tenant || esc != url.PathEscape(k.Tenant) {
			t.Errorf("RedisKey(%q, tenant) = %q: tenant part %q decodes to %q, %v; want url.PathEscape(%q)", k, key, esc, tenant, err, k.Tenant)
		}
	}
}
