package worker

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// TestRequestWeight: the weight a tier or a tenant's override sets is the request's
// Weight (its fair share on the rule's type= quotas), and wins over Config.WeightFunc;
// WeightFunc, clamped to [1, MaxWeight], gives the others theirs; with neither the request
// leaves it 0 (the limiter's 1). The quotas are the tenant's.
func TestRequestWeight(t *testing.T) {
	t.Parallel()
	rules, err := ParseRules("w:call tenant=5/1s type=20/1s")
	if err != nil {
		t.Fatal(err)
	}
	pro, err := ParseTenantLimits("tenant=50/1s weight=3")
	if err != nil {
		t.Fatal(err)
	}
	own, err := ParseTenantLimits("w:call weight=7")
	if err != nil {
		t.Fatal(err)
	}
	o := &Overrides{Version: 1, Tiers: map[string][]TenantLimits{"pro": pro}, Tenants: map[string][]TenantLimits{"initech": own},
		TenantTiers: map[string]string{"acme": "pro", "initech": "pro"}}
	set := compileLimits(rules, o)
	tests := []struct {
		tenant     string
		weightFunc func(throttle.Key) int
		want       int
		wantQuotas string
	}{
		{"acme", nil, 3, "w:call tenant=50/1s type=20/1s"},
		{"acme", func(throttle.Key) int { return 5 }, 3, "w:call tenant=50/1s type=20/1s"},
		{"initech", nil, 7, "w:call tenant=50/1s type=20/1s"},
		{"globex", nil, 0, "w:call tenant=5/1s type=20/1s"},
		{"globex", func(throttle.Key) int { return 5 }, 5, "w:call tenant=5/1s type=20/1s"},
		{"globex", func(throttle.Key) int { return 0 }, 1, "w:call tenant=5/1s type=20/1s"},
		{"globex", func(throttle.Key) int { return 2 * throttle.MaxWeight }, throttle.MaxWeight, "w:call tenant=5/1s type=20/1s"},
	}
	for _, tc := range tests {
		m := &middleware{weight: tc.weightFunc, maxWait: DefaultMaxWait, now: time.Now}
		key := throttle.Key{TaskType: "w:call", Tenant: tc.tenant}
		eff, ok := set.resolve(key)
		if !ok {
			t.Fatalf("no rule for %+v", key)
		}
		req := m.request(context.Background(), asynq.NewTask("w:call", nil), key, eff, 1, true)
		if req.Weight != tc.want {
			t.Errorf("tenant %s (WeightFunc set: %t): Weight %d, want %d", tc.tenant, tc.weightFunc != nil, req.Weight, tc.want)
		}
		if got := (Rule{TaskType: "w:call", Quotas: req.Quotas}).String(); got != tc.wantQuotas {
			t.Errorf("tenant %s: quotas %q, want %q", tc.tenant, got, tc.wantQuotas)
		}
	}
}

// TestShadowLogger: one line per task type per interval, the next one counting those not
// logged in between; task types are limited apart.
func TestShadowLogger(t *testing.T) {
	t.Parallel()
	var l shadowLogger
	t0 := time.UnixMilli(1_000_000)
	steps := []struct {
		taskType    string
		at          time.Duration
		wantOK      bool
		wantSkipped int
	}{
		{"a", 0, true, 0},
		{"a", 10 * time.Millisecond, false, 0},
		{"b", 20 * time.Millisecond, true, 0},
		{"a", 999 * time.Millisecond, false, 0},
		{"a", time.Second, true, 2},
		{"a", time.Second, false, 0},
		{"a", 3 * time.Second, true, 1},
	}
	for i, s := range steps {
		skipped, ok := l.take(s.taskType, t0.Add(s.at))
		if ok != s.wantOK || skipped != s.wantSkipped {
			t.Errorf("step %d (%s at %s): take = %d, %t; want %d, %t", i, s.taskType, s.at, skipped, ok, s.wantSkipped, s.wantOK)
		}
	}
}
