package throttle_test

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"hash/fnv"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/asynq-throttle/asynq-throttle/internal/redistest"
	"github.com/asynq-throttle/asynq-throttle/throttle"
)

// A reference model of the limiter, written from the contract (DESIGN.md section 3 and the
// header of lua/sliding_window.lua), not from the script: every window log, reservation
// set and owners hash is a plain Go value, and each rule of the contract is a few lines of
// Go next to the sentence it implements. Where the header leaves a detail open (which
// quota binds on a tie, where the fair share's displaced reservation goes, how far a due
// reservation looks for admissions after now), the model does what the script's comments
// say it does, and says so. TestLimiter_AllowAt_matchesModel drives the model and a real
// redis-server with the same random requests and requires the same decisions, the same
// sets and the same TTLs after every call; the TestLimiter_AllowAt_* tests below it replay
// short fixed sequences.

var (
	modelSeed  = flag.Uint64("model.seed", 0, "TestLimiter_AllowAt_matchesModel: run only this seed (0: the fixed seeds)")
	modelSteps = flag.Int("model.steps", 2000, "TestLimiter_AllowAt_matchesModel: requests per seed")
)

// modelSeeds are the seeds the test runs by default: fixed, so that a run is reproducible.
var modelSeeds = []uint64{1, 2, 3, 4, 5}

// modelLog names one window log: a task type's log (ScopeType, tenant "") or a tenant's.
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

// modelEntry is one entry of a window log or of a reservation set: an admission of cost c
// by member m is the entries "1:m" .. "c:m" scored at the admission's instant; a
// reservation of cost c for token T is "1@T" .. "c@T" scored at the reserved instant, in
// the log and in the reservation set beside it (the script's header documents both).
type modelEntry struct {
	score    int64 // ms
	name     string
	reserved bool // a reservation, not an admission (what Redis cannot tell apart)
}

func (e modelEntry) String() string {
	if e.reserved {
		return fmt.Sprintf("%d:%q(R)", e.score, e.name)
	}
	return fmt.Sprintf("%d:%q", e.score, e.name)
}

// modelNames returns the entry names of an event of cost c with id: "1<sep>id" ..
// "c<sep>id", sep ":" for an admission and "@" for a reservation.
func modelNames(sep, id string, cost int) []string {
	names := make([]string, cost)
	for c := range names {
		names[c] = strconv.Itoa(c+1) + sep + id
	}
	return names
}

// compareModelEntries orders entries as a Redis sorted set does: by score, then by name
// byte by byte.
func compareModelEntries(a, b modelEntry) int {
	return cmp.Or(cmp.Compare(a.score, b.score), strings.Compare(a.name, b.name))
}

// modelSet is a sorted set: entries unique by name, sorted by compareModelEntries.
type modelSet []modelEntry

// put adds e, or moves the entry of that name to e's score, as ZADD does.
func (s modelSet) put(e modelEntry) modelSet {
	s = slices.DeleteFunc(s, func(x modelEntry) bool { return x.name == e.name })
	i, _ := slices.BinarySearchFunc(s, e, compareModelEntries)
	return slices.Insert(s, i, e)
}

func (s modelSet) find(name string) (modelEntry, bool) {
	i := slices.IndexFunc(s, func(x modelEntry) bool { return x.name == name })
	if i < 0 {
		return modelEntry{}, false
	}
	return s[i], true
}

// trimFloor is the highest score a write at now trims from a log whose longest window
// (among the request's quotas on it) is w, and from the reservation set beside it: the
// header's "a write removes the entries scored at or before now_ms - longest window -
// grace_ms". Rule 1 alone would trim at now - w; TestLimiter_AllowAt_callerBehindAfterTrim
// shows why the entries must outlive their window by how far a caller's clock may be
// behind.
func (m *model) trimFloor(now, w int64) int64 { return now - w - m.grace }

// trim drops the entries scored at or before floor, as ZREMRANGEBYSCORE -inf floor does.
func (s modelSet) trim(floor int64) modelSet {
	return slices.DeleteFunc(s, func(x modelEntry) bool { return x.score <= floor })
}

func (s modelSet) newest() int64 { return s[len(s)-1].score }

// model is every window log, reservation set and owners hash, in memory, and the grace
// (ms) the limiter passes as ARGV[8].
type model struct {
	grace    int64
	logs     map[modelLog]modelSet
	reserved map[modelLog]modelSet        // the reservation set beside each log
	owners   map[string]map[string]string // per task type: reservation token -> "<tenant tag>/<cost>"
}

func newModel(grace int64) *model {
	return &model{grace: grace, logs: map[modelLog]modelSet{}, reserved: map[modelLog]modelSet{}, owners: map[string]map[string]string{}}
}

// modelGrace is the grace (ms) a Limiter made with cfg passes to the script: 2 x MaxSkew,
// and 2 x DefaultMaxSkew when MaxSkew is zero (the default) or negative (the check off),
// as Config.MaxSkew documents.
func modelGrace(cfg throttle.Config) int64 {
	skew := cfg.MaxSkew
	if skew <= 0 {
		skew = throttle.DefaultMaxSkew
	}
	return 2 * skew.Milliseconds()
}

// modelTag is the tenant's tag in the owners hash: FNV-1a (64 bits) of the tenant, in hex.
func modelTag(tenant string) string {
	h := fnv.New64a()
	h.Write([]byte(tenant))
	return strconv.FormatUint(h.Sum64(), 16)
}

// modelDecision is what the model decides: every field of a Decision it determines.
type modelDecision struct {
	Allowed, Replay, Reserved bool
	Quota                     throttle.Quota
	Count, Remaining          int
	RetryAfter, ResetAfter    time.Duration
	At                        int64 // ms
}

func (d modelDecision) String() string {
	s := "denied"
	switch {
	case d.Replay:
		s = "replay"
	case d.Allowed:
		s = "admitted"
	case d.Reserved:
		s = "denied+reserved"
	}
	return fmt.Sprintf("%s at=%d quota=%s count=%d remaining=%d retry=%dms reset=%dms",
		s, d.At, d.Quota, d.Count, d.Remaining, d.RetryAfter.Milliseconds(), d.ResetAfter.Milliseconds())
}

func modelDecisionOf(d throttle.Decision) modelDecision {
	return modelDecision{Allowed: d.Allowed, Replay: d.Replay, Reserved: d.Reserved, Quota: d.Quota, Count: d.Count,
		Remaining: d.Remaining, RetryAfter: d.RetryAfter, ResetAfter: d.ResetAfter, At: d.At.UnixMilli()}
}

// modelTTL is a TTL the contract asks a call to set: for a log, with res for the
// reservation set beside it, with owners for the owners hash of the log's task type.
type modelTTL struct {
	log    modelLog
	res    bool
	owners bool
}

// decide decides req at now (ms) and applies it. It returns the TTL (ms) the call must
// set on each set it writes that exists after it: a log, its reservation set and, beside
// the type-wide log, the owners hash must outlive the log's newest entry (or now) by the
// longest window of the request's quotas on that log plus the grace.
func (m *model) decide(req throttle.Request, now int64) (d modelDecision, ttls map[modelTTL]int64, note modelNote) {
	cost := req.Cost
	if cost == 0 {
		cost = 1 // the documented default
	}
	token := req.Reservation
	var order []modelLog                      // the request's logs, each once
	longest := map[modelLog]int64{}           // per log, the longest window of the request's quotas on it
	logs := make([]modelLog, len(req.Quotas)) // the log of each quota
	windows := make([]int64, len(req.Quotas))
	for i, q := range req.Quotas {
		logs[i] = modelLogOf(req.Key, q.Scope)
		windows[i] = q.Limit.Window.Milliseconds()
		if _, ok := longest[logs[i]]; !ok {
			order = append(order, logs[i])
		}
		longest[logs[i]] = max(longest[logs[i]], windows[i])
	}
	typeLog := modelLogOf(req.Key, throttle.ScopeType)
	_, hasType := longest[typeLog]
	// The owners hash is the call's only with a token and a type-wide quota (KEYS[2m+1]):
	// no other call reads it, writes it or forgets an owner in it.
	withOwners := token != "" && hasType

	// Rule 7 (header, ARGV[2]): a call that finds its member's admission "1:<member>" in
	// one of its logs is a replay, whatever the entry's score: it is there until a write
	// trims it, the grace after its longest window. A replay is allowed, takes no slot,
	// writes nothing at all (no trim, no TTL) and does not look up its reservation.
	replay := false
	found := 0
	for _, id := range order {
		if _, ok := m.logs[id].find("1:" + req.Member); ok {
			replay = true
			found++
		}
	}
	if replay {
		note.replayPartial = found < len(order)
		note.replayOutside = true
		for i := range req.Quotas {
			if e, ok := m.logs[logs[i]].find("1:" + req.Member); ok && e.score > now-windows[i] {
				note.replayOutside = false
			}
		}
	}

	// The event's reservation, with a token and unless a replay: its entries "<c>@<token>"
	// in the reservation set beside each log, at one instant per log (they differ after a
	// fairness swap). In a log it holds while its instant is after now - the log's longest
	// window; older, it has lapsed (the grace keeps it only for late callers to count) and
	// is ignored there. The event holds a reservation if one log has it; it is due at the
	// latest of its instants.
	own := modelNames("@", token, cost) // the entries of this event's reservation, if any
	ownAt := map[modelLog]int64{}       // per log, the instant of its reservation there, if it holds there
	var reservedAt int64
	holds := false
	if token != "" && !replay {
		for _, id := range order {
			e, ok := m.reserved[id].find(own[0])
			switch {
			case ok && e.score > now-longest[id]:
				ownAt[id] = e.score
				if !holds || e.score > reservedAt {
					reservedAt, holds = e.score, true
				}
			case ok:
				note.lapsed = true
			}
		}
	}
	due := holds && reservedAt <= now
	for _, id := range order {
		if at, ok := ownAt[id]; holds && (!ok || at != reservedAt) {
			note.split = true // its instants differ between its logs, or a log lacks it
		}
	}

	// Rule 1: an entry counts iff its score is above now - W, entries in the future too:
	// reservations and admissions from a caller ahead. A due reservation counts the entries
	// in (now - W, now] other than its own (in a log where its own instant has left W, or
	// lapsed, or where the swap moved it, there is none of them in that window), and the
	// admissions after now only: reservations behind it do not block it.
	// blocking[i] lists, ascending, the counted entries rule 4 takes the k-th oldest of:
	// for a due reservation, the admissions after now among the first 1000 entries after
	// now only (the script's bounded page: "past it, wait a whole window").
	counts := make([]int, len(req.Quotas))
	blocking := make([][]int64, len(req.Quotas))
	for i := range req.Quotas {
		after := 0 // entries after now so far
		for _, e := range m.logs[logs[i]] {
			counted, listed := false, false
			switch {
			case !due:
				counted = e.score > now-windows[i]
				listed = counted
			case e.score <= now:
				counted = e.score > now-windows[i] && !slices.Contains(own, e.name)
				listed = counted
			default:
				after++
				counted = !e.reserved
				listed = counted && after <= 1000
			}
			if counted {
				counts[i]++
			}
			if listed {
				blocking[i] = append(blocking[i], e.score)
			}
		}
	}

	note.holds, note.due = holds, due
	note.waits = make([]int64, len(req.Quotas))

	// Rules 3 and 4: admit iff count + cost <= limit for every quota; otherwise wait until
	// the k-th oldest counted entry (k = count + cost - limit) leaves the window (if a due
	// reservation finds fewer than k, a whole window). A reservation not yet due waits for
	// its instant. A replay has nothing to decide.
	var retry int64
	binding := 0
	switch {
	case replay:
	case holds && !due:
		retry = reservedAt - now // the same wait for every quota: the first binds
	default:
		for i, q := range req.Quotas {
			k := counts[i] + cost - q.Limit.Events
			if k <= 0 {
				continue
			}
			kth := now
			if k <= len(blocking[i]) {
				kth = blocking[i][k-1]
			}
			wait := max(kth+windows[i]-now, 1)
			note.waits[i] = wait
			if wait > retry { // the longest wait binds; the first quota on a tie
				retry, binding = wait, i
			}
		}
	}
	allowed := replay || retry == 0
	reserved := !allowed && token != ""

	ttls = map[modelTTL]int64{}
	// trim: a write trims each of its logs and the reservation set beside it at the same
	// floor, and with the owners hash forgets the owners of the reservations it trims from
	// the type-wide log's set.
	trim := func(id modelLog) {
		floor := m.trimFloor(now, longest[id])
		if withOwners && id == typeLog {
			for _, e := range m.reserved[id] {
				if e.score <= floor {
					_, t, _ := strings.Cut(e.name, "@")
					delete(m.owners[id.taskType], t)
				}
			}
		}
		m.logs[id] = m.logs[id].trim(floor)
		m.reserved[id] = m.reserved[id].trim(floor)
	}
	// expire: rule 6 and the header's "PEXPIRE keeps each set until its newest entry is
	// that old": the log, its reservation set and, beside the type-wide log, the owners
	// hash (when the call has it) all get max(newest, now) - now + longest + grace. An
	// empty set is no key: PEXPIRE sets nothing.
	expire := func(id modelLog) {
		ttl := max(m.logs[id].newest(), now) - now + longest[id] + m.grace
		ttls[modelTTL{log: id}] = ttl // never empty: the write just added to it
		if len(m.reserved[id]) > 0 {
			ttls[modelTTL{log: id, res: true}] = ttl
		}
		if withOwners && id == typeLog && len(m.owners[id.taskType]) > 0 {
			ttls[modelTTL{log: id, owners: true}] = ttl
		}
	}
	switch {
	case replay:
		// Nothing written.
	case allowed:
		// An admission trims each log, turns a reservation it holds into the admission
		// (its entries leave every log and set, its owner the owners hash), adds cost
		// entries at now and sets the TTLs.
		for _, id := range order {
			trim(id)
			if holds {
				drop := func(e modelEntry) bool { return slices.Contains(own, e.name) }
				m.logs[id] = slices.DeleteFunc(m.logs[id], drop)
				m.reserved[id] = slices.DeleteFunc(m.reserved[id], drop)
				if withOwners && id == typeLog {
					delete(m.owners[id.taskType], token)
				}
			}
			for _, name := range modelNames(":", req.Member, cost) {
				m.logs[id] = m.logs[id].put(modelEntry{score: now, name: name})
			}
			expire(id)
		}
		for i := range counts {
			counts[i] += cost
		}
	case reserved && !holds:
		// A denied event with a token and no reservation (or only a lapsed one: its
		// entries move, as ZADD moves a member) reserves now + retry: the first instant
		// at which every quota has room, counting every entry. Unless, on a type-wide
		// quota, a fairer slot is ahead: see fairSlot.
		at := now + retry
		var victim string
		if withOwners && logs[binding] == typeLog && cost == 1 {
			at, victim = m.fairSlot(req, now, at, binding)
			note.fair = victim != ""
		}
		if victim != "" { // the slot is ours; the victim's goes behind everything
			drop := func(e modelEntry) bool { return e.name == "1@"+victim }
			m.logs[typeLog] = slices.DeleteFunc(m.logs[typeLog], drop)
			m.reserved[typeLog] = slices.DeleteFunc(m.reserved[typeLog], drop)
		}
		for _, id := range order {
			trim(id)
			for _, name := range own {
				m.logs[id] = m.logs[id].put(modelEntry{score: at, name: name, reserved: true})
				m.reserved[id] = m.reserved[id].put(modelEntry{score: at, name: name, reserved: true})
			}
		}
		if victim != "" {
			// Behind everything: where a new reservation would go on the binding
			// type-wide quota, counting every entry, and not before at. Only on the
			// type-wide log: its entry in its tenant's log stays where it was.
			w, limit := windows[binding], req.Quotas[binding].Limit.Events
			var counted []int64
			for _, e := range m.logs[typeLog] {
				if e.score > now-w {
					counted = append(counted, e.score)
				}
			}
			later := max(counted[len(counted)+1-limit-1]+w, at)
			e := modelEntry{score: later, name: "1@" + victim, reserved: true}
			m.logs[typeLog] = m.logs[typeLog].put(e)
			m.reserved[typeLog] = m.reserved[typeLog].put(e)
		}
		if withOwners {
			if m.owners[req.Key.TaskType] == nil {
				m.owners[req.Key.TaskType] = map[string]string{}
			}
			m.owners[req.Key.TaskType][token] = modelTag(req.Key.Tenant) + "/" + strconv.Itoa(cost)
		}
		for _, id := range order {
			expire(id)
		}
		retry = at - now
	}
	// Otherwise (denied without a token, or holding a reservation) nothing is written.
	for i, q := range req.Quotas {
		note.left = append(note.left, q.Limit.Events-counts[i])
	}
	if allowed { // the quota with the fewest slots left binds; the first on a tie
		binding = 0
		for i, q := range req.Quotas {
			if q.Limit.Events-counts[i] < req.Quotas[binding].Limit.Events-counts[binding] {
				binding = i
			}
		}
		retry = 0
	}

	var reset int64 // until every quota's window is empty: newest entry + W - now, >= 0
	for i := range req.Quotas {
		if l := m.logs[logs[i]]; len(l) > 0 {
			reset = max(reset, l.newest()+windows[i]-now)
		}
	}
	q := req.Quotas[binding]
	return modelDecision{
		Allowed:    allowed,
		Replay:     replay,
		Reserved:   reserved,
		Quota:      q,
		Count:      counts[binding],
		Remaining:  max(q.Limit.Events-counts[binding], 0),
		RetryAfter: msDuration(retry),
		ResetAfter: msDuration(reset),
		At:         now,
	}, ttls, note
}

// fairSlot implements the header's fairness on a type-wide quota for req, denied at now
// by its binding quota q on the type-wide log and about to reserve at: among the next
// 4 x limit reservation entries of the type-wide log in (now, at), it takes the earliest
// of cost 1 whose owner holds at least two more of those entries than req's tenant (its
// cost-1 ones) in the window ending there, if req's other quotas (those on other logs)
// have room for it there, counting every entry. It returns the instant and the victim's
// token, or at and "".
func (m *model) fairSlot(req throttle.Request, now, at int64, q int) (int64, string) {
	typeLog := modelLogOf(req.Key, throttle.ScopeType)
	w, limit := req.Quotas[q].Limit.Window.Milliseconds(), req.Quotas[q].Limit.Events
	var page []modelEntry
	for _, e := range m.reserved[typeLog] {
		if e.score > now && e.score < at && len(page) < 4*limit {
			page = append(page, e)
		}
	}
	owner := func(e modelEntry) string {
		_, id, _ := strings.Cut(e.name, "@")
		return m.owners[req.Key.TaskType][id]
	}
	mine := modelTag(req.Key.Tenant) + "/1"
	for _, e := range page {
		held := map[string]int{}
		for _, o := range page {
			if o.score > e.score-w && o.score <= e.score {
				held[owner(o)]++
			}
		}
		victim := owner(e)
		if victim == mine || !strings.HasSuffix(victim, "/1") || held[victim] <= held[mine]+1 {
			continue
		}
		fits := true
		for _, o := range req.Quotas {
			if o.Scope == throttle.ScopeType {
				continue
			}
			n := 0
			for _, x := range m.logs[modelLogOf(req.Key, o.Scope)] {
				if x.score > e.score-o.Limit.Window.Milliseconds() {
					n++
				}
			}
			fits = fits && n+max(req.Cost, 1) <= o.Limit.Events
		}
		if fits {
			_, id, _ := strings.Cut(e.name, "@")
			return e.score, id
		}
	}
	return at, ""
}

// modelNote is how the model came to a decision, for the test's statistics.
type modelNote struct {
	holds, due    bool    // the event held a live reservation; it was due
	split         bool    // it held one at different instants in its logs, or not in every log
	lapsed        bool    // one of its logs had its reservation, lapsed (kept by the grace)
	fair          bool    // it took a fairer slot from another tenant's reservation
	replayPartial bool    // a replay found in some of its logs, not all
	replayOutside bool    // a replay whose admission counts in none of its windows
	waits         []int64 // per quota, the wait it asked for (0: room)
	left          []int   // per quota, limit - count after the call
}

func msDuration(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

// observingClient is a redis.Client whose script calls run in one MULTI/EXEC with, for
// every key the script was given, PTTL, PEXPIRETIME, ZRANGE WITHSCORES and then PERSIST.
// The model runs on simulated milliseconds while Redis expires keys on its real clock: a
// log with a 5ms TTL would vanish between two calls 5 simulated seconds apart, or survive
// when its simulated window is long gone. Removing the TTL in the same transaction as the
// script, after reading it, makes the logs live on simulated time only, and lets the test
// check the TTL each admission sets and the log each call leaves.
type observingClient struct {
	*redis.Client
	calls []observedCall // since the last reset
}

// observedCall is what one script call returned and left behind.
type observedCall struct {
	keys []observedKey
}

type observedKey struct {
	key        string
	pttl       int64 // ms, as PTTL right after the script; -1 no TTL, -2 no key
	expireTime int64 // ms since the epoch, as PEXPIRETIME; -1 no TTL, -2 no key
	zset       []redis.Z
	hash       map[string]string // for the owners hash
}

// modelOwnersKey reports whether key is an owners hash: "<prefix>:{<type>}:owners".
func modelOwnersKey(key string) bool { return strings.HasSuffix(key, "}:owners") }

func (c *observingClient) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return c.observe(ctx, keys, func(p redis.Pipeliner) *redis.Cmd { return p.EvalSha(ctx, sha1, keys, args...) })
}

func (c *observingClient) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return c.observe(ctx, keys, func(p redis.Pipeliner) *redis.Cmd { return p.Eval(ctx, script, keys, args...) })
}

func (c *observingClient) observe(ctx context.Context, keys []string, run func(redis.Pipeliner) *redis.Cmd) *redis.Cmd {
	var script *redis.Cmd
	pttls := make([]*redis.Cmd, len(keys))
	expireTimes := make([]*redis.Cmd, len(keys))
	zsets := make([]*redis.ZSliceCmd, len(keys))
	hashes := make([]*redis.MapStringStringCmd, len(keys))
	_, _ = c.Client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		script = run(p)
		for i, k := range keys {
			pttls[i] = p.Do(ctx, "PTTL", k)
			expireTimes[i] = p.Do(ctx, "PEXPIRETIME", k)
			if modelOwnersKey(k) {
				hashes[i] = p.HGetAll(ctx, k)
			} else {
				zsets[i] = p.ZRangeWithScores(ctx, k, 0, -1)
			}
			p.Persist(ctx, k)
		}
		return nil
	}) // each command carries its own error; the script's is returned
	if script.Err() != nil {
		return script // NOSCRIPT: redis.Script.Run sends EVAL next
	}
	var call observedCall
	for i, k := range keys {
		o := observedKey{key: k}
		if hashes[i] != nil {
			o.hash = hashes[i].Val()
		} else {
			o.zset = zsets[i].Val()
		}
		o.pttl, _ = pttls[i].Int64()
		o.expireTime, _ = expireTimes[i].Int64()
		call.keys = append(call.keys, o)
	}
	c.calls = append(c.calls, call)
	return script
}

// modelOp is one call of the test: a request at an instant.
type modelOp struct {
	req      throttle.Request
	at       int64
	why      string // how the generator came to it
	admitted bool   // a call made again: the call it repeats was admitted
	decision modelDecision
	note     modelNote
}

func (op modelOp) String() string {
	var quotas []string
	for _, q := range op.req.Quotas {
		quotas = append(quotas, q.String())
	}
	return fmt.Sprintf("t=%d %s type=%q tenant=%q quotas=[%s] cost=%d member=%q reservation=%q -> %s",
		op.at, op.why, op.req.Key.TaskType, op.req.Key.Tenant, strings.Join(quotas, " "),
		op.req.Cost, op.req.Member, op.req.Reservation, op.decision)
}

// modelTenants are tenant ids, several of them chosen to break a key or to look like
// another one.
var modelTenants = []string{"acme", "", "{", "}", "{acme}", ":", "a:tenant:b", "%41", "A", "ü", "a b", "x}:type", "reserved:x"}

// modelType is one task type and its rules.
type modelType struct {
	name   string
	quotas []throttle.Quota // nil: a new random set for every request, as while rules change
}

// modelGen generates the requests of one seed.
type modelGen struct {
	rng     *rand.Rand
	types   []modelType
	now     int64
	n       int       // ids handed out
	past    []modelOp // recent requests, to retry with the same member
	waiting []modelOp // denied requests that hold a reservation, to come back
	plan    []modelOp // requests to make next, before any other
}

func newModelGen(seed uint64) *modelGen {
	g := &modelGen{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), now: 1_700_000_000_000}
	g.types = []modelType{
		{name: "api:call", quotas: []throttle.Quota{g.quota(throttle.ScopeTenant)}},
		{name: "{mail}", quotas: []throttle.Quota{g.quota(throttle.ScopeTenant), g.quota(throttle.ScopeType)}},
		{name: "report:reserved:x", quotas: []throttle.Quota{g.quota(throttle.ScopeType), g.quota(throttle.ScopeTenant), g.quota(throttle.ScopeTenant)}},
		{name: "}{", quotas: nil},
	}
	return g
}

// modelUnit is the generator's unit of time, in ms. Windows are 1-50 units and the clock
// moves 0-20 units a step, so entries expire all the time, as with 1-50ms windows; but a
// TTL, which Redis runs on its real clock, is never under 100ms: Redis 7.0 can expire a
// key with a 1ms TTL inside the MULTI/EXEC that sets it and reads it back (measured), so
// the test would see a log vanish. Probes 1ms before RetryAt, jitter and boundary
// instants (see next) keep the decisions at millisecond precision.
const modelUnit = 100

// quota returns a random quota at scope: 1-8 events per 1-50 units, with a few windows
// made likely so that quotas tie.
func (g *modelGen) quota(scope throttle.Scope) throttle.Quota {
	w := 1 + g.rng.Int64N(50)
	if g.rng.IntN(2) == 0 {
		w = []int64{5, 10, 20}[g.rng.IntN(3)]
	}
	return throttle.Quota{Scope: scope, Limit: throttle.Limit{Events: 1 + g.rng.IntN(8), Window: msDuration(w * modelUnit)}}
}

// member returns a fresh member: unique, sometimes with ':' or braces in it. Reservation
// tokens (see token) never equal a member.
func (g *modelGen) member() string {
	g.n++
	return fmt.Sprintf([]string{"m%d", "1:x%d", "x%d:2", "{y%d}", "ü%d"}[g.rng.IntN(5)], g.n)
}

// token returns a fresh reservation token, as the worker's task ids, sometimes with ':'
// or '@' in it.
func (g *modelGen) token() string {
	g.n++
	return fmt.Sprintf([]string{"T%d", "T:%d", "T{%d}", "T@%d"}[g.rng.IntN(4)], g.n)
}

// next returns the next request and its instant.
func (g *modelGen) next(m *model) modelOp {
	if len(g.plan) > 0 {
		op := g.plan[0]
		g.plan = g.plan[1:]
		g.now = op.at
		return op
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
	case r < 8 && len(g.past) > 0: // a call retried with the same member (its reply was lost)
		// Whether its admission is still in one of its logs (a replay) or trimmed from all
		// of them (decided afresh), the contract says what happens.
		op := g.past[g.rng.IntN(len(g.past))]
		return modelOp{req: op.req, at: g.now, why: "again(" + op.why + ")", admitted: op.decision.Allowed}
	case r < 18 && len(g.waiting) > 0: // a task with a reservation comes back, on time or not
		i := g.rng.IntN(len(g.waiting))
		req := g.waiting[i].req
		req.Member = g.member()
		return modelOp{req: req, at: g.now, why: "back"}
	}
	typ := g.types[g.rng.IntN(len(g.types))]
	if r := g.rng.IntN(100); r < 2 && typ.quotas != nil && slices.ContainsFunc(typ.quotas, func(q throttle.Quota) bool { return q.Scope == throttle.ScopeType }) {
		// A backlog: one tenant's burst of tasks at once, then another tenant's few, all
		// of cost 1 with reservations: what the fair share on a type-wide quota is for.
		tenants := g.rng.Perm(len(modelTenants))
		for i := range 4 + g.rng.IntN(12) {
			tenant := modelTenants[tenants[0]]
			if i >= 3+g.rng.IntN(8) {
				tenant = modelTenants[tenants[1+g.rng.IntN(2)]]
			}
			req := throttle.Request{Key: throttle.Key{TaskType: typ.name, Tenant: tenant}, Quotas: typ.quotas,
				Cost: 1, Member: g.member(), Reservation: g.token()}
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
	if l := m.logs[modelLogOf(key, quotas[0].Scope)]; len(l) > 0 && g.rng.IntN(10) == 0 {
		// At the boundary: when an entry leaves the first quota's window, or 1ms before.
		g.now = l[g.rng.IntN(len(l))].score + quotas[0].Limit.Window.Milliseconds() - g.rng.Int64N(2)
	}
	req := throttle.Request{
		Key:    key,
		Quotas: quotas,
		Cost:   1 + g.rng.IntN(most),
		Member: g.member(),
	}
	if g.rng.IntN(4) == 0 {
		req.Cost = 0 // the default, 1
	}
	switch g.rng.IntN(6) {
	case 0, 1:
		req.Reservation = g.token()
	case 2: // the same id for both, as a caller may pass a task id as each
		req.Reservation = req.Member
	}
	return modelOp{req: req, at: g.now, why: "new"}
}

// done records op's decision. After a denial (that did not find a reservation: one made
// earlier has seen traffic since; nor took another's: that slot has seen the victim's
// traffic) it sometimes plans the same event (a new member) 1ms
// before RetryAt, which must be denied with RetryAfter 1ms, and at RetryAt, which must be
// admitted, with nothing in between (rule 4; for a reservation, the header's "called again
// then with the same Reservation, it is admitted").
func (g *modelGen) done(op modelOp) {
	g.past = append(g.past, op)
	if len(g.past) > 40 {
		g.past = g.past[1:]
	}
	if op.req.Reservation != "" {
		g.waiting = slices.DeleteFunc(g.waiting, func(w modelOp) bool { return w.req.Reservation == op.req.Reservation })
		if op.decision.Reserved {
			g.waiting = append(g.waiting, op)
		}
		if len(g.waiting) > 20 { // the oldest never comes back
			g.waiting = g.waiting[1:]
		}
	}
	if op.decision.Allowed || op.note.holds || op.note.fair || len(g.plan) > 0 || op.why == "retry" || op.why == "probe" || g.rng.IntN(100) >= 20 {
		return
	}
	retry := op.decision.RetryAfter.Milliseconds()
	req := op.req
	if retry > 1 {
		req.Member = g.member()
		g.plan = append(g.plan, modelOp{req: req, at: op.at + retry - 1, why: "probe"})
	}
	req.Member = g.member()
	g.plan = append(g.plan, modelOp{req: req, at: op.at + retry, why: "retry"})
}

// TestLimiter_AllowAt_matchesModel checks the script against the reference model: for
// each seed, a few thousand random requests (four task types, hostile tenants, one to
// three quotas of 1-8 events per 1-50ms, random costs, reservations, a clock that mostly
// moves forward 0-20ms but sometimes jumps back or ahead, calls retried with the same
// member, tasks coming back for their reservation, probes around RetryAt) must get
// identical decisions, leave identical sets and set the TTLs the contract asks for.
// Replay one seed with -model.seed=N (and -model.steps=N for more steps).
func TestLimiter_AllowAt_matchesModel(t *testing.T) {
	t.Parallel()
	seeds := modelSeeds
	if *modelSeed != 0 {
		seeds = []uint64{*modelSeed}
	}
	srv := redistest.StartServer(t)
	var mu sync.Mutex
	total := map[string]int{}
	t.Run("seeds", func(t *testing.T) {
		for _, seed := range seeds {
			t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
				t.Parallel()
				rdb := &observingClient{Client: srv.Client()}
				// Each seed its own prefix: the seeds share the server, never a key. And
				// its MaxSkew, so that the grace (ARGV[8]) is not always the default.
				cfg := throttle.Config{Prefix: "seed" + strconv.FormatUint(seed, 10), MaxSkew: modelSkew(seed)}
				l, err := throttle.New(rdb, cfg)
				if err != nil {
					t.Fatal(err)
				}
				stats := runModel(t, l, rdb, modelGrace(cfg), seed, *modelSteps)
				t.Logf("seed %d, %d steps, grace %dms: %v", seed, *modelSteps, modelGrace(cfg), stats)
				mu.Lock()
				defer mu.Unlock()
				for c, n := range stats {
					total[c] += n
				}
			})
		}
	})
	if t.Failed() || *modelSeed != 0 {
		return
	}
	// The generator must reach every case it exists for, or the test proves little.
	for _, c := range modelCases {
		if total[c] == 0 {
			t.Errorf("no step was %q in %d seeds of %d steps: %v", c, len(seeds), *modelSteps, total)
		}
	}
}

// modelSkew is the Config.MaxSkew of seed's limiter: the default (grace 2s), a shorter one
// (grace 500ms, under the longest windows) or none (the check off: grace 2s still). AllowAt
// never checks the skew: MaxSkew only sets the grace.
func modelSkew(seed uint64) time.Duration {
	return []time.Duration{0, 250 * time.Millisecond, -1}[seed%3]
}

// modelCases are the cases the seeds must reach together.
var modelCases = []string{"admitted", "denied", "replay", "replayWhenFull", "deniedAgain", "probeDenied", "retryAdmitted",
	"cost>1", "multiQuota", "deniedBy2nd+", "fewestLeftTie", "retryTie", "callerBehind", "futureEntryCounted", "trimmed",
	"reserved", "reservationNotDue", "reservationDueAdmitted", "reservationDueDenied", "reservationLapsed", "fairSlot",
	"replayPartial", "replayOutsideWindows", "againAfresh", "reservationLapsedInGrace", "reservationSplit"}

// runModel runs steps requests of seed against l and the model and returns how often each
// case came up.
func runModel(t *testing.T, l *throttle.Limiter, rdb *observingClient, grace int64, seed uint64, steps int) map[string]int {
	t.Helper()
	ctx := context.Background()
	g := newModelGen(seed)
	m := newModel(grace)
	var trace []modelOp
	fail := func(format string, a ...any) {
		t.Helper()
		start := max(len(trace)-40, 0)
		var b strings.Builder
		for i, op := range trace[start:] {
			fmt.Fprintf(&b, "\n  step %d: %s", start+i, op)
		}
		t.Fatalf("seed %d, step %d: %s\nlast steps (-> the model's decision):%s\nreplay: go test ./throttle -run 'TestLimiter_AllowAt_matchesModel' -model.seed=%d -model.steps=%d",
			seed, len(trace)-1, fmt.Sprintf(format, a...), b.String(), seed, steps)
	}
	stats := map[string]int{}
	for range steps {
		op := g.next(m)
		before := map[modelLog]modelSet{}
		for _, q := range op.req.Quotas {
			id := modelLogOf(op.req.Key, q.Scope)
			before[id] = slices.Clone(m.logs[id])
		}
		want, ttls, note := m.decide(op.req, op.at)
		op.decision, op.note = want, note
		trace = append(trace, op)

		rdb.calls = nil
		d, err := l.AllowAt(ctx, op.req, time.UnixMilli(op.at))
		if err != nil {
			fail("AllowAt: %v", err)
		}
		if got := modelDecisionOf(d); got != want {
			fail("decisions differ:\nscript %s\nmodel  %s", got, want)
		}
		if d.SkewFallback || d.RetryAt() != time.UnixMilli(op.at).Add(d.RetryAfter) {
			fail("SkewFallback %v, RetryAt %v: AllowAt never falls back and RetryAt is At+RetryAfter", d.SkewFallback, d.RetryAt())
		}
		if len(rdb.calls) != 1 {
			fail("%d script calls observed, want 1", len(rdb.calls))
		}
		checkSets(fail, l, m, op, rdb.calls[0], ttls, d.ServerTime.UnixMilli())

		// Rule 4 on the model itself: at RetryAt the event fits (or its reservation is
		// due and fits), 1ms before it does not.
		switch op.why {
		case "probe":
			if want.Allowed || want.RetryAfter != time.Millisecond {
				fail("1ms before RetryAt: %s, want a denial with RetryAfter 1ms", want)
			}
		case "retry":
			if !want.Allowed || want.Replay {
				fail("at RetryAt with no traffic since the denial: %s, want an admission", want)
			}
		}
		countModelCase(stats, op, before[modelLogOf(op.req.Key, op.req.Quotas[0].Scope)], m)
		g.done(op)
	}
	return stats
}

// modelResKey returns the key of the reservation set beside log, as the script's header
// places it: "reserved:" right after the hash tag.
func modelResKey(log string) string {
	i := strings.Index(log, "}:") + len("}:")
	return log[:i] + "reserved:" + log[i:]
}

// checkSets compares what the script call left in Redis with the model: every set the
// call got holds exactly the model's entries; a set the call wrote has the TTL the
// contract asks for (read as PTTL <= ttl <= PEXPIRETIME - the server's TIME during the
// call: the server's clock moves on during the call); a set the call did not write has no
// TTL (the test removes every TTL after reading it), or does not exist.
func checkSets(fail func(string, ...any), l *throttle.Limiter, m *model, op modelOp, call observedCall, ttls map[modelTTL]int64, serverMS int64) {
	want := map[string]modelTTL{}
	for _, q := range op.req.Quotas {
		id := modelLogOf(op.req.Key, q.Scope)
		key := l.RedisKey(op.req.Key, q.Scope)
		want[key] = modelTTL{log: id}
		// The reservation set beside each log, token or not (trimmed with the log); the
		// owners hash only with a token and a type-wide quota.
		want[modelResKey(key)] = modelTTL{log: id, res: true}
		if op.req.Reservation != "" && q.Scope == throttle.ScopeType {
			want[strings.TrimSuffix(key, "type")+"owners"] = modelTTL{log: id, owners: true}
		}
	}
	if len(call.keys) != len(want) {
		fail("the script got %d keys, want %d: %v", len(call.keys), len(want), want)
	}
	for _, o := range call.keys {
		set, ok := want[o.key]
		if !ok {
			fail("the script got key %q, not one of the request's", o.key)
		}
		if set.owners {
			wantHash := m.owners[set.log.taskType]
			if len(o.hash) != len(wantHash) || !maps.Equal(o.hash, wantHash) {
				fail("%s differs:\nscript %v\nmodel  %v", o.key, o.hash, wantHash)
			}
			checkTTL(fail, o, op, ttls, set, len(o.hash) > 0, serverMS)
			continue
		}
		wantSet := m.logs[set.log]
		if set.res {
			wantSet = m.reserved[set.log]
		}
		var got, wantZ []string
		for _, z := range o.zset {
			if z.Score != float64(int64(z.Score)) {
				fail("%s holds %q at %v, not a whole ms", o.key, z.Member, z.Score)
			}
			got = append(got, fmt.Sprintf("%d:%q", int64(z.Score), z.Member))
		}
		for _, e := range wantSet {
			wantZ = append(wantZ, fmt.Sprintf("%d:%q", e.score, e.name))
		}
		if !slices.Equal(got, wantZ) {
			fail("%s differs:\nscript %v\nmodel  %v", o.key, got, wantSet)
		}
		checkTTL(fail, o, op, ttls, set, len(got) > 0, serverMS)
	}
}

// checkTTL checks the TTL of one key the call got: as the model says if the call wrote
// it, else none (-1), or no key (-2) if it is empty.
func checkTTL(fail func(string, ...any), o observedKey, op modelOp, ttls map[modelTTL]int64, set modelTTL, exists bool, serverMS int64) {
	ttl, written := ttls[set]
	switch {
	case written && (o.pttl > ttl || o.expireTime-serverMS < ttl):
		fail("%s: PTTL %d ms, PEXPIRETIME - TIME %d ms; want the TTL set to %d ms in between", o.key, o.pttl, o.expireTime-serverMS, ttl)
	case !written && exists && (o.pttl != -1 || o.expireTime != -1):
		fail("%s: PTTL %d, PEXPIRETIME %d after %s; want -1 (no PEXPIRE)", o.key, o.pttl, o.expireTime, op.decision)
	case !exists && (o.pttl != -2 || o.expireTime != -2):
		fail("%s: PTTL %d, PEXPIRETIME %d for an empty set; want -2 (no key)", o.key, o.pttl, o.expireTime)
	}
}

// countModelCase counts the cases op exercised, so that the test can require each.
// before is the log of op's first quota before the call; m is the model after it.
func countModelCase(stats map[string]int, op modelOp, before modelSet, m *model) {
	d, n := op.decision, op.note
	inc := func(c string, cond bool) {
		if cond {
			stats[c]++
		}
	}
	inc("admitted", d.Allowed && !d.Replay)
	inc("replay", d.Replay)
	inc("replayWhenFull", d.Replay && slices.ContainsFunc(n.left, func(l int) bool { return l < max(op.req.Cost, 1) }))
	inc("replayPartial", n.replayPartial)
	inc("replayOutsideWindows", n.replayOutside)
	inc("againAfresh", strings.HasPrefix(op.why, "again") && op.admitted && !d.Replay)
	inc("denied", !d.Allowed)
	inc("deniedAgain", !d.Allowed && strings.HasPrefix(op.why, "again"))
	inc("probeDenied", op.why == "probe")
	inc("retryAdmitted", op.why == "retry")
	inc("cost>1", d.Allowed && !d.Replay && op.req.Cost > 1)
	inc("multiQuota", len(op.req.Quotas) > 1)
	inc("deniedBy2nd+", !d.Allowed && d.Quota != op.req.Quotas[0])
	inc("callerBehind", slices.ContainsFunc(before, func(e modelEntry) bool { return e.score > op.at && !e.reserved }))
	inc("futureEntryCounted", !d.Allowed && !n.holds && d.RetryAfter > d.Quota.Limit.Window)
	inc("trimmed", d.Allowed && !d.Replay && len(m.logs[modelLogOf(op.req.Key, op.req.Quotas[0].Scope)]) < len(before)+max(op.req.Cost, 1))
	inc("reserved", d.Reserved && !n.holds)
	inc("reservationNotDue", n.holds && !n.due)
	inc("reservationDueAdmitted", n.due && d.Allowed)
	inc("reservationDueDenied", n.due && !d.Allowed)
	inc("reservationLapsed", op.why == "back" && !n.holds)
	inc("reservationLapsedInGrace", n.lapsed && !n.holds)
	inc("reservationSplit", n.split)
	inc("fairSlot", n.fair)
	if len(n.left) > 1 && d.Allowed {
		least := slices.Min(n.left)
		inc("fewestLeftTie", len(slices.DeleteFunc(slices.Clone(n.left), func(x int) bool { return x != least })) > 1)
	}
	if !d.Allowed && !n.holds && len(n.waits) > 1 {
		wait := d.RetryAfter.Milliseconds()
		inc("retryTie", len(slices.DeleteFunc(slices.Clone(n.waits), func(x int64) bool { return x != wait })) > 1)
	}
}

// modelStep is one call of a fixed sequence: a request at an instant, and for the calls
// that matter, the decision the contract asks for.
type modelStep struct {
	at     int64
	tenant string
	quotas []throttle.Quota
	cost   int
	member string
	token  string
	want   *modelDecision // nil: whatever the model decides
}

// checkSequence makes the calls of steps on a fresh server, for the task type "api:call",
// and requires of each the model's decision, sets and TTLs; and of a step with want, that
// the model's decision is want (so the expectation is written out, not only computed).
func checkSequence(t *testing.T, steps []modelStep) {
	t.Helper()
	rdb := &observingClient{Client: redistest.Start(t)}
	l, err := throttle.New(rdb, throttle.Config{})
	if err != nil {
		t.Fatal(err)
	}
	m := newModel(modelGrace(throttle.Config{}))
	var trace []string
	for i, s := range steps {
		op := modelOp{req: throttle.Request{Key: throttle.Key{TaskType: "api:call", Tenant: s.tenant}, Quotas: s.quotas,
			Cost: s.cost, Member: s.member, Reservation: s.token}, at: s.at, why: "step"}
		var ttls map[modelTTL]int64
		op.decision, ttls, _ = m.decide(op.req, op.at)
		trace = append(trace, op.String())
		fail := func(format string, a ...any) {
			t.Helper()
			t.Fatalf("step %d: %s\nsteps (-> the contract's decision):\n  %s", i, fmt.Sprintf(format, a...), strings.Join(trace, "\n  "))
		}
		if s.want != nil && op.decision != *s.want {
			fail("the model decides %s, the test expects %s", op.decision, *s.want)
		}
		rdb.calls = nil
		d, err := l.AllowAt(context.Background(), op.req, time.UnixMilli(op.at))
		if err != nil {
			fail("AllowAt: %v", err)
		}
		if got := modelDecisionOf(d); got != op.decision {
			fail("decisions differ:\nscript %s\nwant   %s", got, op.decision)
		}
		if len(rdb.calls) != 1 {
			fail("%d script calls observed, want 1", len(rdb.calls))
		}
		checkSets(fail, l, m, op, rdb.calls[0], ttls, d.ServerTime.UnixMilli())
	}
}

func msQuota(scope throttle.Scope, events int, windowMS int64) throttle.Quota {
	return throttle.Quota{Scope: scope, Limit: throttle.Limit{Events: events, Window: msDuration(windowMS)}}
}

// The sequences below use windows of a second or more: a TTL of a few ms can run out
// inside the MULTI/EXEC that observes it (see modelUnit).

// TestLimiter_AllowAt_replayTakesNoSlot: a call retried with the same member after its
// entries left one of its logs (trimmed there) but not another is a replay, and must take
// no slot in either (header: "a call that finds it in a log reports the admission again
// and writes nothing"). The tenant quota is 1 per 1s, the type quota 5 per 10s; the grace
// is 2s.
func TestLimiter_AllowAt_replayTakesNoSlot(t *testing.T) {
	t.Parallel()
	tenant, typ := msQuota(throttle.ScopeTenant, 1, 1000), msQuota(throttle.ScopeType, 5, 10000)
	q := []throttle.Quota{tenant, typ}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "acme", quotas: q, member: "a"},
		{at: 3000, tenant: "acme", quotas: q, member: "b"}, // trims <= 0 from the tenant log: a, there only
		// a again: still in the type log, so a replay; it must not write a into the
		// tenant log.
		{at: 4000, tenant: "acme", quotas: q, member: "a", want: &modelDecision{Allowed: true, Replay: true,
			Quota: tenant, Count: 0, Remaining: 1, ResetAfter: msDuration(9000), At: 4000}},
		// The tenant's window (3100, 4100] holds no admission: c fits.
		{at: 4100, tenant: "acme", quotas: q, member: "c", want: &modelDecision{Allowed: true,
			Quota: tenant, Count: 1, Remaining: 0, ResetAfter: msDuration(10000), At: 4100}},
	})
}

// TestLimiter_AllowAt_replayTakesNoSlotAfterItsWindow: an admission outlives its window by
// the grace (2s), and a call repeating it finds it there: a replay, though it counts in no
// window, and though the quota (1 per 1s) is full; it writes nothing. Once a write has
// trimmed it, the same member is decided afresh.
func TestLimiter_AllowAt_replayTakesNoSlotAfterItsWindow(t *testing.T) {
	t.Parallel()
	tenant := msQuota(throttle.ScopeTenant, 1, 1000)
	q := []throttle.Quota{tenant}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "acme", quotas: q, member: "a"},
		{at: 2500, tenant: "acme", quotas: q, member: "b"}, // trims <= -500: a stays
		{at: 2600, tenant: "acme", quotas: q, member: "a", want: &modelDecision{Allowed: true, Replay: true,
			Quota: tenant, Count: 1, Remaining: 0, ResetAfter: msDuration(900), At: 2600}},
		{at: 5000, tenant: "acme", quotas: q, member: "c"}, // trims <= 2000: a goes
		{at: 5100, tenant: "acme", quotas: q, member: "a", want: &modelDecision{
			Quota: tenant, Count: 1, Remaining: 0, RetryAfter: msDuration(900), ResetAfter: msDuration(900), At: 5100}},
	})
}

// TestLimiter_AllowAt_dueReservationCountsOnlyItsOwnEntries: a due reservation does not
// count its own entries, and only those in the window. First: a caller 500ms ahead admits
// c at 2000 (before the grace, that call trimmed TB's entry from the log and not from its
// reservation set; now both keep it, and checkSequence compares both). The window
// (500, 1500] holds only TB's own entry, and the admission at 2000 counts: the type quota
// (1 per 1s) is full, and TB must wait until 3000. Admitting TB at 1500 puts two
// admissions in (1000, 2000]. Second: one log, two quotas (1 per 1s, 10 per 10s); TB's
// own entry at 1000 has left the 1s window at 2100, so there it takes nothing off the
// count: TB is admitted with 1 counted, 0 remaining (not 0 and 1).
func TestLimiter_AllowAt_dueReservationCountsOnlyItsOwnEntries(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 1, 1000)
	q := []throttle.Quota{typ}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, member: "a"},
		{at: 500, tenant: "B", quotas: q, member: "b1", token: "TB", want: &modelDecision{Reserved: true,
			Quota: typ, Count: 1, RetryAfter: msDuration(500), ResetAfter: msDuration(1500), At: 500}}, // holds 1000
		{at: 2000, tenant: "C", quotas: q, member: "c"}, // ahead: admitted, trims <= -1000
		{at: 1500, tenant: "B", quotas: q, member: "b2", token: "TB", want: &modelDecision{Reserved: true,
			Quota: typ, Count: 1, RetryAfter: msDuration(1500), ResetAfter: msDuration(1500), At: 1500}},
	})

	second, ten := msQuota(throttle.ScopeType, 1, 1000), msQuota(throttle.ScopeType, 10, 10000)
	q = []throttle.Quota{second, ten}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, member: "a"},
		{at: 500, tenant: "B", quotas: q, member: "b1", token: "TB", want: &modelDecision{Reserved: true,
			Quota: second, Count: 1, RetryAfter: msDuration(500), ResetAfter: msDuration(10500), At: 500}}, // holds 1000
		{at: 2100, tenant: "B", quotas: q, member: "b2", token: "TB", want: &modelDecision{Allowed: true,
			Quota: second, Count: 1, Remaining: 0, ResetAfter: msDuration(10000), At: 2100}},
	})
}

// TestLimiter_AllowAt_dueReservationLapsedReservesAgain: a reservation lapses one window
// after its instant, though the grace keeps its entry: TB's at 1000 (1 per 1s) has lapsed
// at 2500, so TB is denied like a new event behind c's admission at 2400, and reserves
// again at 3400: its entry moves there (in the log and in the reservation set). It counts
// for no one in between, and at 3400 TB is admitted.
func TestLimiter_AllowAt_dueReservationLapsedReservesAgain(t *testing.T) {
	t.Parallel()
	typ := msQuota(throttle.ScopeType, 1, 1000)
	q := []throttle.Quota{typ}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, member: "a"},
		{at: 100, tenant: "B", quotas: q, member: "b1", token: "TB", want: &modelDecision{Reserved: true,
			Quota: typ, Count: 1, RetryAfter: msDuration(900), ResetAfter: msDuration(1900), At: 100}}, // holds 1000
		{at: 2400, tenant: "C", quotas: q, member: "c"}, // trims <= -600: TB's entry stays
		{at: 2500, tenant: "B", quotas: q, member: "b2", token: "TB", want: &modelDecision{Reserved: true,
			Quota: typ, Count: 1, RetryAfter: msDuration(900), ResetAfter: msDuration(1900), At: 2500}}, // holds 3400
		{at: 3400, tenant: "B", quotas: q, member: "b3", token: "TB", want: &modelDecision{Allowed: true,
			Quota: typ, Count: 1, Remaining: 0, ResetAfter: msDuration(1000), At: 3400}},
	})
}

// TestLimiter_AllowAt_fairSwapKeepsTheVictimsTenantLimit: when a tenant's event takes
// another tenant's reservation on the type-wide log (the fair share), the victim's
// reservation moves there only; its entry in its own tenant log stays where it was. Due
// at its new instant, the victim must still find its tenant's window full if it is:
// tenant B's quota is 1 per 1s and B ran at 20100, so TB3 is denied at 21000, until
// 21100. Admitting it puts two of B's admissions in (20000, 21000]. No clock runs behind.
func TestLimiter_AllowAt_fairSwapKeepsTheVictimsTenantLimit(t *testing.T) {
	t.Parallel()
	tenant, typ := msQuota(throttle.ScopeTenant, 1, 1000), msQuota(throttle.ScopeType, 2, 10000)
	q := []throttle.Quota{tenant, typ}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "B", quotas: q, member: "b1", token: "TB1"}, // admitted
		{at: 0, tenant: "B", quotas: q, member: "b2", token: "TB2"}, // holds 1000
		{at: 0, tenant: "B", quotas: q, member: "b3", token: "TB3"}, // holds 10000
		{at: 0, tenant: "B", quotas: q, member: "b4", token: "TB4"}, // holds 11000
		{at: 0, tenant: "B", quotas: q, member: "b5", token: "TB5"}, // holds 20000
		// C takes TB3's slot at 10000; TB3 moves to 21000 on the type-wide log.
		{at: 100, tenant: "C", quotas: q, member: "c1", token: "TC1", want: &modelDecision{Reserved: true,
			Quota: typ, Count: 5, RetryAfter: msDuration(9900), ResetAfter: msDuration(30900), At: 100}},
		{at: 20100, tenant: "B", quotas: q, member: "b8", token: "TB5"}, // admitted at 20100
		{at: 21000, tenant: "B", quotas: q, member: "b9", token: "TB3", want: &modelDecision{Reserved: true,
			Quota: tenant, Count: 1, RetryAfter: msDuration(100), ResetAfter: msDuration(10000), At: 21000}},
	})
}

// TestLimiter_AllowAt_dueReservationRetryAfter: a due reservation blocked only by an
// admission scored after now (a caller ahead, under a higher limit) must wait until that
// admission leaves the window (header: retry-after is the k-th oldest counted score +
// window - now), not one window from now: c at 1400 holds the room until 2400.
func TestLimiter_AllowAt_dueReservationRetryAfter(t *testing.T) {
	t.Parallel()
	two, three := msQuota(throttle.ScopeType, 2, 1000), msQuota(throttle.ScopeType, 3, 1000)
	q := []throttle.Quota{two}
	checkSequence(t, []modelStep{
		{at: 0, tenant: "A", quotas: q, member: "a1"},
		{at: 0, tenant: "A", quotas: q, member: "a2"},
		{at: 500, tenant: "B", quotas: q, cost: 2, member: "b1", token: "TB"}, // holds 1000
		{at: 1400, tenant: "C", quotas: []throttle.Quota{three}, member: "c"}, // ahead, another limit
		{at: 1100, tenant: "B", quotas: q, cost: 2, member: "b2", token: "TB", want: &modelDecision{Reserved: true,
			Quota: two, Count: 1, Remaining: 1, RetryAfter: msDuration(1300), ResetAfter: msDuration(1300), At: 1100}},
		{at: 2400, tenant: "B", quotas: q, cost: 2, member: "b3", token: "TB", want: &modelDecision{Allowed: true,
			Quota: two, Count: 2, Remaining: 0, ResetAfter: msDuration(1000), At: 2400}},
	})
}
