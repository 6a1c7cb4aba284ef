package throttle_test

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

var (
	modelSeed  = flag.Uint64("model.seed", 0, "TestLimiter_AllowAt_matchesModel: run only this seed (0: the fixed seeds)")
	modelSteps = flag.Int("model.steps", 2000, "TestLimiter_AllowAt_matchesModel: calls per seed")
)

// modelSeeds are the seeds the test runs by default: fixed, so that a run is reproducible.
var modelSeeds = []uint64{1, 2, 3, 4, 5}

// observingClient is a redis.Client whose script calls run in one MULTI/EXEC followed, for
// every key in watch, by PTTL, PEXPIRETIME, the key's contents, and PERSIST. The model
// runs on simulated milliseconds while Redis expires keys on its real clock: removing the
// TTLs in the transaction that set them keeps every key alive on simulated time only, and
// lets the test check the TTL each call sets and everything each call leaves.
type observingClient struct {
	*redis.Client
	watch []string // the keys to observe after the next script call
	calls []observedCall
}

type observedCall struct{ keys map[string]observedKey }

type observedKey struct {
	pttl, expireTime int64 // ms; -1 no TTL, -2 no key
	zset             []redis.Z
	hash             map[string]string
}

func isHashKey(key string) bool {
	return strings.HasSuffix(key, "}:leases") || strings.HasSuffix(key, "}:fairstate")
}

func (c *observingClient) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return c.observe(ctx, func(p redis.Pipeliner) *redis.Cmd { return p.EvalSha(ctx, sha1, keys, args...) })
}

func (c *observingClient) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return c.observe(ctx, func(p redis.Pipeliner) *redis.Cmd { return p.Eval(ctx, script, keys, args...) })
}

func (c *observingClient) observe(ctx context.Context, run func(redis.Pipeliner) *redis.Cmd) *redis.Cmd {
	var script *redis.Cmd
	type cmds struct {
		pttl, expireTime *redis.Cmd
		zset             *redis.ZSliceCmd
		hash             *redis.MapStringStringCmd
	}
	got := map[string]*cmds{}
	_, _ = c.Client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		script = run(p)
		for _, k := range c.watch {
			o := &cmds{pttl: p.Do(ctx, "PTTL", k), expireTime: p.Do(ctx, "PEXPIRETIME", k)}
			if isHashKey(k) {
				o.hash = p.HGetAll(ctx, k)
			} else {
				o.zset = p.ZRangeWithScores(ctx, k, 0, -1)
			}
			p.Persist(ctx, k)
			got[k] = o
		}
		return nil
	}) // each command carries its own error; the script's is returned
	if script.Err() != nil {
		return script // NOSCRIPT: redis.Script.Run sends EVAL next
	}
	call := observedCall{keys: map[string]observedKey{}}
	for k, o := range got {
		var ok observedKey
		ok.pttl, _ = o.pttl.Int64()
		ok.expireTime, _ = o.expireTime.Int64()
		if o.hash != nil {
			ok.hash = o.hash.Val()
		} else {
			// A log's end-slot hint ("#e", below every other sentinel) is the script's
			// shortcut, not state the contract defines: the model checks the decisions
			// it leads to, not when the script keeps one.
			ok.zset = slices.DeleteFunc(o.zset.Val(), func(z redis.Z) bool { return z.Member == "#e" && z.Score < -(1<<51) })
		}
		call.keys[k] = ok
	}
	c.calls = append(c.calls, call)
	return script
}

// modelOp is one call of the test: a request at an instant, or a release.
type modelOp struct {
	req      throttle.Request
	at       int64
	why      string // how the generator came to it
	release  bool   // Limiter.Release(req.Key.TaskType, req.Reservation)
	pause    int64  // > 0: Limiter.PauseAt(req.Key, req.Quotas[0].Scope, pause, at)
	resume   bool   // Limiter.Resume(req.Key, req.Quotas[0].Scope)
	decision modelDecision
}

func (op modelOp) String() string {
	switch {
	case op.release:
		return fmt.Sprintf("release type=%q token=%q", op.req.Key.TaskType, op.req.Reservation)
	case op.pause > 0:
		return fmt.Sprintf("t=%d pause type=%q tenant=%q scope=%s until=%d", op.at, op.req.Key.TaskType, op.req.Key.Tenant,
			op.req.Quotas[0].Scope, op.pause)
	case op.resume:
		return fmt.Sprintf("t=%d resume type=%q tenant=%q scope=%s", op.at, op.req.Key.TaskType, op.req.Key.Tenant, op.req.Quotas[0].Scope)
	}
	var quotas []string
	for _, q := range op.req.Quotas {
		quotas = append(quotas, q.String())
	}
	return fmt.Sprintf("t=%d %s type=%q tenant=%q quotas=[%s] cost=%d member=%q token=%q w=%d p=%d wait=%v claim=%v timeout=%v spread=%v -> %s",
		op.at, op.why, op.req.Key.TaskType, op.req.Key.Tenant, strings.Join(quotas, " "), op.req.Cost, op.req.Member,
		op.req.Reservation, op.req.Weight, op.req.Priority, op.req.MaxWait, op.req.ClaimWait, op.req.ClaimTimeout, op.req.Spread, op.decision)
}

// pauseOp makes op, a pause or a resume, on the script and the model, and returns the TTLs
// the model says it sets and the server's clock before the call.
func pauseOp(ctx context.Context, fail func(string, ...any), l *throttle.Limiter, m *model, op modelOp) (modelTTLs, int64) {
	id := modelLogOf(op.req.Key, op.req.Quotas[0].Scope)
	ttls, serverMS := modelTTLs{}, time.Now().UnixMilli() // before the call, as for a decision
	if op.resume {
		want := m.resume(id)
		if got, err := l.Resume(ctx, op.req.Key, op.req.Quotas[0].Scope); err != nil || got != want {
			fail("Resume = %v, %v; the model says %v", got, err, want)
		}
		return ttls, serverMS
	}
	if ttl := m.pause(id, op.pause, op.at); ttl > 0 {
		lk, _, _ := id.keys(throttle.DefaultPrefix)
		ttls[lk] = ttl
	}
	if err := l.PauseAt(ctx, op.req.Key, op.req.Quotas[0].Scope, time.UnixMilli(op.pause), time.UnixMilli(op.at)); err != nil {
		fail("PauseAt: %v", err)
	}
	return ttls, serverMS
}

// modelTenants are tenant ids, several of them chosen to break a key or to look like
// another one; modelWeights gives some of them a fair-share weight other than 1.
var (
	modelTenants = []string{"acme", "", "{", "}", "{acme}", ":", "a:tenant:b", "%41", "A", "ü", "a b", "x}:type", "pending:x"}
	modelWeights = map[string]int{"acme": 3, "A": 2, "ü": 5}
)

// modelType is one task type and its rule.
type modelType struct {
	name   string
	quotas []throttle.Quota // nil: a new random set for every request, as while rules change
	big    bool             // large limits and costs: long backlogs, the scan and renumber bounds
	unit   bool             // every event of cost 1: the script's one-log path
	// tier, if set, are quotas a tenant with a weight (modelWeights) has before the rule's,
	// as a "pro" tier's tenant= quota and weight= beside a rule of type= quotas alone.
	tier []throttle.Quota
	// replaces: the tier's quotas take the place of the rule's tenant= quotas instead (a
	// tier with its own tenant= quota on a rule that has one): both tiers' tenants then
	// reserve on the same scopes under different tenant quotas.
	replaces bool
}

// quotasFor returns the quotas of a request of tenant on the type.
func (typ modelType) quotasFor(tenant string) []throttle.Quota {
	switch {
	case typ.tier == nil || modelWeights[tenant] == 0:
		return typ.quotas
	case typ.replaces:
		var qs []throttle.Quota
		for _, q := range typ.quotas {
			if q.Scope == throttle.ScopeTenant {
				qs = append(qs, typ.tier...)
			} else {
				qs = append(qs, q)
			}
		}
		return qs
	}
	return append(slices.Clone(typ.tier), typ.quotas...)
}

// modelUnit is the generator's unit of time, in ms. Windows are 1-50 units and the clock
// moves 0-20 units a step; a TTL, which Redis runs on its real clock, is never under 100ms
// (Redis 7.0 can expire a key with a 1ms TTL inside the MULTI/EXEC that sets it and reads
// it back). Probes 1ms before RetryAt and instants off the grid keep decisions exact to
// the millisecond.
const modelUnit = 100

// modelGen generates the calls of one seed.
type modelGen struct {
	rng     *rand.Rand
	types   []modelType
	now     int64
	n       int
	past    []modelOp // recent requests, to retry with the same member
	waiting []modelOp // requests holding a reservation, to come back or be released
	plan    []modelOp // calls to make next, before any other
	backs   []modelOp // reserved tasks that come back around their instant, at op.at
	// off is, per log, the latest instant it held after a call under other quotas than
	// its rule's (a halved window, other scopes, a higher limit): checkLimits checks only
	// the windows that start after it.
	off map[modelLog]int64
}

func newModelGen(seed uint64) *modelGen {
	g := &modelGen{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), now: 1_700_000_000_000, off: map[modelLog]int64{}}
	g.types = []modelType{
		{name: "api:call", quotas: []throttle.Quota{g.quota(throttle.ScopeTenant)}},
		{name: "{mail}", quotas: []throttle.Quota{g.quota(throttle.ScopeTenant), g.quota(throttle.ScopeType)}},
		{name: "report:pending:x", quotas: []throttle.Quota{g.quota(throttle.ScopeType), g.quota(throttle.ScopeTenant), g.quota(throttle.ScopeTenant)}},
		{name: "}{", quotas: nil},
		{name: "sms", unit: true, quotas: []throttle.Quota{g.quota(throttle.ScopeTenant)}},
		{name: "sync", unit: true, quotas: []throttle.Quota{g.quota(throttle.ScopeType)}},
		{name: "llm", big: true, quotas: []throttle.Quota{
			{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 20 + g.rng.IntN(40), Window: msDuration((10 + g.rng.Int64N(20)) * modelUnit)}},
			{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 80 + g.rng.IntN(100), Window: msDuration((5 + g.rng.Int64N(20)) * modelUnit)}}}},
		{name: "tiered", unit: true, quotas: []throttle.Quota{{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 2 + g.rng.IntN(3), Window: msDuration(10 * modelUnit)}}},
			tier: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 6, Window: msDuration(10 * modelUnit)}}}},
		// A free tier's long tenant window and a pro tier's short one, on one type quota.
		{name: "tiers", unit: true, replaces: true, quotas: []throttle.Quota{
			{Scope: throttle.ScopeType, Limit: throttle.Limit{Events: 2 + g.rng.IntN(3), Window: msDuration(10 * modelUnit)}},
			{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 2, Window: msDuration(60 * modelUnit)}}},
			tier: []throttle.Quota{{Scope: throttle.ScopeTenant, Limit: throttle.Limit{Events: 6, Window: msDuration(5 * modelUnit)}}}},
	}
	return g
}

// quota returns a random quota at scope: 1-8 events per 1-50 units, with a few windows
// made likely so that quotas tie.
func (g *modelGen) quota(scope throttle.Scope) throttle.Quota {
	w := 1 + g.rng.Int64N(50)
	if g.rng.IntN(2) == 0 {
		w = []int64{5, 10, 20}[g.rng.IntN(3)]
	}
	return throttle.Quota{Scope: scope, Limit: throttle.Limit{Events: 1 + g.rng.IntN(8), Window: msDuration(w * modelUnit)}}
}

func (g *modelGen) member() string {
	g.n++
	return fmt.Sprintf([]string{"m%d", "1:x%d", "x%d:2", "{y%d}", "ü%d"}[g.rng.IntN(5)], g.n)
}

func (g *modelGen) token() string {
	g.n++
	return fmt.Sprintf([]string{"T%d", "T:%d", "T{%d}", "T@%d", "9:%d"}[g.rng.IntN(5)], g.n)
}

// waits gives a request the caller's horizons and claim timeout.
func (g *modelGen) waits(req *throttle.Request) {
	if g.rng.IntN(3) == 0 {
		req.MaxWait = msDuration(g.rng.Int64N(5) * modelUnit)
	}
	if g.rng.IntN(2) == 0 {
		req.ClaimWait = msDuration(g.rng.Int64N(20) * modelUnit)
	}
	if g.rng.IntN(2) == 0 {
		req.ClaimTimeout = msDuration((1 + g.rng.Int64N(40)) * modelUnit)
	}
	req.Weight = modelWeights[req.Key.Tenant]
	if g.rng.IntN(4) == 0 { // a task from a higher-priority queue (package worker's QueuePriority)
		req.Priority = 1 + g.rng.IntN(3)
	}
	req.Holder = fmt.Sprintf("q%d/%s", g.rng.IntN(3), req.Reservation)
	req.Spread = g.rng.IntN(3) == 0 // a worker with a bounded Concurrency (package worker)
}

// next returns the next call.
func (g *modelGen) next(m *model) modelOp {
	if len(g.plan) > 0 {
		op := g.plan[0]
		g.plan = g.plan[1:]
		g.now = max(g.now, op.at)
		op.at = g.now
		return op
	}
	if i := slices.IndexFunc(g.backs, func(b modelOp) bool { return b.at <= g.now+20*modelUnit }); i >= 0 {
		op := g.backs[i]
		g.backs = slices.Delete(g.backs, i, i+1)
		g.now = max(g.now, op.at)
		op.at = g.now
		return g.underRule(op)
	}
	switch r := g.rng.IntN(100); {
	case r < 5: // a caller whose clock is behind
		g.now -= (1 + g.rng.Int64N(60)) * modelUnit
	case r < 8: // a pause: most windows empty out
		g.now += (50 + g.rng.Int64N(200)) * modelUnit
	default:
		g.now += g.rng.Int64N(21) * modelUnit
	}
	if g.rng.IntN(10) == 0 { // off the grid
		g.now += g.rng.Int64N(5) - 2
	}
	switch r := g.rng.IntN(100); {
	case r < 6 && len(g.past) > 0: // a call retried with the same member (its reply was lost)
		op := g.past[g.rng.IntN(len(g.past))]
		return modelOp{req: op.req, at: g.now, why: "again(" + op.why + ")"}
	case r < 20 && len(g.waiting) > 0: // a task with a reservation comes back, early, on time or late
		i := g.rng.IntN(len(g.waiting))
		w := g.waiting[i]
		req := w.req
		req.Member = g.member()
		at := w.at + w.decision.RetryAfter.Milliseconds()
		switch g.rng.IntN(5) {
		case 0:
			at -= g.rng.Int64N(25 * modelUnit)
		case 1:
			at += g.rng.Int64N(3) - 1
		case 2:
			at += g.rng.Int64N(50 * modelUnit)
		default:
			at = g.now
		}
		g.now = max(g.now, at)
		return g.underRule(modelOp{req: req, at: g.now, why: "back"})
	case r < 23 && len(g.waiting) > 0: // its task was deleted: the sweeper releases it
		w := g.waiting[g.rng.IntN(len(g.waiting))]
		return modelOp{req: w.req, at: g.now, release: true, why: "release"}
	case r < 25: // an upstream 429: a tenant's or a type's log paused, or the pause lifted
		typ := g.types[g.rng.IntN(len(g.types))]
		for typ.quotas == nil { // one with a fixed rule
			typ = g.types[g.rng.IntN(len(g.types))]
		}
		key := throttle.Key{TaskType: typ.name, Tenant: modelTenants[g.rng.IntN(len(modelTenants))]}
		scope := typ.quotas[g.rng.IntN(len(typ.quotas))].Scope
		op := modelOp{req: throttle.Request{Key: key, Quotas: []throttle.Quota{{Scope: scope}}}, at: g.now, why: "pause"}
		if g.rng.IntN(4) == 0 {
			op.resume = true
			return op
		}
		op.pause = g.now + (1+g.rng.Int64N(30))*modelUnit
		if g.rng.IntN(5) == 0 {
			op.pause = g.now - g.rng.Int64N(5*modelUnit) // already over: nothing to do
		}
		// Its tasks keep coming: during the pause, 1ms before its end, at it and after it, past
		// the limit (the past pause then still sits in the log, among the sentinels).
		ats := []int64{g.now + g.rng.Int64N(max(op.pause-g.now, 1)), op.pause - 1, op.pause}
		for range g.rng.IntN(10) {
			ats = append(ats, op.pause+g.rng.Int64N(3*modelUnit))
		}
		for _, at := range ats {
			req := throttle.Request{Key: key, Quotas: typ.quotasFor(key.Tenant), Cost: 1, Member: g.member()}
			if g.rng.IntN(2) == 0 {
				req.Reservation = g.token()
			}
			g.waits(&req)
			g.plan = append(g.plan, modelOp{req: req, at: at, why: "afterPause"})
		}
		return op
	}
	typ := g.types[g.rng.IntN(len(g.types))]
	if r := g.rng.IntN(100); typ.unit && r < 20 || (r < 3 || typ.big && r < 25) && typ.quotas != nil && slices.ContainsFunc(typ.quotas, func(q throttle.Quota) bool { return q.Scope == throttle.ScopeType }) {
		// A backlog: one tenant's burst of tasks at once, then other tenants' few, all with
		// reservations: what the fair share on a type-wide quota is for (and, on a tenant
		// quota, a packed run of reservations).
		tenants := g.rng.Perm(len(modelTenants))
		n := 4 + g.rng.IntN(12)
		if typ.big {
			n = 20 + g.rng.IntN(130)
		}
		for i := range n {
			tenant := modelTenants[tenants[0]]
			if i >= n/2+g.rng.IntN(n/2) {
				tenant = modelTenants[tenants[1+g.rng.IntN(2)]]
			}
			req := throttle.Request{Key: throttle.Key{TaskType: typ.name, Tenant: tenant}, Quotas: typ.quotasFor(tenant),
				Cost: 1, Member: g.member(), Reservation: g.token()}
			if typ.big && g.rng.IntN(2) == 0 {
				req.Cost = 1 + g.rng.IntN(6)
			}
			g.waits(&req)
			g.plan = append(g.plan, modelOp{req: req, at: g.now + g.rng.Int64N(3), why: "burst"})
		}
		return g.next(m)
	}
	quotas := typ.quotas
	if quotas == nil {
		for range 1 + g.rng.IntN(3) {
			quotas = append(quotas, g.quota([]throttle.Scope{throttle.ScopeTenant, throttle.ScopeType}[g.rng.IntN(2)]))
		}
	}
	most := quotas[0].Limit.Events
	for _, q := range quotas {
		most = min(most, q.Limit.Events)
	}
	key := throttle.Key{TaskType: typ.name, Tenant: modelTenants[g.rng.IntN(len(modelTenants))]}
	if typ.tier != nil {
		quotas = typ.quotasFor(key.Tenant)
		most = min(most, quotas[0].Limit.Events)
	}
	if st := m.logs[modelLogOf(key, quotas[0].Scope)]; st != nil && len(st.entries) > 0 && g.rng.IntN(10) == 0 {
		// At the boundary: when an entry leaves the first quota's window, or 1ms before.
		g.now = max(g.now, st.entries[g.rng.IntN(len(st.entries))].score+quotas[0].Limit.Window.Milliseconds()-g.rng.Int64N(2))
	}
	req := throttle.Request{Key: key, Quotas: quotas, Cost: 1 + g.rng.IntN(min(most, 8)), Member: g.member()}
	if g.rng.IntN(4) == 0 || typ.unit {
		req.Cost = g.rng.IntN(2) // 0: the default, 1
	}
	switch g.rng.IntN(6) {
	case 0, 1, 2:
		req.Reservation = g.token()
	case 3: // the same id for both, as a caller may pass a task id as each
		req.Reservation = req.Member
	}
	g.waits(&req)
	// A third are fresh, as the middleware's (an empty Member): never looked for, never
	// retried.
	req.Fresh = g.rng.IntN(3) == 0
	return modelOp{req: req, at: g.now, why: "new"}
}

// done records op's decision. After a denial without a reservation it sometimes plans the
// same event 1ms before RetryAt (denied, RetryAfter 1ms, if nothing changes meanwhile)
// and at RetryAt (admitted if nothing is decided in between: rule 4).
func (g *modelGen) done(op modelOp) {
	if op.pause > 0 || op.resume {
		return
	}
	if op.release {
		g.waiting = slices.DeleteFunc(g.waiting, func(w modelOp) bool { return w.req.Reservation == op.req.Reservation })
		return
	}
	if !op.req.Fresh {
		g.past = append(g.past, op)
	}
	if len(g.past) > 50 {
		g.past = g.past[1:]
	}
	tok := op.req.Reservation
	g.waiting = slices.DeleteFunc(g.waiting, func(w modelOp) bool { return tok != "" && w.req.Reservation == tok })
	g.backs = slices.DeleteFunc(g.backs, func(w modelOp) bool { return tok != "" && w.req.Reservation == tok })
	if op.decision.Reserved {
		g.waiting = append(g.waiting, op)
		if len(g.waiting) > 200 {
			g.waiting = g.waiting[1:]
		}
		if g.rng.IntN(4) != 0 { // it comes back around its instant, as a woken task does
			back := op
			back.req.Member = g.member()
			back.why = "back@"
			at := op.at + op.decision.RetryAfter.Milliseconds()
			switch g.rng.IntN(4) {
			case 0: // early, within its claim wait or not
				at -= g.rng.Int64N(op.req.ClaimWait.Milliseconds() + 3*modelUnit)
			case 1: // on time, or 1ms off
				at += g.rng.Int64N(3) - 1
			case 2: // late, within its claim timeout or not
				at += g.rng.Int64N(op.req.ClaimTimeout.Milliseconds() + 10*modelUnit)
			case 3: // early by the time it would wait in its handler
				at -= op.req.ClaimWait.Milliseconds()
			}
			back.at = at
			g.backs = append(g.backs, back)
		}
	}
}

// rescope returns op, a task coming back for its reservation, one time in six with
// another claim timeout (shorter than a window, perhaps), and one time in four under
// other scopes, as a tier or an override that moved the tenant does: one quota's scope
// flipped (tenant= and type=), one dropped, or one of the other scope added. Its token's
// reservation then waits on logs the call does not carry, or the call carries logs where
// it waits nowhere.
func (g *modelGen) rescope(op modelOp) modelOp {
	if g.rng.IntN(6) == 0 {
		op.req.ClaimTimeout = msDuration((1 + g.rng.Int64N(40)) * modelUnit)
		op.why += ",ct"
	}
	if g.rng.IntN(4) != 0 {
		return op
	}
	quotas := slices.Clone(op.req.Quotas)
	other := func(s throttle.Scope) throttle.Scope {
		if s == throttle.ScopeType {
			return throttle.ScopeTenant
		}
		return throttle.ScopeType
	}
	switch i := g.rng.IntN(len(quotas)); g.rng.IntN(3) {
	case 0:
		quotas[i].Scope = other(quotas[i].Scope)
	case 1:
		if len(quotas) > 1 {
			quotas = slices.Delete(quotas, i, i+1)
		} else {
			quotas[0].Scope = other(quotas[0].Scope)
		}
	case 2:
		q := quotas[i]
		q.Scope = other(q.Scope)
		if len(quotas) < 3 {
			quotas = append(quotas, q)
		} else {
			quotas[0] = q
		}
	}
	op.req.Quotas = quotas
	op.why += ",rescoped"
	return op
}

// underRule returns op, a task coming back for its reservation, perhaps rescoped, and one
// time in eight under a rule that lowered its limits since it reserved (same scopes, each
// limit above the task's cost cut to cost to limit-1), as a tier or override does: its
// claim must still fit. One such rule in four also halves a window of 200ms or more (to
// the ms): a call under it trims its logs by the shorter window, dropping entries, and
// perhaps reservations, that the rule's own window still counts (see checkLimits).
func (g *modelGen) underRule(op modelOp) modelOp {
	op = g.rescope(op)
	if g.rng.IntN(8) != 0 {
		return op
	}
	cost := max(op.req.Cost, 1)
	quotas := slices.Clone(op.req.Quotas)
	for i := range quotas {
		if n := quotas[i].Limit.Events; n > cost {
			quotas[i].Limit.Events = cost + g.rng.IntN(n-cost)
		}
	}
	op.why += ",lowered"
	if i := g.rng.IntN(4 * len(quotas)); i < len(quotas) && quotas[i].Limit.Window >= 2*modelUnit*time.Millisecond {
		quotas[i].Limit.Window = msDuration(quotas[i].Limit.Window.Milliseconds() / 2)
		op.why += ",shorter"
	}
	op.req.Quotas = quotas
	return op
}

// modelKeys lists every key of the task types of the model and of op: what the test
// compares after each call.
func modelKeys(m *model, prefix string, taskType string, op modelOp) []string {
	set := map[string]bool{}
	base := prefix + ":{" + url.PathEscape(taskType) + "}:"
	for _, k := range []string{base + "leases", base + "fair", base + "fairstate"} {
		set[k] = true
	}
	for id := range m.logs {
		if id.taskType == taskType {
			l, p, c := id.keys(prefix)
			set[l], set[p], set[c] = true, true, true
		}
	}
	if !op.release || op.pause > 0 || op.resume {
		for _, q := range op.req.Quotas {
			l, p, c := modelLogOf(op.req.Key, q.Scope).keys(prefix)
			set[l], set[p], set[c] = true, true, true
		}
	}
	return slices.Sorted(maps.Keys(set))
}

var leaseCreated = regexp.MustCompile(`^((?:p\d+:)?\d+:[^:]+:)\d+:`)

// checkKeys compares every observed key with the model.
func checkKeys(fail func(string, ...any), m *model, prefix, taskType string, call observedCall, ttls modelTTLs, serverMS int64) {
	base := prefix + ":{" + url.PathEscape(taskType) + "}:"
	want := map[string]observedKey{}
	for id, st := range m.logs {
		if id.taskType != taskType {
			continue
		}
		l, p, c := id.keys(prefix)
		var lz, pz, cz []redis.Z
		if st.hw >= 0 {
			h, f, hasF := st.sentinels()
			lz = append(lz, redis.Z{Score: h, Member: "#"})
			if hasF {
				lz = append(lz, redis.Z{Score: f, Member: "#f"})
			}
		}
		if st.pause >= 0 {
			lz = append(lz, redis.Z{Score: float64(st.pause - modelBase), Member: "#p"})
		}
		for _, e := range st.entries {
			lz = append(lz, redis.Z{Score: float64(e.score), Member: e.name})
		}
		for pm, s := range st.pending {
			pz = append(pz, redis.Z{Score: float64(s), Member: pm})
		}
		for _, e := range st.entries.weighted() {
			cz = append(cz, redis.Z{Score: float64(e.score), Member: fmt.Sprintf("%016d|%s", e.cum, e.cname)})
		}
		want[l], want[p], want[c] = observedKey{zset: lz}, observedKey{zset: pz}, observedKey{zset: cz}
	}
	leases := map[string]string{}
	for tok, l := range m.leases[taskType] {
		leases[tok] = l.String()
	}
	fair := []redis.Z{}
	for tok, tag := range m.fairq[taskType] {
		fair = append(fair, redis.Z{Score: float64(tag), Member: tok})
	}
	want[base+"leases"] = observedKey{hash: leases}
	want[base+"fair"] = observedKey{zset: fair}
	want[base+"fairstate"] = observedKey{hash: maps.Clone(m.fairh[taskType])}
	for k, o := range call.keys {
		w := want[k]
		if isHashKey(k) {
			got := o.hash
			if strings.HasSuffix(k, "}:leases") {
				got = map[string]string{}
				for tok, rec := range o.hash {
					got[tok] = leaseCreated.ReplaceAllString(rec, "$1")
				}
			}
			if len(got) != len(w.hash) || !maps.Equal(got, w.hash) {
				fail("%s differs:\nscript %v\nmodel  %v", k, got, w.hash)
			}
			checkTTL(fail, k, o, ttls, len(got) > 0, serverMS)
			continue
		}
		sortZ(w.zset)
		if !slices.Equal(o.zset, w.zset) {
			fail("%s differs:\nscript %v\nmodel  %v", k, o.zset, w.zset)
		}
		checkTTL(fail, k, o, ttls, len(o.zset) > 0, serverMS)
	}
}

// sortZ sorts as a sorted set does: by score, then member.
func sortZ(z []redis.Z) {
	sort.Slice(z, func(i, j int) bool {
		if z[i].Score != z[j].Score {
			return z[i].Score < z[j].Score
		}
		return z[i].Member.(string) < z[j].Member.(string)
	})
}

// checkTTL checks the TTL of one key: as the model says if the call set it, else none
// (-1, PERSISTed after the call that set it), or no key (-2) if it is empty.
func checkTTL(fail func(string, ...any), key string, o observedKey, ttls modelTTLs, exists bool, serverMS int64) {
	ttl, set := ttls[key]
	switch {
	case !exists && (o.pttl != -2 || o.expireTime != -2):
		fail("%s: PTTL %d, PEXPIRETIME %d for an empty key; want -2 (no key)", key, o.pttl, o.expireTime)
	case exists && set && (o.pttl > ttl || o.expireTime-serverMS < ttl):
		fail("%s: PTTL %d ms, PEXPIRETIME - TIME %d ms; want the TTL set to %d ms in between", key, o.pttl, o.expireTime-serverMS, ttl)
	case exists && !set && (o.pttl != -1 || o.expireTime != -1):
		fail("%s: PTTL %d, PEXPIRETIME %d; want -1 (no PEXPIRE in this call)", key, o.pttl, o.expireTime)
	}
}

// offRule reports whether op is decided under other quotas than its tenant's rule
// (modelType.quotasFor): other scopes, windows, a quota more or less, or a higher limit.
// A lower limit is on the rule: it admits no more than the rule would.
func offRule(types []modelType, op modelOp) bool {
	for _, typ := range types {
		if typ.name != op.req.Key.TaskType {
			continue
		}
		want := typ.quotasFor(op.req.Key.Tenant)
		if len(want) != len(op.req.Quotas) {
			return true
		}
		for i, q := range op.req.Quotas {
			if q.Scope != want[i].Scope || q.Limit.Window != want[i].Limit.Window || q.Limit.Events > want[i].Limit.Events {
				return true
			}
		}
	}
	return false
}

// markOff records, after op, the latest instant of each log op wrote when op was
// decided off its rule (offRule): the windows of the rule that start after it hold only
// what calls under the rule decided.
func (g *modelGen) markOff(m *model, op modelOp) {
	if op.release || op.pause > 0 || op.resume || !offRule(g.types, op) {
		return
	}
	for _, q := range op.req.Quotas {
		id := modelLogOf(op.req.Key, q.Scope)
		if st := m.logs[id]; st != nil {
			g.off[id] = max(g.off[id], st.hiw, st.hw)
		}
	}
}

// checkLimits is the model's own check that no window of a fixed rule holds more than its
// limit, whatever was decided: each log under the quotas of its scope that its tenant's
// requests carry (the type log under the rule's), in every window that starts after the
// log's latest instant when a call off the rule wrote it (off: such a call, a halved
// window or other scopes, may admit more in the rule's window, or trim what it counts).
func checkLimits(fail func(string, ...any), m *model, types []modelType, off map[modelLog]int64) {
	for _, typ := range types {
		for id, st := range m.logs {
			if id.taskType != typ.name {
				continue
			}
			since, changed := off[id]
			for _, q := range typ.quotasFor(id.tenant) {
				if q.Scope != id.scope {
					continue
				}
				w := q.Limit.Window.Milliseconds()
				for _, e := range st.entries {
					if changed && e.score-w < since {
						continue
					}
					if n := st.entries.sum(e.score-w, e.score); n > q.Limit.Events {
						fail("log %+v holds %d slots in the window (%d, %d] of %s, over its limit %d", id, n, e.score-w, e.score, q.Limit.Window, q.Limit.Events)
					}
				}
			}
		}
	}
}

func TestLimiter_AllowAt_matchesModel(t *testing.T) {
	t.Parallel()
	seeds := modelSeeds
	if *modelSeed != 0 {
		seeds = []uint64{*modelSeed}
	}
	var mu sync.Mutex
	total := map[string]int{}
	for _, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			stats := runModel(t, seed, *modelSteps)
			mu.Lock()
			defer mu.Unlock()
			for k, v := range stats {
				total[k] += v
			}
		})
	}
	// Parallel subtests end after this function: the coverage is checked at cleanup.
	t.Cleanup(func() {
		t.Logf("cases over the seeds: %v", total)
		if *modelSeed != 0 || t.Failed() {
			return
		}
		for _, c := range []string{"admitted", "admittedAhead", "replay", "denied", "reserved", "heldNotDue",
			"claimed", "cost>1", "multiQuota", "deniedBy2nd+", "lapse", "lateClaim", "claimRefit", "fairSwapTypeOnly", "fairSwapOtherTier", "fairSwapTiered", "fairSwap", "oneLogFairSwap", "ghost", "candidate", "gapSlot", "endSlot",
			"oneLogReserved", "oneLogTypeReserved", "pause", "paused", "resume", "fresh", "prioSwap", "prioAdmit", "fairSkipsPriority", "fairSkipsEarlierTag", "fairNextTag", "shorter", "rescoped", "spaced", "oneLogSpaced"} {
			if total[c] == 0 {
				t.Errorf("the fixed seeds never reach case %q: the model and the script are not compared there", c)
			}
		}
	})
}

// runModel makes steps calls of seed on a fresh server and the model, and compares them.
func runModel(t *testing.T, seed uint64, steps int) map[string]int {
	rdb := &observingClient{Client: redistest.Start(t)}
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	m := newModel(throttle.DefaultPrefix)
	g := newModelGen(seed)
	stats := map[string]int{}
	var trace []string
	ctx := context.Background()
	for i := range steps {
		op := g.next(m)
		rdb.watch = modelKeys(m, throttle.DefaultPrefix, op.req.Key.TaskType, op)
		rdb.calls = nil
		fail := func(format string, a ...any) {
			t.Helper()
			start := max(0, len(trace)-40)
			t.Fatalf("seed %d step %d: %s: %s\nlast calls (-> the model's decision):\n  %s", seed, i, op, fmt.Sprintf(format, a...),
				strings.Join(trace[start:], "\n  "))
		}
		var ttls modelTTLs
		var serverMS int64
		switch {
		case op.pause > 0 || op.resume:
			ttls, serverMS = pauseOp(ctx, fail, l, m, op)
			stats[map[bool]string{true: "resume", false: "pause"}[op.resume]]++
		case op.release:
			want := m.release(op.req.Key.TaskType, op.req.Reservation)
			got, err := l.Release(ctx, op.req.Key.TaskType, op.req.Reservation)
			if err != nil || got != want {
				fail("Release = %v, %v; the model says %v", got, err, want)
			}
			ttls = modelTTLs{}
			serverMS = time.Now().UnixMilli()
			stats["release"]++
		default:
			op.decision, ttls = m.decide(op.req, op.at)
			serverMS = time.Now().UnixMilli() // the server's clock is this machine's: before the call
			d, err := l.AllowAt(ctx, op.req, time.UnixMilli(op.at))
			if err != nil {
				fail("AllowAt: %v", err)
			}
			if got := modelDecisionOf(d); got != op.decision {
				trace = append(trace, op.String())
				fail("decisions differ:\nscript %s\nmodel  %s", got, op.decision)
			}
			countModelCase(stats, op)
		}
		trace = append(trace, op.String())
		if len(rdb.calls) != 1 {
			fail("%d script calls observed, want 1", len(rdb.calls))
		}
		checkKeys(fail, m, throttle.DefaultPrefix, op.req.Key.TaskType, rdb.calls[0], ttls, serverMS)
		g.markOff(m, op)
		checkLimits(fail, m, g.types, g.off)
		g.done(op)
	}
	maps.Copy(stats, m.notes)
	return stats
}

// countModelCase counts the kinds of calls a run made.
func countModelCase(stats map[string]int, op modelOp) {
	d := op.decision
	inc := func(c string, cond bool) {
		if cond {
			stats[c]++
		}
	}
	inc("admitted", d.Allowed && !d.Replay)
	inc("admittedAhead", d.Allowed && d.Delay > 0)
	inc("replay", d.Replay)
	inc("denied", !d.Allowed && !d.Reserved)
	inc("reserved", d.Reserved && !d.Held)
	inc("heldNotDue", d.Reserved && d.Held)
	inc("claimed", d.Allowed && d.Held)
	inc("cost>1", op.req.Cost > 1)
	inc("multiQuota", len(op.req.Quotas) > 1)
	inc("deniedBy2nd+", !d.Allowed && d.Quota != op.req.Quotas[0])
	// One quota, cost 1, a reservation token: the script's one-log path, or its hand-over.
	oneLog := len(op.req.Quotas) == 1 && op.req.Cost <= 1 && op.req.Reservation != ""
	inc("oneLogReserved", oneLog && d.Reserved && !d.Held)
	inc("fresh", op.req.Fresh)
	inc("shorter", strings.HasSuffix(op.why, ",shorter"))  // a window a rule change halved (underRule)
	inc("rescoped", strings.Contains(op.why, ",rescoped")) // a reserved task back under other scopes (rescope)
	inc("oneLogTypeReserved", oneLog && d.Reserved && !d.Held && op.req.Quotas[0].Scope == throttle.ScopeType)
}

// modelStep is one call of a fixed sequence, with, for the calls that matter, the decision
// the contract asks for.
type modelStep struct {
	at      int64
	tenant  string
	quotas  []throttle.Quota
	cost    int
	member  string
	token   string
	weight  int
	prio    int   // Priority
	wait    int64 // MaxWait, ms
	claim   int64 // ClaimWait, ms
	timeout int64 // ClaimTimeout, ms
	release bool
	pause   int64          // > 0: pause the log of quotas[0]'s scope until then (at: now)
	resume  bool           // lift the pause of the log of quotas[0]'s scope
	want    *modelDecision // nil: whatever the model decides
}

// checkSequence makes the calls of steps on a fresh server for task type "api:call" and
// requires of each the model's decision, keys and TTLs, and of a step with want, that
// the model's decision is want (so the expectation is written out, not only computed).
func checkSequence(t *testing.T, steps []modelStep) *model {
	t.Helper()
	rdb := &observingClient{Client: redistest.Start(t)}
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	m := newModel(throttle.DefaultPrefix)
	var trace []string
	for i, s := range steps {
		op := modelOp{req: throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: s.tenant}, Quotas: s.quotas,
			Cost: s.cost, Member: s.member, Reservation: s.token, Weight: s.weight, Priority: s.prio, MaxWait: msDuration(s.wait),
			ClaimWait: msDuration(s.claim), ClaimTimeout: msDuration(s.timeout)}, at: s.at, why: "step", release: s.release,
			pause: s.pause, resume: s.resume}
		if op.req.Member == "" {
			op.req.Member = fmt.Sprintf("m%d", i)
		}
		rdb.watch = modelKeys(m, throttle.DefaultPrefix, "api:call", op)
		rdb.calls = nil
		fail := func(format string, a ...any) {
			t.Helper()
			t.Fatalf("step %d: %s\nsteps (-> the contract's decision):\n  %s", i, fmt.Sprintf(format, a...), strings.Join(trace, "\n  "))
		}
		var ttls modelTTLs
		var serverMS int64
		if s.pause > 0 || s.resume {
			ttls, serverMS = pauseOp(context.Background(), fail, l, m, op)
			trace = append(trace, op.String())
		} else if s.release {
			want := m.release("api:call", s.token)
			if got, err := l.Release(context.Background(), "api:call", s.token); err != nil || got != want {
				fail("Release = %v, %v; the model says %v", got, err, want)
			}
			ttls, serverMS = modelTTLs{}, time.Now().UnixMilli()
			trace = append(trace, op.String())
		} else {
			op.decision, ttls = m.decide(op.req, op.at)
			trace = append(trace, op.String())
			if s.want != nil && op.decision != *s.want {
				fail("the model decides %s, the test expects %s", op.decision, *s.want)
			}
			serverMS = time.Now().UnixMilli() // the server's clock is this machine's: before the call
			d, err := l.AllowAt(context.Background(), op.req, time.UnixMilli(op.at))
			if err != nil {
				fail("AllowAt: %v", err)
			}
			if got := modelDecisionOf(d); got != op.decision {
				fail("decisions differ:\nscript %s\nwant   %s", got, op.decision)
			}
		}
		if len(rdb.calls) != 1 {
			fail("%d script calls observed, want 1", len(rdb.calls))
		}
		checkKeys(fail, m, throttle.DefaultPrefix, "api:call", rdb.calls[0], ttls, serverMS)
	}
	return m
}

func msDuration(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

func msQuota(scope throttle.Scope, events int, windowMS int64) throttle.Quota {
	return throttle.Quota{Scope: scope, Limit: throttle.Limit{Events: events, Window: msDuration(windowMS)}}
}

var _ = strconv.Itoa
