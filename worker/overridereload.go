package worker

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"
)

// overrideReadTimeout bounds each check or read of the overrides.
const overrideReadTimeout = 5 * time.Second

// overrideReloader keeps the middleware's limitSet current with an OverrideStore: it checks
// the version every interval and, when it changed, reads, parses and compiles the whole
// set. A failure keeps the set in force.
type overrideReloader struct {
	store    *OverrideStore
	defaults []Rule
	limits   *atomic.Pointer[limitSet] // the middleware's
	onReload func(version int64, err error)
	log      *slog.Logger

	tried    int64 // the version read last, good or not; -1: none
	triedBad bool  // it did not parse
	failing  bool  // a failure was logged and no read has succeeded since
}

// startOverrides reads cfg.Overrides once, then starts checking them every
// cfg.OverrideInterval until cfg.Context ends. Without cfg.Overrides it does nothing.
func (m *middleware) startOverrides(cfg Config) error {
	if cfg.Overrides == nil {
		return nil
	}
	interval := cfg.OverrideInterval // New refused a negative one
	if interval == 0 {
		interval = DefaultOverrideInterval
	}
	r := &overrideReloader{store: cfg.Overrides, defaults: cfg.Rules, limits: &m.limits,
		onReload: cfg.OverrideReloadFunc, log: m.log, tried: -1}
	ctx := cfg.Context
	if ctx == nil {
		ctx = context.Background()
	}
	r.reload(ctx)
	go r.run(ctx, interval)
	return nil
}

// run checks for a change every interval until ctx ends.
func (r *overrideReloader) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.reload(ctx)
		}
	}
}

// reload checks the version and, if it is not the one read last, reads the set and puts
// it in force. A failure while parent is ending (shutdown) is not reported.
func (r *overrideReloader) reload(parent context.Context) {
	ctx, cancel := context.WithTimeout(parent, overrideReadTimeout)
	defer cancel()
	fail := func(err error) {
		if parent.Err() == nil {
			r.fail(err)
		}
	}
	v, err := r.store.Version(ctx)
	if err != nil {
		fail(err)
		return
	}
	if v == r.tried {
		if r.failing && !r.triedBad {
			r.failing = false
			r.log.Info("throttle: overrides readable again", "key", r.store.Key(), "version", v)
		}
		return
	}
	fields, err := r.store.rdb.HGetAll(ctx, r.store.key).Result()
	if err != nil {
		fail(fmt.Errorf("worker: read overrides %s: %w", r.store.key, err))
		return
	}
	o, err := parseOverrides(fields)
	if err != nil {
		r.tried, r.triedBad = v, true // not again until the next change
		fail(fmt.Errorf("worker: overrides %s: %w", r.store.key, err))
		return
	}
	first := r.limits.Load().version < 0
	r.limits.Store(compileLimits(r.defaults, o))
	r.tried, r.triedBad = o.Version, false
	if r.onReload != nil {
		r.onReload(o.Version, nil)
	}
	r.failing = false
	if first && o.Version == 0 {
		return // nothing was ever stored: the defaults alone, nothing to say
	}
	r.log.Info("throttle: overrides in force", "key", r.store.Key(), "version", o.Version,
		"types", len(o.Types), "tiers", len(o.Tiers), "tenants", len(o.Tenants), "tenant_tiers", len(o.TenantTiers))
}

// fail reports err, and logs it unless a failure was logged since the last good read.
func (r *overrideReloader) fail(err error) {
	in := r.limits.Load().version
	if r.onReload != nil {
		r.onReload(in, err)
	}
	if r.failing {
		return
	}
	r.failing = true
	r.log.Warn("throttle: cannot read the overrides; the set read last stays in force until they can be read (logged once)",
		"key", r.store.Key(), "version_in_force", in, "err", err)
}
