package throttle_test

import (
	"encoding/base64"
	"testing"
	"time"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// Replays by id, never by chance (core v2, rule 7).

// TestNewMember: 16 characters of base64url, 12 bytes (96 bits) from crypto/rand; 100,000
// of them, all different.
func TestNewMember(t *testing.T) {
	t.Parallel()
	seen := make(map[string]bool, 100_000)
	for range 100_000 {
		m := throttle.NewMember()
		b, err := base64.RawURLEncoding.DecodeString(m)
		if len(m) != 16 || err != nil || len(b) != 12 {
			t.Fatalf("NewMember() = %q (%d bytes decoded, %v), want 16 characters of base64url for 12 bytes", m, len(b), err)
		}
		if seen[m] {
			t.Fatalf("NewMember() repeated %q", m)
		}
		seen[m] = true
	}
}

// TestLimiter_AllowAt_sameProcessNoReplay: two limiters in one process share every byte of
// an xid but the counter (its machine id and process id, and the second of a call): v1
// members were xids, so two processes started alike could repeat one, and the second
// event passed for a replay of the first, admitted without writing. Here two limiters on
// one server, one clock, decide the same request (limit 1/1s, no Member: the default) at
// the same instant: the first is admitted, the second denied, not replayed.
func TestLimiter_AllowAt_sameProcessNoReplay(t *testing.T) {
	t.Parallel()
	rdb := redistest.Start(t)
	clock := func() time.Time { return time.UnixMilli(1_700_000_000_000) }
	var ls [2]*throttle.Limiter
	for i := range ls {
		l, err := throttle.New(rdb, throttle.Config{NowFunc: clock})
		if err != nil {
			t.Fatal(err)
		}
		ls[i] = l
	}
	req := throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: "acme"}, Quotas: []throttle.Quota{tenantQuota(1, time.Second)}}
	first := allowAtV2(t, ls[0], req, 1_700_000_000_000)
	second := allowAtV2(t, ls[1], req, 1_700_000_000_000)
	if !first.Allowed || first.Replay {
		t.Errorf("first limiter: %+v, want a fresh admission", first)
	}
	if second.Allowed || second.Replay || second.RetryAfter != time.Second {
		t.Errorf("second limiter: %+v, want denied for 1s, not a replay", second)
	}
}
