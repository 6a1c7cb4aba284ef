package throttle

import "testing"

// TestRedisVersion: the version is read from INFO server and compared part by part with
// MinRedisVersion, 7.0.
func TestRedisVersion(t *testing.T) {
	info := "# Server\r\nredis_version:6.2.14\r\nredis_git_sha1:00000000\r\n"
	if v, ok := redisVersion(info); !ok || v != "6.2.14" {
		t.Fatalf("redisVersion = %q, %v; want 6.2.14", v, ok)
	}
	if _, ok := redisVersion("# Server\r\nredis_mode:standalone\r\n"); ok {
		t.Errorf("redisVersion of an INFO without redis_version: ok, want not found")
	}
	for _, c := range []struct {
		v    string
		want bool
	}{
		{"6.2.14", true}, {"6.0.16", true}, {"5.0.7", true},
		{"7.0.0", false}, {"7.0.15", false}, {"7.2.4", false}, {"8.0.1", false}, {"10.0", false},
		{"7", false}, {"x.1", false},
	} {
		if got := olderThan(c.v, MinRedisVersion); got != c.want {
			t.Errorf("olderThan(%q, %q) = %v, want %v", c.v, MinRedisVersion, got, c.want)
		}
	}
}
