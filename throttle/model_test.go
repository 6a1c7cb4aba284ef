package throttle_test

import (
	"cmp"
	"fmt"
	"math"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// A reference model of the limiter, written from the contract in lua/sliding_window.lua's
// header and README.md's "How it works" (the rule, reservations, fairness), not from the
// script's code: every window log, pending set, cost set, lease and fair tag is a plain
// Go value, every count is a plain sum of costs over a slice (no running sums), and the
// rule "an event fits at t iff every window containing t holds at most limit - cost" is a
// loop over windows. The stated bounds
// (K_SCAN entries read by an exact check, K_CAND instants tried, K_GAP bisection rounds
// for a slot before the end slot, K_ITER rounds, K_LAPSE
// lapses removed per call, K_RENUM running sums rewritten) are the contract's too, so the
// model applies them where the contract says. TestLimiter_AllowAt_matchesModel drives the
// model and a real redis-server with the same random calls and requires the same
// decisions, the same sets and the same TTLs after every call.

// The contract's bounds (lua/sliding_window.lua).
const (
	modelKScan  = 64
	modelKCand  = 4
	modelKIter  = 3
	modelKLapse = 8
	modelKRenum = 32
	modelKFair  = 8
	modelKPrio  = 8
	modelKGap   = 16
	modelFair   = 1_000_000
	modelBase   = 1 << 51 // sentinels score -2^51 + ...
	modelTrim   = 8       // the script's K_TRIM
)

// modelLog names one window log: a task type's (ScopeType, tenant "") or a tenant's.
type modelLog struct {
	taskType string
	scope    throttle.Scope
	tenant   string
}

func modelLogOf(key throttle.Key, scope throttle.Scope) modelLog {
	if scope == throttle.ScopeType {
		return modelLog{taskType: key.TaskType, scope: scope}
	}
	return modelLog{taskType: key.TaskType, scope: scope, tenant: key.Tenant}
}

// keys returns the Redis keys of the log, its pending set and its cost set.
func (id modelLog) keys(prefix string) (log, pending, costs string) {
	base := prefix + ":{" + url.PathEscape(id.taskType) + "}:"
	part := "type"
	if id.scope == throttle.ScopeTenant {
		part = "tenant:" + url.PathEscape(id.tenant)
	}
	return base + part, base + "pending:" + part, base + "costs:" + part
}

// modelEntry is one entry of a window log: one event, whatever its cost.
type modelEntry struct {
	score int64
	name  string // the L member: "<id>", "*<cost>:<id>", "@<cost>:<token>" or "~..."
	cost  int
	// For cost > 1, the entry's C member is "<cum>|<cname>"; entries at one instant are in C
	// in the order they were inserted (seq).
	cname string
	cum   int64
	seq   int64
}

// modelSet is a window log's entries in the order of a Redis sorted set: by score, then
// by member, byte by byte.
type modelSet []*modelEntry

func compareEntries(a, b *modelEntry) int {
	return cmp.Or(cmp.Compare(a.score, b.score), strings.Compare(a.name, b.name))
}

func (s modelSet) find(name string) *modelEntry {
	for _, e := range s {
		if e.name == name {
			return e
		}
	}
	return nil
}

// sum is the total cost of the entries scored in (a, b].
func (s modelSet) sum(a, b int64) int {
	n := 0
	for _, e := range s {
		if e.score > a && e.score <= b {
			n += e.cost
		}
	}
	return n
}

// weighted returns the entries of cost > 1 in their C order: by score, then by seq.
func (s modelSet) weighted() []*modelEntry {
	var w []*modelEntry
	for _, e := range s {
		if e.cost > 1 {
			w = append(w, e)
		}
	}
	slices.SortFunc(w, func(a, b *modelEntry) int { return cmp.Or(cmp.Compare(a.score, b.score), cmp.Compare(a.seq, b.seq)) })
	return w
}

// modelState is one log's state between calls.
type modelState struct {
	entries modelSet
	pending map[string]int64 // "<cost>:<token>" -> instant
	hw, hiw int64            // -1: never written
	flagC   bool             // C may hold entries
	flagP   bool             // P may hold entries
	pause   int64            // the "#p" member's instant: the end of a pause; -1: none
}

// modelLease is a lease record, without its creation instant (the server's clock).
type modelLease struct {
	cost     int
	scopes   string // "t" and "y" in log order, then "=" and the tenant log's quotas (tenantQuotas)
	holder   string
	tenant   string // escaped
	priority int    // Request.Priority
}

// leaseString is the lease record as the script writes it, without its creation instant.
func (l modelLease) String() string {
	prio := ""
	if l.priority > 0 {
		prio = "p" + strconv.Itoa(l.priority) + ":"
	}
	return fmt.Sprintf("%s%d:%s:%d:%s%s", prio, l.cost, l.scopes, len(l.holder), l.holder, l.tenant)
}

// model is every log and per-type record, in memory.
type model struct {
	notes  map[string]int // how often each path of the contract was taken
	prefix string
	logs   map[modelLog]*modelState
	leases map[string]map[string]modelLease // task type -> token -> lease
	fairq  map[string]map[string]int64      // task type -> token -> tag
	fairh  map[string]map[string]string     // task type -> "v", "l:<tenant>" -> value
	seq    int64
}

func newModel(prefix string) *model {
	return &model{notes: map[string]int{}, prefix: prefix, logs: map[modelLog]*modelState{}, leases: map[string]map[string]modelLease{},
		fairq: map[string]map[string]int64{}, fairh: map[string]map[string]string{}}
}

func (m *model) state(id modelLog) *modelState {
	s := m.logs[id]
	if s == nil {
		s = &modelState{pending: map[string]int64{}, hw: -1, hiw: -1, pause: -1}
		m.logs[id] = s
	}
	return s
}

func perType[V any](mm map[string]map[string]V, taskType string) map[string]V {
	if mm[taskType] == nil {
		mm[taskType] = map[string]V{}
	}
	return mm[taskType]
}

// modelQuota is a quota of a call on its log, in ms.
type modelQuota struct {
	index        int // in the request
	limit        int
	w            int64
	lo           int // the slots of the window ending at loAt, when last measured
	loAt         int64
	measuredOnce bool
}

// callLog is a log as one call sees it: its state and the call's quotas on it.
type callLog struct {
	m        *model
	id       modelLog
	st       *modelState
	q        []*modelQuota
	wmax     int64
	dirty    bool
	pRemoved bool
	lazy     bool // an admission by one of the script's fast paths: see finish
	other    bool // another tenant's log, a displaced reservation's: see finish
}

// costOf is the cost an L member stands for.
func costOf(name string) int {
	if name != "" && strings.ContainsRune("@*~", rune(name[0])) {
		n, _ := strconv.Atoi(name[1:strings.IndexByte(name, ':')])
		return n
	}
	return 1
}

// fits: cost c fits at t in every quota of the log (the contract's check, with its two
// bounds and K_SCAN).
func (cl *callLog) fits(t int64, c int) bool {
	for _, q := range cl.q {
		if !cl.qfits(q, t, c) {
			return false
		}
	}
	return true
}

// qfits: cost c fits at t in quota q of the log, as fits checks each.
func (cl *callLog) qfits(q *modelQuota, t int64, c int) bool {
	lo := cl.st.entries.sum(t-q.w, t)
	q.lo, q.loAt, q.measuredOnce = lo, t, true
	if lo+c > q.limit {
		return false
	}
	if hi := cl.st.entries.sum(t-q.w, t+q.w-1); hi+c > q.limit {
		cl.m.notes["exactCheck"]++
		if !cl.exact(q, t, c) {
			return false
		}
		cl.m.notes["exactCheckRoom"]++
	}
	return true
}

// exact: every window (x - w, x], t <= x < t + w, has room for c; if more than K_SCAN
// entries can share a window with t, no.
func (cl *callLog) exact(q *modelQuota, t int64, c int) bool {
	var near []*modelEntry
	for _, e := range cl.st.entries {
		if e.score > t-q.w && e.score <= t+q.w-1 {
			near = append(near, e)
		}
	}
	if len(near) > modelKScan {
		cl.m.notes["exactOverKScan"]++
		return false
	}
	for x := t; x < t+q.w; x++ { // every window: the model does not look for the fullest
		if modelSet(near).sum(x-q.w, x)+c > q.limit {
			return false
		}
	}
	return true
}

// endSlot: the first t >= t0 and >= the newest entry with room for c in every quota.
func (cl *callLog) endSlot(t0 int64, c int) int64 {
	es := cl.st.entries
	if len(es) == 0 {
		return t0
	}
	last := es[len(es)-1].score
	t := max(t0, last)
	for _, q := range cl.q {
		room := q.limit - c
		if es.sum(-1, last) <= room {
			continue
		}
		// The first entry instant y with at most room after it.
		for _, e := range es {
			if es.sum(e.score, last) <= room {
				t = max(t, e.score+q.w)
				break
			}
		}
	}
	return t
}

// earliestOn: t0 if c fits there, else the first of K_CAND distinct instants e + W (e an
// entry after t0 - W) before the end slot at which it fits, else the end slot.
func (cl *callLog) earliestOn(t0 int64, c int) int64 {
	if cl.fits(t0, c) {
		return t0
	}
	last := cl.endSlot(t0, c)
	var cands []int64
	for _, q := range cl.q {
		n := 0
		for _, e := range cl.st.entries {
			if e.score > t0-q.w && e.score+q.w < last && n < modelKCand {
				cands = append(cands, e.score+q.w)
				n++
			}
		}
	}
	slices.Sort(cands)
	cands = slices.Compact(cands)
	for i, t := range cands {
		if i == modelKCand {
			break
		}
		if cl.fits(t, c) {
			cl.m.notes["candidate"]++
			return t
		}
	}
	if t, ok := cl.gapSlot(t0, c, last); ok {
		cl.m.notes["gapSlot"]++
		return t
	}
	cl.m.notes["endSlot"]++
	return last
}

// gapSlot: on a log of cost-1 entries only (C never flagged) whose entries after t0 are
// sparse for every quota ((their count + limit) * W <= limit * (newest - t0): a window's
// worth of slots unused among them), a bisection over the entries after t0 for a
// prefix of the log (its entries up to index j) whose end slot c fits at in the whole
// log: lo starts before the first entry after t0 (no), hi at the newest (its end slot is
// last: yes); each round tries the middle and keeps the half that holds a yes, at most
// K_GAP rounds. Reports the slot of the final hi if it is earlier than last.
func (cl *callLog) gapSlot(t0 int64, c int, last int64) (int64, bool) {
	es := cl.st.entries
	if cl.st.flagC || len(es) == 0 {
		return 0, false
	}
	a := 0 // the first entry after t0
	for a < len(es) && es[a].score <= t0 {
		a++
	}
	b := len(es) - 1
	after, span := float64(b-a+1), float64(es[b].score-t0)
	for _, q := range cl.q {
		if (after+float64(q.limit))*float64(q.w) > float64(q.limit)*span {
			return 0, false
		}
	}
	// prefixEnd: the end slot of the entries up to index j (endSlot's, on them alone).
	prefixEnd := func(j int) int64 {
		t := max(t0, es[j].score)
		for _, q := range cl.q {
			if room := q.limit - c; j+1 > room {
				t = max(t, es[j-room].score+q.w)
			}
		}
		return t
	}
	lo, hi, best := a-1, b, last
	for range modelKGap {
		if hi-lo <= 1 {
			break
		}
		mid := (lo + hi) / 2
		if s := prefixEnd(mid); s < best && cl.fits(s, c) {
			hi, best = mid, s
		} else {
			lo = mid
		}
	}
	return best, best < last
}

// earliest: the logs take turns moving t to their earliest instant until all have room
// there, for at most K_ITER rounds; else the latest end slot.
func earliest(logs []*callLog, t0 int64, c int) int64 {
	t, settled := t0, 0
	for step := 0; step < modelKIter*len(logs); step++ {
		tj := logs[step%len(logs)].earliestOn(t, c)
		if tj > t {
			t, settled = tj, 1
		} else {
			settled++
		}
		if settled >= len(logs) {
			return t
		}
	}
	t = t0
	for _, cl := range logs {
		cl.m.notes["iterFallback"]++
		t = max(t, cl.endSlot(t0, c))
	}
	return t
}

// cRoom: at most K_RENUM weighted entries after s.
func (cl *callLog) cRoom(s int64) bool {
	n := 0
	for _, e := range cl.st.entries {
		if e.cost > 1 && e.score > s {
			n++
		}
	}
	return n <= modelKRenum
}

// put adds an entry; a weighted one gets its running sum as C would (base: the last
// weighted entry at or before s, else the one before the first after it, else 0) and
// shifts those after it.
func (m *model) put(cl *callLog, name string, s int64, c int) *modelEntry {
	e := &modelEntry{score: s, name: name, cost: c}
	if c > 1 {
		m.seq++
		e.cname, e.seq = name, m.seq
		w := cl.st.entries.weighted()
		var base int64
		var after []*modelEntry
		for _, x := range w {
			if x.score <= s {
				base = x.cum
			} else {
				after = append(after, x)
			}
		}
		if len(after) > 0 && !slices.ContainsFunc(w, func(x *modelEntry) bool { return x.score <= s }) {
			base = after[0].cum - int64(after[0].cost-1)
		}
		e.cum = base + int64(c-1)
		for _, x := range after {
			x.cum += int64(c - 1)
		}
		cl.st.flagC = true
	}
	if c == 1 { // ZADD of a member the log holds moves it: a fast path's lazily kept old entry
		cl.st.entries = slices.DeleteFunc(cl.st.entries, func(x *modelEntry) bool { return x.name == name })
	}
	i, _ := slices.BinarySearchFunc(cl.st.entries, e, compareEntries)
	cl.st.entries = slices.Insert(cl.st.entries, i, e)
	cl.st.hiw = max(cl.st.hiw, s)
	cl.dirty = true
	return e
}

// drop removes an entry; a weighted one with more than K_RENUM C entries after it stays,
// renamed "~<cost>:<token>@<s>", and keeps counting.
func (m *model) drop(cl *callLog, name string) {
	e := cl.st.entries.find(name)
	cl.dirty = true
	if e == nil {
		return
	}
	if e.cost > 1 {
		var after []*modelEntry
		for _, x := range cl.st.entries.weighted() {
			if x.score > e.score || x.score == e.score && x.seq > e.seq {
				after = append(after, x)
			}
		}
		if len(after) > modelKRenum {
			m.notes["ghost"]++
			rest := name[strings.IndexByte(name, ':')+1:]
			cl.st.entries = slices.DeleteFunc(cl.st.entries, func(x *modelEntry) bool { return x == e })
			e.name = "~" + strconv.Itoa(e.cost) + ":" + rest + "@" + strconv.FormatInt(e.score, 10)
			i, _ := slices.BinarySearchFunc(cl.st.entries, e, compareEntries)
			cl.st.entries = slices.Insert(cl.st.entries, i, e)
			return
		}
		for _, x := range after {
			x.cum -= int64(e.cost - 1)
		}
	}
	cl.st.entries = slices.DeleteFunc(cl.st.entries, func(x *modelEntry) bool { return x == e })
}

// finish trims at now - wmax, updates the sentinels' state and returns the TTL (ms) the
// call sets on the log (and on its P and C when they hold entries), or -1 if it wrote
// nothing to the log.
func (cl *callLog) finish(now, claimTimeout int64) int64 {
	if !cl.dirty {
		return -1
	}
	st := cl.st
	if st.pause >= 0 && st.pause <= now { // a past pause goes with the first write after it
		st.pause = -1
	}
	floor := now - cl.wmax
	// The fast paths trim only once K_TRIM entries have left the longest window; every
	// other write trims what has.
	old := 0
	for _, e := range st.entries {
		if e.score <= floor {
			old++
		}
	}
	// Another tenant's log (other) is not trimmed: its own windows may be longer.
	if !cl.other && (!cl.lazy || old >= modelTrim) {
		st.entries = slices.DeleteFunc(st.entries, func(e *modelEntry) bool { return e.score <= floor })
	}
	if !cl.other && st.flagC && len(st.entries.weighted()) == 0 {
		st.flagC = false
	}
	if cl.pRemoved && st.flagP && len(st.pending) == 0 {
		st.flagP = false
	}
	st.hw = max(st.hw, now)
	ttl := max(st.hiw, now) - now + cl.wmax
	if st.flagP {
		ttl += claimTimeout
	}
	cl.dirty = false
	return ttl
}

// modelCall is one request as the model decides it.
type modelCall struct {
	m                              *model
	req                            throttle.Request
	cost                           int
	caller, now                    int64
	token, holder, tenant, scopes  string // scopes: as a lease records them (modelLease)
	letters                        string // scopes' "t" and "y" alone
	wait, claimWait, claimTimeout  int64
	weight, priority               int
	logs                           []*callLog
	typeLog                        *callLog
	quotas                         []*modelQuota
	quotaLog                       []*callLog // the log of each quota
	leases                         map[string]modelLease
	fairq                          map[string]int64
	fairh                          map[string]string
	extra                          []*callLog // other tenants' logs written (a displaced reservation's)
	leasesTTL, fairTTL, fairHWrote bool
	horizon                        int64
}

// modelDecision is what the model decides: every field of a Decision it determines, as
// outcomeOf reads them from the script's.
type modelDecision = outcome

func modelDecisionOf(d throttle.Decision) modelDecision {
	return modelDecision{Allowed: d.Allowed, Replay: d.Replay, Reserved: d.Reserved, Held: d.Held, Paused: d.Paused, Quota: d.Quota,
		Count: d.Count, Remaining: d.Remaining, RetryAfter: d.RetryAfter, Delay: d.Delay, At: d.At.UnixMilli()}
}

// modelTTLs are the TTLs (ms) a call sets, by key.
type modelTTLs map[string]int64

// decide decides req at now (ms, the caller's clock: AllowAt) and applies it to the model.
// A Fresh request is never looked for as a replay.
func (m *model) decide(req throttle.Request, now int64) (modelDecision, modelTTLs) {
	c := &modelCall{m: m, req: req, caller: now, token: req.Reservation, holder: req.Holder,
		tenant: url.PathEscape(req.Key.Tenant), wait: req.MaxWait.Milliseconds(), claimWait: req.ClaimWait.Milliseconds(),
		claimTimeout: req.ClaimTimeout.Milliseconds(), weight: max(req.Weight, 1), cost: max(req.Cost, 1),
		priority: req.Priority}
	if c.claimTimeout == 0 {
		c.claimTimeout = throttle.DefaultClaimTimeout.Milliseconds()
	}
	tt := req.Key.TaskType
	c.leases, c.fairq, c.fairh = perType(m.leases, tt), perType(m.fairq, tt), perType(m.fairh, tt)
	for i, q := range req.Quotas {
		id := modelLogOf(req.Key, q.Scope)
		var cl *callLog
		for _, x := range c.logs {
			if x.id == id {
				cl = x
			}
		}
		if cl == nil {
			cl = &callLog{m: m, id: id, st: m.state(id)}
			c.logs = append(c.logs, cl)
			if q.Scope == throttle.ScopeType {
				c.typeLog = cl
				c.scopes += "y"
			} else {
				c.scopes += "t"
			}
		}
		mq := &modelQuota{index: i, limit: q.Limit.Events, w: q.Limit.Window.Milliseconds()}
		cl.q = append(cl.q, mq)
		cl.wmax = max(cl.wmax, mq.w)
		c.quotas = append(c.quotas, mq)
		c.quotaLog = append(c.quotaLog, cl)
	}
	c.letters = c.scopes
	var tq []string
	for i, q := range c.quotas {
		if c.quotaLog[i] != c.typeLog {
			tq = append(tq, fmt.Sprintf("%d/%d", q.limit, q.w))
		}
	}
	if len(tq) > 0 {
		c.scopes += "=" + strings.Join(tq, ",")
	}
	// The script's fast path for one quota: a cost-1 event of priority 0 on a plain log (no
	// weighted entry, nothing pending or ahead, no pause) admitted at now; with a token, a
	// wait or a claim timeout too (then it admits only at now).
	// So is its fast path for several quotas, on logs that are all plain.
	fast := c.cost == 1 && req.Priority == 0
	for _, cl := range c.logs {
		st := cl.st
		fast = fast && !st.flagC && !st.flagP && st.hiw <= st.hw && st.pause < 0
	}
	d := c.run()
	if fast && d.allowed && !d.replay && !d.held && d.at == c.now {
		for _, cl := range c.logs {
			cl.lazy = true
		}
	}
	ttls := modelTTLs{}
	for _, cl := range append(slices.Clone(c.logs), c.extra...) {
		ttl := cl.finish(c.now, c.claimTimeout)
		if ttl < 0 {
			continue
		}
		l, p, cc := cl.id.keys(m.prefix)
		ttls[l] = ttl
		if len(cl.st.pending) > 0 && cl.st.flagP {
			ttls[p] = ttl
		}
		if len(cl.st.entries.weighted()) > 0 {
			ttls[cc] = ttl
		}
	}
	base := m.prefix + ":{" + url.PathEscape(tt) + "}:"
	if c.leasesTTL {
		ttls[base+"leases"] = c.horizon
	}
	if c.fairTTL {
		ttls[base+"fair"] = c.horizon
		ttls[base+"fairstate"] = c.horizon
	}
	// The counts of the reply are taken after the writes (finish), as the script does.
	return c.reply(d), ttls
}

// claimFits: a reservation at s claimed on time still fits every quota of the call: each
// window ending at s holds at most its limit, the reservation included (the contract's
// rule for claims; only a lowered limit breaks it).
func (c *modelCall) claimFits(s int64) bool {
	for i, q := range c.quotas {
		if c.quotaLog[i].st.entries.sum(s-q.w, s) > q.limit {
			return false
		}
	}
	return true
}

// pendingName is the token's P member for the call's cost.
func (c *modelCall) pendingName() string { return strconv.Itoa(c.cost) + ":" + c.token }

// the decision before counts: which quota binds and at what instant the counts are taken
type modelOutcome struct {
	allowed, replay, reserved, held, paused bool
	binding                                 int
	countAt                                 int64
	retry                                   int64
	at                                      int64
	admittedBinding                         bool // the binding quota is the one with fewest left at at
}

func (c *modelCall) run() modelOutcome {
	m := c.m
	// SKEW: decided at the latest high-water of its logs, if after the caller's clock.
	c.now = c.caller
	for _, cl := range c.logs {
		c.now = max(c.now, cl.st.hw)
	}
	// Replay: the admission's member in the log with the longest window (the first on ties).
	am := c.req.Member
	if c.cost > 1 {
		am = "*" + strconv.Itoa(c.cost) + ":" + am
	}
	rl := c.logs[0]
	for _, cl := range c.logs[1:] {
		if cl.wmax > rl.wmax {
			rl = cl
		}
	}
	if e := rl.st.entries.find(am); e != nil && !c.req.Fresh {
		return modelOutcome{allowed: true, replay: true, at: e.score, admittedBinding: true}
	}
	// PAUSE: a log paused past now denies until the latest such end, writing nothing; the
	// first quota on a log paused that long binds.
	paused, pauseQ := c.now, -1
	for i, cl := range c.quotaLog {
		if cl.st.pause > paused {
			paused, pauseQ = cl.st.pause, i
		}
	}
	if pauseQ >= 0 {
		m.notes["paused"]++
		return modelOutcome{paused: true, binding: pauseQ, countAt: c.now, retry: paused - c.caller, at: c.now}
	}
	// Lapses: up to K_LAPSE per log, oldest first, of those pending at now - timeout or before.
	for _, cl := range c.logs {
		gone := cl.st.pendingWhere(func(s int64) bool { return s <= c.now-c.claimTimeout })
		for i, pm := range gone {
			if i == modelKLapse {
				break
			}
			c.m.notes["lapse"]++
			c.unreserve(cl, pm)
			tok := pm[strings.IndexByte(pm, ':')+1:]
			delete(c.leases, tok)
			if cl == c.typeLog {
				delete(c.fairq, tok)
			}
		}
	}
	// The event's reservation: pending at one instant in all its logs, or given up.
	pm := c.pendingName()
	var heldAt int64 = -1
	if c.token != "" {
		whole, any := true, false
		var first int64 = -1
		for i, cl := range c.logs {
			s, ok := cl.st.pending[pm]
			if ok {
				any = true
			}
			if i == 0 && ok {
				first = s
			}
			if !ok || first >= 0 && s != first {
				whole = false
			}
		}
		if whole {
			heldAt = first
		} else if any {
			c.m.notes["partialGivenUp"]++
			for _, cl := range c.logs {
				if _, ok := cl.st.pending[pm]; ok {
					c.unreserve(cl, pm)
				}
			}
			if c.typeLog != nil {
				delete(c.fairq, c.token)
			}
		}
	}
	held := heldAt >= 0
	if held && heldAt > c.now+c.claimWait {
		return modelOutcome{held: true, reserved: true, binding: 0, countAt: c.now, at: c.now, retry: heldAt - c.caller}
	}
	onTime := held && heldAt >= c.now
	if onTime && !c.claimFits(heldAt) {
		c.m.notes["claimRefit"]++ // a rule lowered a limit since the reservation was made
		onTime = false
	}
	if onTime {
		for _, cl := range c.logs { // the reservation becomes the admission, in place
			delete(cl.st.pending, pm)
			cl.pRemoved = true
			e := cl.st.entries.find("@" + pm)
			cl.st.entries = slices.DeleteFunc(cl.st.entries, func(x *modelEntry) bool { return x == e })
			e.name = am
			if e.cost > 1 {
				e.cname = am
			}
			i, _ := slices.BinarySearchFunc(cl.st.entries, e, compareEntries)
			cl.st.entries = slices.Insert(cl.st.entries, i, e)
			cl.dirty = true
		}
		c.fairClaimed()
		return modelOutcome{allowed: true, held: true, at: heldAt, admittedBinding: true}
	}
	if held { // late, or no longer fitting: decided afresh without its own reservation
		c.m.notes["lateClaim"]++
		for _, cl := range c.logs {
			c.unreserve(cl, pm)
		}
	}
	t := c.placeable(c.now)
	horizon := c.wait
	if held {
		horizon = c.claimWait
	}
	if t <= c.now+horizon {
		for _, cl := range c.logs {
			m.put(cl, am, t, c.cost)
		}
		if held {
			c.fairClaimed()
		}
		return modelOutcome{allowed: true, at: t, admittedBinding: true, held: held}
	}
	// PRIORITY: the earliest slot in (now, t) a lower priority's reservation holds, among the
	// first K_PRIO pending there; admitted for it within the horizon, else reserved below.
	var pv *modelVictim
	if c.priority > 0 && c.cost == 1 && c.token != "" {
		pv = c.prioVictim(t)
		if pv != nil && pv.s <= c.now+horizon {
			m.notes["prioAdmit"]++
			c.displace(pv, am)
			if held {
				c.fairClaimed()
			}
			return modelOutcome{allowed: true, at: pv.s, admittedBinding: true, held: held}
		}
	}
	binding := c.denyingQuota(t)
	if c.token == "" {
		return modelOutcome{held: held, binding: binding, countAt: c.now, at: c.now, retry: t - c.caller}
	}
	// SPACING: held back by a tenant quota, from its log's latest instant on, cost x W/limit.
	if c.req.Spread && pv == nil && c.quotaLog[binding] != c.typeLog {
		q, st := c.quotas[binding], c.quotaLog[binding].st
		if f := max(st.hiw, st.hw) + int64(c.cost)*q.w/int64(q.limit); t < f {
			c.m.notes["spaced"]++
			if len(c.logs) == 1 && c.cost == 1 && c.req.Priority == 0 {
				c.m.notes["oneLogSpaced"]++ // the script's one-log path, or its hand-over
			}
			t = c.placeable(f)
		}
	}
	// Reserve, at the fair rank on a type quota.
	var tag int64
	if c.typeLog != nil {
		v, _ := strconv.ParseInt(cmp.Or(c.fairh["v"], "0"), 10, 64)
		last, _ := strconv.ParseInt(cmp.Or(c.fairh["l:"+c.tenant], "0"), 10, 64)
		tag = max(v, last) + int64(math.Floor(float64(c.cost)*modelFair/float64(c.weight)+0.5))
	}
	placed := false
	if pv != nil {
		m.notes["prioSwap"]++
		c.displace(pv, "")
		placed, t = true, pv.s
	}
	if !placed && c.typeLog != nil && c.cost == 1 {
		placed = c.fairSwap(tag, t)
		if placed {
			c.m.notes["fairSwap"]++
			if len(c.logs) == 1 && c.req.Priority == 0 {
				c.m.notes["oneLogFairSwap"]++ // on the script's one-log path, unless it hands over
			}
			t = c.typeLog.st.pending[pm]
		}
	}
	if !placed {
		for _, cl := range c.logs {
			c.reserve(cl, pm, t)
		}
	}
	c.leases[c.token] = modelLease{cost: c.cost, scopes: c.scopes, holder: c.holder, tenant: c.tenant, priority: c.priority}
	c.horizon = 0
	for _, cl := range c.logs {
		c.horizon = max(c.horizon, max(t, cl.st.hiw)-c.now+cl.wmax+c.claimTimeout)
	}
	c.leasesTTL = true
	if c.typeLog != nil {
		c.fairq[c.token] = tag
		c.fairh["l:"+c.tenant] = strconv.FormatInt(tag, 10)
		c.fairTTL = true
	}
	return modelOutcome{reserved: true, held: held, binding: binding, countAt: c.now, at: c.now, retry: t - c.caller}
}

// denyingQuota: of a denial or reservation decided at t with several quotas, the first
// quota with no room at t - 1 (the one that holds the event back until t); else the first
// with no room in its window ending at now, else the first whose log has no room at now
// in a window after it, else the first.
func (c *modelCall) denyingQuota(t int64) int {
	atNow := c.fullAtNow()
	if t > c.now && len(c.quotas) > 1 {
		for i, q := range c.quotas {
			if !c.quotaLog[i].qfits(q, t-1, c.cost) {
				if i != atNow {
					c.m.notes["boundUntilT"]++ // another quota than the first full at now
				}
				return i
			}
		}
	}
	return atNow
}

// fullAtNow: the first quota with no room in its window ending at now, else the first
// whose log has no room at now in a window after it, else the first.
func (c *modelCall) fullAtNow() int {
	for i, q := range c.quotas {
		if c.quotaLog[i].st.entries.sum(c.now-q.w, c.now)+c.cost > q.limit {
			return i
		}
	}
	for i := range c.quotas {
		if !c.quotaLog[i].fits(c.now, c.cost) {
			return i
		}
	}
	return 0
}

// placeable: the earliest instant with room that can be written: for a weighted event, not
// before more than K_RENUM weighted entries of a log (else from the newest of them on).
func (c *modelCall) placeable(t0 int64) int64 {
	t := earliest(c.logs, t0, c.cost)
	if c.cost == 1 {
		return t
	}
	after := int64(-1)
	for _, cl := range c.logs {
		if !cl.cRoom(t) {
			c.m.notes["insertRefused"]++
			w := cl.st.entries.weighted()
			after = max(after, t, w[len(w)-1].score)
		}
	}
	if after >= 0 {
		t = earliest(c.logs, after, c.cost)
	}
	return t
}

func (c *modelCall) unreserve(cl *callLog, pm string) {
	delete(cl.st.pending, pm)
	cl.pRemoved = true
	c.m.drop(cl, "@"+pm)
}

func (c *modelCall) reserve(cl *callLog, pm string, s int64) {
	c.m.put(cl, "@"+pm, s, costOf("@"+pm))
	cl.st.pending[pm] = s
	cl.st.flagP = true
}

// fairClaimed: a claimed reservation's tag becomes the type's virtual time if later; its
// lease goes.
func (c *modelCall) fairClaimed() {
	if c.typeLog != nil {
		if tag, ok := c.fairq[c.token]; ok {
			delete(c.fairq, c.token)
			v, _ := strconv.ParseInt(cmp.Or(c.fairh["v"], "0"), 10, 64)
			if tag > v {
				c.fairh["v"] = strconv.FormatInt(tag, 10)
			}
		}
	}
	delete(c.leases, c.token)
}

// fairSwap takes, for a cost-1 event with tag and earliest instant t, the slot at its fair
// rank r among the type log's pending reservations: from the first pending at the r-th
// one's instant, the first of K_FAIR that is another tenant's cost-1 reservation with the
// same scopes and a later tag, after now and before t, where the event's other logs have
// room; else the earliest such among the reservations of the next K_FAIR tags. The displaced
// reservation goes to its own earliest instant.
func (c *modelCall) fairSwap(tag, t int64) bool {
	tl := c.typeLog
	rank := 0
	for _, g := range c.fairq {
		if g <= tag {
			rank++
		}
	}
	pend := tl.st.pendingWhere(func(int64) bool { return true })
	if rank >= len(pend) {
		return false
	}
	first := slices.IndexFunc(pend, func(pm string) bool { return tl.st.pending[pm] == tl.st.pending[pend[rank]] })
	for i := first; i < len(pend) && i < first+modelKFair; i++ {
		s := tl.st.pending[pend[i]]
		if s >= t {
			break
		}
		if c.canGive(pend[i], s, tag) {
			c.giveSlot(pend[i], s)
			return true
		}
	}
	// None there: the reservations of the next K_FAIR tags after its own (FAIRQ's order:
	// tag, then token), wherever they wait. Displaced reservations wait at the end of the
	// backlog with their early tags; a rank counts them, so its instant can fall among
	// them, after the later tags still waiting in place.
	var later []string
	for token, g := range c.fairq {
		if g > tag {
			later = append(later, token)
		}
	}
	slices.SortFunc(later, func(a, b string) int { return cmp.Or(cmp.Compare(c.fairq[a], c.fairq[b]), strings.Compare(a, b)) })
	// Of those that can give their slot, the earliest (the first in that order on ties).
	best, bestS := "", int64(0)
	for _, token := range later[:min(len(later), modelKFair)] {
		pm := "1:" + token
		if s, ok := tl.st.pending[pm]; ok && s < t && c.canGive(pm, s, tag) && (best == "" || s < bestS) {
			best, bestS = pm, s
		}
	}
	if best != "" {
		c.m.notes["fairNextTag"]++
		c.giveSlot(best, bestS)
		return true
	}
	return false
}

// canGive: the reservation pm, pending at s on the type log, can give its slot to this
// event of tag: another tenant's of cost 1, movable, of no higher priority and a later
// tag, after now, where the event's other logs have room.
func (c *modelCall) canGive(pm string, s, tag int64) bool {
	token := pm[strings.IndexByte(pm, ':')+1:]
	l, ok := c.leases[token]
	if !ok || s <= c.now || !strings.HasPrefix(pm, "1:") || l.cost != 1 || !c.movable(l.scopes, l.tenant) || l.tenant == c.tenant {
		return false
	}
	if l.priority > c.priority { // a fair rank never displaces a higher priority
		c.m.notes["fairSkipsPriority"]++
		return false
	}
	if c.fairq[token] <= tag {
		c.m.notes["fairSkipsEarlierTag"]++ // it ranks before this event: it keeps its slot
		return false
	}
	return c.roomFor(s, l.tenant)
}

// giveSlot displaces the reservation pm, pending at s on the type log: this event takes
// its slot, and it moves to its own earliest instant.
func (c *modelCall) giveSlot(pm string, s int64) {
	l := c.leases[pm[strings.IndexByte(pm, ':')+1:]]
	switch {
	case l.scopes == "y" && c.letters != "y":
		c.m.notes["fairSwapTypeOnly"]++
	case c.letters == "y" && l.scopes != "y":
		c.m.notes["fairSwapTiered"]++ // a type-only event moves a tiered reservation
	case l.scopes != c.scopes:
		c.m.notes["fairSwapOtherTier"]++ // moved on its tenant log under its own quotas
	}
	c.displace(&modelVictim{pm: pm, s: s, tenant: l.tenant, scopes: l.scopes}, "")
}

// modelVictim is a pending reservation an event takes the slot of: its P member, instant,
// (escaped) tenant and scopes.
type modelVictim struct {
	pm     string
	s      int64
	tenant string
	scopes string
}

// movable: a pending reservation of scopes vs and (escaped) tenant vt can give its slot to
// the event: it has the event's scopes; or it is another tenant's on the type log, the
// event being on it too, alone or with its own tenant log (then under the tenant quotas
// its lease records).
func (c *modelCall) movable(vs, vt string) bool {
	switch {
	case vs == c.scopes:
		return true
	case vt == c.tenant || c.typeLog == nil:
		return false
	}
	letters, _, recorded := strings.Cut(vs, "=")
	return vs == "y" || recorded && strings.Contains(letters, "y")
}

// tenantQuotas are the tenant log's quotas a lease's scopes record, and their longest
// window.
func tenantQuotas(scopes string) ([]*modelQuota, int64) {
	var qs []*modelQuota
	var wmax int64
	_, list, _ := strings.Cut(scopes, "=")
	for _, lw := range strings.Split(list, ",") {
		l, w, ok := strings.Cut(lw, "/")
		if !ok {
			continue
		}
		limit, _ := strconv.Atoi(l)
		win, _ := strconv.ParseInt(w, 10, 64)
		qs = append(qs, &modelQuota{limit: limit, w: win})
		wmax = max(wmax, win)
	}
	return qs, wmax
}

// roomFor: the event's logs that a reservation of tenant vt does not share (its tenant
// logs, for another tenant's) have room for cost 1 at s.
func (c *modelCall) roomFor(s int64, vt string) bool {
	if vt == c.tenant {
		return true
	}
	for _, cl := range c.logs {
		if cl != c.typeLog && !cl.fits(s, 1) {
			return false
		}
	}
	return true
}

// prioVictim: among the first K_PRIO reservations pending in (now, t) on the type log (else
// the event's only log, its tenant's), in P's order, the first of cost 1 with the event's
// scopes and a lower priority where the event's other logs have room; nil if none.
func (c *modelCall) prioVictim(t int64) *modelVictim {
	pl := c.typeLog
	if pl == nil {
		pl = c.logs[0]
	}
	pend := pl.st.pendingWhere(func(s int64) bool { return s > c.now && s < t })
	for i, pm := range pend {
		if i == modelKPrio {
			break
		}
		l, ok := c.leases[pm[strings.IndexByte(pm, ':')+1:]]
		if !ok || !strings.HasPrefix(pm, "1:") || l.cost != 1 || !c.movable(l.scopes, l.tenant) || l.priority >= c.priority {
			continue
		}
		if s := pl.st.pending[pm]; c.roomFor(s, l.tenant) {
			return &modelVictim{pm: pm, s: s, tenant: l.tenant, scopes: l.scopes}
		}
	}
	return nil
}

// displace gives the slot of v to the event: its admission admit, if not "", else its
// reservation; v moves to its own earliest instant after now. v's logs are the type log,
// and on the event's logs its tenant's, under the tenant quotas its lease records (the
// event's own, for its tenant); another tenant's log is not trimmed (finish).
func (c *modelCall) displace(v *modelVictim, admit string) {
	vtenant, _ := url.PathUnescape(v.tenant)
	vlogs := c.logs
	if v.tenant != c.tenant {
		vlogs = nil
		letters, _, _ := strings.Cut(v.scopes, "=")
		for _, sc := range letters {
			if sc == 'y' {
				vlogs = append(vlogs, c.typeLog)
				continue
			}
			id := modelLogOf(throttle.Key{TaskType: c.req.Key.TaskType, Tenant: vtenant}, throttle.ScopeTenant)
			q, wmax := tenantQuotas(v.scopes)
			vl := &callLog{m: c.m, id: id, st: c.m.state(id), q: q, wmax: wmax, other: true}
			vlogs = append(vlogs, vl)
			c.extra = append(c.extra, vl)
		}
	}
	for _, vl := range vlogs {
		c.unreserve(vl, v.pm)
	}
	pm := c.pendingName()
	for _, cl := range c.logs {
		if admit != "" {
			c.m.put(cl, admit, v.s, 1)
		} else {
			c.reserve(cl, pm, v.s)
		}
	}
	tv := earliest(vlogs, c.now, 1)
	for _, vl := range vlogs {
		c.reserve(vl, v.pm, tv)
	}
}

// reply turns an outcome into the decision, counting after the call's writes.
func (c *modelCall) reply(o modelOutcome) modelDecision {
	count := func(i int, at int64) int {
		return c.quotaLog[i].st.entries.sum(at-c.quotas[i].w, at)
	}
	d := modelDecision{Allowed: o.allowed, Replay: o.replay, Reserved: o.reserved, Held: o.held, Paused: o.paused, At: o.at}
	binding := o.binding
	at := o.countAt
	if o.allowed {
		at = o.at
		left := 0
		for i, q := range c.quotas {
			if l := q.limit - count(i, at); i == 0 || l < left {
				binding, left = i, l
			}
		}
		if !o.replay {
			d.Delay = time.Duration(o.at-c.caller) * time.Millisecond
		}
	} else {
		d.RetryAfter = time.Duration(o.retry) * time.Millisecond
	}
	d.Quota = c.req.Quotas[binding]
	d.Count = count(binding, at)
	d.Remaining = max(c.quotas[binding].limit-d.Count, 0)
	return d
}

// release gives up token's reservation of taskType, as Limiter.Release does.
func (m *model) release(taskType, token string) bool {
	leases := perType(m.leases, taskType)
	l, ok := leases[token]
	if !ok {
		return false
	}
	held := false
	tenant, _ := url.PathUnescape(l.tenant)
	letters, _, _ := strings.Cut(l.scopes, "=")
	for _, sc := range letters {
		scope := throttle.ScopeTenant
		if sc == 'y' {
			scope = throttle.ScopeType
		}
		id := modelLogOf(throttle.Key{TaskType: taskType, Tenant: tenant}, scope)
		st := m.state(id)
		pm := strconv.Itoa(l.cost) + ":" + token
		if _, ok := st.pending[pm]; ok && st.flagP {
			held = true
			cl := &callLog{m: m, id: id, st: st}
			delete(st.pending, pm)
			m.drop(cl, "@"+pm)
		}
	}
	delete(leases, token)
	delete(perType(m.fairq, taskType), token)
	return held
}

// pause pauses the log id until until, as Limiter.PauseAt at now does, and returns the
// TTL it sets on the log, or -1 if it writes nothing (a pause already over): the pause's
// end never moves earlier (ZADD GT); the TTL is set to until - now when the key has none,
// as after every observed call.
func (m *model) pause(id modelLog, until, now int64) int64 {
	if until <= now {
		return -1
	}
	st := m.state(id)
	st.pause = max(st.pause, until)
	st.hw = max(st.hw, 0) // a log never written gets its sentinel, to carry the pause's flag
	return until - now
}

// resume lifts the log's pause, as Limiter.Resume does, and reports whether it had one.
func (m *model) resume(id modelLog) bool {
	st := m.state(id)
	had := st.pause >= 0
	st.pause = -1
	return had
}

// pendingWhere returns the log's pending reservations whose instants keep, as P orders
// them: by instant, then by member.
func (st *modelState) pendingWhere(keep func(s int64) bool) []string {
	var pend []string
	for pm, s := range st.pending {
		if keep(s) {
			pend = append(pend, pm)
		}
	}
	slices.SortFunc(pend, func(a, b string) int {
		return cmp.Or(cmp.Compare(st.pending[a], st.pending[b]), strings.Compare(a, b))
	})
	return pend
}

// sentinels returns the scores of the log's "#" and "#f" members as the contract says.
func (st *modelState) sentinels() (hash float64, f float64, hasF bool) {
	flags := int64(0)
	if st.flagC {
		flags++
	}
	if st.flagP {
		flags += 4
	}
	if st.hiw > st.hw {
		flags += 2
	}
	if st.pause >= 0 {
		flags += 8
	}
	hash = float64(16*st.hw + flags - modelBase)
	if st.hiw > st.hw {
		return hash, float64(st.hiw - modelBase), true
	}
	return hash, 0, false
}
