package throttle

// FuzzRedisKey is an internal test (package throttle, not throttle_test): besides the
// window logs that Limiter.RedisKey names, a decision passes keys that only the package
// builds (pendingKey, costsKey, leasesKey, fairQueueKey, fairStateKey), and the script
// rebuilds some of them from keyBase and an escaped tenant. The property covers them all.

import (
	"net/url"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// fuzzKeyBytes are the bytes url.PathEscape leaves as they are, plus '%' that starts its
// escapes: all an escaped task type or tenant can contain. None is '{', '}', a space, a
// control byte or a non-ASCII byte.
const fuzzKeyBytes = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~$&+,:;=@%"

// fuzzKeyID is what a key names: its kind, task type, and for a tenant-scoped kind, tenant.
type fuzzKeyID struct {
	kind     string // "log", "pending", "costs" (each with a scope), "leases", "fair", "fairstate"
	taskType string
	scope    Scope // 0 for the per-type kinds
	tenant   string
}

// fuzzKeys returns every key a decision or a release for k can pass or rebuild, by what it
// names, and the tail each must have after "<prefix>:{<escaped type>}:".
func fuzzKeys(k Key) map[fuzzKeyID][2]string {
	esc := url.PathEscape(k.Tenant)
	keys := map[fuzzKeyID][2]string{}
	for _, s := range []Scope{ScopeTenant, ScopeType} {
		id := fuzzKeyID{taskType: k.TaskType, scope: s}
		part := "type"
		if s == ScopeTenant {
			id.tenant, part = k.Tenant, "tenant:"+esc
		}
		id.kind = "log"
		keys[id] = [2]string{redisKey(DefaultPrefix, k, s), part}
		id.kind = "pending"
		keys[id] = [2]string{pendingKey(DefaultPrefix, k, s), "pending:" + part}
		id.kind = "costs"
		keys[id] = [2]string{costsKey(DefaultPrefix, k, s), "costs:" + part}
	}
	keys[fuzzKeyID{kind: "leases", taskType: k.TaskType}] = [2]string{leasesKey(DefaultPrefix, k.TaskType), "leases"}
	keys[fuzzKeyID{kind: "fair", taskType: k.TaskType}] = [2]string{fairQueueKey(DefaultPrefix, k.TaskType), "fair"}
	keys[fuzzKeyID{kind: "fairstate", taskType: k.TaskType}] = [2]string{fairStateKey(DefaultPrefix, k.TaskType), "fairstate"}
	return keys
}

// FuzzRedisKey checks, for two (task type, tenant) pairs, what the keys promise: two keys
// of any kinds (window log, pending set or cost set at either scope; a type's leases, fair
// tags or fair state) are equal iff they name the same thing (same kind, task type and
// scope, and for ScopeTenant the same tenant), so no tenant can forge or share another's
// log or sets, and no key of one kind is a key of another; every key is
// "throttle:{<tag>}:<tail>" with the tag url.PathEscape(task type) and the tail one of
// "type", "tenant:<t>", "pending:type", "pending:tenant:<t>", "costs:type",
// "costs:tenant:<t>", "leases", "fair", "fairstate", <t> being url.PathEscape(tenant),
// which decode back to them; the hash tag that Redis Cluster hashes (between the first
// '{' and the next '}') is exactly that tag, never empty for a non-empty task type, so
// every key of a type lands in one slot; no '{' or '}' follows it, nor appears in any
// escaped part, so nothing a tenant writes can move it; and keyBase plus the tail is the
// key, as the script rebuilds a tenant's keys from the key base and the escaped tenant.
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
		{"t", "pending:tenant:x", "t", "x"},
		{"t", "costs:x", "t", "x"},
		{"t", "type", "t", "leases"},
		{"x}:pending", "type", "x", "y"},
		{"t", strings.Repeat("{}", 300), "t", strings.Repeat("}{", 300)},
		{"\x00", "\n", "\x00", "\r"},
	} {
		f.Add(seed[0], seed[1], seed[2], seed[3])
	}
	keysOnly := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialed: keys alone
	f.Cleanup(func() { _ = keysOnly.Close() })
	l, err := New(keysOnly, Config{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, type1, tenant1, type2, tenant2 string) {
		pairs := []Key{{TaskType: type1, Tenant: tenant1}, {TaskType: type2, Tenant: tenant2}}
		byKey := map[string]fuzzKeyID{}
		for _, k := range pairs {
			for id, kt := range fuzzKeys(k) {
				checkFuzzKey(t, kt[0], kt[1], id, k)
				if prev, ok := byKey[kt[0]]; ok && prev != id {
					t.Errorf("%+v and %+v share the key %q", prev, id, kt[0])
				}
				byKey[kt[0]] = id
			}
			for _, s := range []Scope{ScopeTenant, ScopeType} {
				if got, want := l.RedisKey(k, s), redisKey(DefaultPrefix, k, s); got != want {
					t.Errorf("Limiter.RedisKey(%q, %s) = %q, want redisKey's %q", k, s, got, want)
				}
			}
		}
		// Every distinct thing the two pairs name has a key of its own.
		ids := map[fuzzKeyID]bool{}
		for _, k := range pairs {
			for id := range fuzzKeys(k) {
				ids[id] = true
			}
		}
		if len(byKey) != len(ids) {
			t.Errorf("%d distinct keys for %d distinct things: %v", len(byKey), len(ids), byKey)
		}
	})
}

// checkFuzzKey checks one key: its exact shape (the tail wantTail after the hash tag), its
// hash tag, and that it decodes back to k.
func checkFuzzKey(t *testing.T, key, wantTail string, id fuzzKeyID, k Key) {
	t.Helper()
	rest, ok := strings.CutPrefix(key, "throttle:{")
	if !ok {
		t.Fatalf("%+v: key %q: want the prefix %q", id, key, "throttle:{")
	}
	tag, tail, ok := strings.Cut(rest, "}")
	if !ok {
		t.Fatalf("%+v: key %q: no '}' closes the hash tag", id, key)
	}
	// Redis Cluster hashes the text between the first '{' and the next '}', if not empty.
	open := strings.IndexByte(key, '{')
	end := open + 1 + strings.IndexByte(key[open+1:], '}')
	if clusterTag := key[open+1 : end]; clusterTag != tag || tag != url.PathEscape(k.TaskType) {
		t.Errorf("%+v: key %q: hash tag %q, want url.PathEscape(%q) = %q", id, key, clusterTag, k.TaskType, url.PathEscape(k.TaskType))
	}
	if k.TaskType != "" && tag == "" {
		t.Errorf("%+v: key %q: empty hash tag: the key would hash whole, off its type's slot", id, key)
	}
	if typ, err := url.PathUnescape(tag); err != nil || typ != k.TaskType {
		t.Errorf("%+v: key %q: tag %q decodes to %q, %v; want the task type", id, key, tag, typ, err)
	}
	if strings.ContainsAny(tail, "{}") {
		t.Errorf("%+v: key %q: '{' or '}' after the hash tag", id, key)
	}
	for _, part := range []string{tag, tail} {
		if i := strings.IndexFunc(part, func(r rune) bool { return !strings.ContainsRune(fuzzKeyBytes, r) }); i >= 0 {
			t.Errorf("%+v: key %q: byte %q of %q is not one url.PathEscape leaves", id, key, part[i], part)
		}
	}
	if tail != ":"+wantTail {
		t.Errorf("%+v: key %q: tail %q, want %q", id, key, tail, ":"+wantTail)
	}
	if base := keyBase(DefaultPrefix, k.TaskType); key != base+wantTail {
		t.Errorf("%+v: key %q is not keyBase %q + %q: the script would rebuild another key", id, key, base, wantTail)
	}
	if id.scope == ScopeTenant {
		word := map[string]string{"log": "", "pending": "pending:", "costs": "costs:"}[id.kind]
		esc, ok := strings.CutPrefix(tail, ":"+word+"tenant:")
		if !ok {
			t.Fatalf("%+v: key %q: tail %q does not start with %q", id, key, tail, ":"+word+"tenant:")
		}
		if tenant, err := url.PathUnescape(esc); err != nil || tenant != k.Tenant || esc != url.PathEscape(k.Tenant) {
			t.Errorf("%+v: key %q: tenant part %q decodes to %q, %v; want url.PathEscape(%q)", id, key, esc, tenant, err, k.Tenant)
		}
	}
}
