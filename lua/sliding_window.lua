-- sliding_window.lua: decide one event against every quota of its rule, all or nothing, in
-- one atomic call; hold, claim and release reservations; share type-wide quotas fairly.
--
-- STATE. Each quota scope of a rule (a tenant's, or the task type's) has a window log L, a
-- sorted set with one entry per event, scored by its instant in ms, whatever its cost:
--   "<id>"                 an admission of cost 1 (id: the caller's member, 96 random bits)
--   "*<cost>:<id>"         an admission of cost > 1
--   "@<cost>:<token>"      a reservation (token: the waiting task), or one claimed ahead
--   "~<cost>:<token>@<ms>" a released weighted reservation that counts until it leaves
--   "#", "#f"              sentinels, scored below -2^50 (see SKEW)
--   "#p"                   a pause: -2^51 + the instant it ends (see PAUSE); in force while
--                          that instant is after now, removed by the first write after it
--   "#e"                   an end-slot hint: -2^52 + limit * 2^32 + window ms, the quota it
--                          holds for (see END SLOT HINT); only beside "#f"
-- P beside it lists the log's pending reservations ("<cost>:<token>" scored at their
-- instant), C its entries of cost > 1 ("<cum>|<L member>", <cum> 16 digits: the sum of
-- cost - 1 over C's entries up to this one, in score order). So the slots of a window
-- (a, b] are ZCOUNT(L, a, b) plus a difference of two <cum>s: O(log N), one entry per event.
-- Per task type: LEASES (hash: token -> "<cost>:<scopes>:<created ms>:<n>:<holder><tenant>",
-- holder n bytes, after "p<priority>:" for a priority above 0; scopes: "t" and "y" in log
-- order, then, with a tenant log, "=" and its quotas as "<limit>/<window ms>" joined by ","), FAIRQ (sorted set: token -> fair tag), FAIRH (hash: "v" -> the tag of
-- the latest claimed reservation, "l:<tenant>" -> the tenant's latest tag).
--
-- THE RULE (README.md, The script). Cost c fits at instant t iff, for every quota (limit, W), every
-- window (x - W, x] with t <= x < t + W holds at most limit - c, each entry counted at its
-- own instant, past or future. An event is decided at the earliest t >= now at which it
-- fits every quota: admitted if t <= now + wait (for instant t: the caller starts then);
-- otherwise, with a token, it reserves t (an entry at t, so nothing decided later can take
-- that slot); without one it is denied with retry_after = t - now, writing nothing.
--
-- BOUNDED WORK. fits(t) first tries two O(log N) bounds per quota: the window ending at t
-- (over: no), and every entry that can share a window with t, scored in (t - W, t + W)
-- (room: yes). Only in between does it read those entries, at most K_SCAN, else "no"
-- (later than needed, never too early). On one log, the earliest t >= t0 is t0, else the
-- first of K_CAND instants at which an entry leaves a window (e + W) before the log's end
-- slot, else, on a log of cost-1 entries sparse after t0, a slot gap_slot finds before the
-- end slot in at most K_GAP bisection rounds, else the end slot (the first instant after
-- its newest entry with room: one rank, or a bisection over ranks with <cum>). Logs
-- alternate for at most K_ITER rounds, else the latest end slot wins (every log has room
-- from its end slot on). Other loops state their bounds inline.
--
-- SKEW. Sentinel "#" scores -2^51 + 16 * hw + flags, hw being the latest instant a write to
-- the log was decided at, flags telling whether C may hold entries (1), "#f" is there (2),
-- P may hold entries (4) and "#p" is there (8); "#f" scores -2^51 + the latest instant ever written, when it
-- is after hw. A call stamped
-- before hw is decided at hw, and its retry_after is given on its own clock. Writes trim
-- entries at or before hw - W and never later ones, so no call can count a window another
-- call has trimmed: a log holds its longest window's entries and its sentinels ("#", "#f", "#p"), and
-- at most K_TRIM - 1 entries that have left it (the fast path trims lazily), no more.
-- A caller's clock further than max_skew from the server's TIME is replaced by TIME
-- (skewed): the script checks before a write, unless the caller vouches for its clock
-- (ARGV[4] "~<ms>": throttle.Limiter checked it against TIME within the last second).
--
-- CLAIMS. A token pending at r with r <= now + claim_wait is claimed: for instant r if r
-- >= now (the slot was promised; the caller waits until r) and every window ending at r
-- still holds at most its limit (it always does unless a rule lowered a limit since the
-- reservation was made), else (late, but within the claim timeout, or no longer fitting)
-- decided afresh without its reservation. A token pending further ahead is
-- denied until r, writing nothing. A reservation lapses claim_timeout after its instant:
-- each call first removes up to K_LAPSE lapsed reservations from each of its logs.
--
-- FAIRNESS. A reservation on a type quota carries a fair tag: max(V, the tenant's latest
-- tag) + round(cost * 10^6 / weight). An event of cost 1 that must reserve takes the slot
-- at its fair rank r (the number of tags <= its own) among the type log's pending
-- reservations: from the first pending at the r-th one's instant, the first of K_FAIR that
-- is another tenant's cost-1 reservation with a later tag on the type log (one ranked
-- before the event keeps its slot; moved on its own tenant log too,
-- under the quotas its lease records: movable),
-- after now and before its own earliest instant, where its other quotas have room. The
-- reservation it displaces moves to its own earliest instant, keeping its tag. Waiting tenants so share the type's slots in proportion to
-- their weights, and a share left unused goes to the others. A fair rank never displaces a
-- reservation of higher priority.
--
-- PRIORITY. An event of cost 1 with a token and a priority p > 0 (its lease records p)
-- that must reserve first looks for the earliest slot after now, and before its own
-- earliest instant, held by a pending reservation of lower priority: among the first
-- K_PRIO pending after now on the type log (else its tenant log), the first of cost 1
-- that is movable, where its other quotas have room. It is admitted for that slot if
-- within its wait, else reserves it; the reservation it displaces moves to its own
-- earliest instant, keeping its tag. Only the general path does this: a priority's
-- "p<p>:" before ARGV[5] fails the fast and one-log paths' cost-1 test.
--
-- SPACING. A call that spreads ("s:" before ARGV[5]'s cost) places a new reservation of
-- cost c whose binding quota (the one that holds it back) is a tenant quota of limit n
-- and window W at the earliest instant, from that quota's log's hiw (the latest instant
-- the log holds: "#f", else hw) + floor(c * W / n) on, at which it fits, rather than from
-- now on: a backlog's reservations go at the binding quota's average rate, not in bursts
-- at the instants of the admissions that filled its window (each window repeats the
-- first's). Reserving later than the earliest never breaks a window, and c <= n bounds
-- the step by W. An admission (at now or within the wait), a claim, a lower priority's
-- slot, a fair rank's displacement and a type quota's binding (its fair ranks interleave
-- tenants) are not spaced. The one-log path spaces an end slot (t >= hiw: nothing after
-- t, so room at t holds later) and hands a gap before hiw to general.
--
-- PAUSE. An event on a log paused until u > now (for an upstream 429) is denied until
-- the latest such u, writing nothing, before lapses and claims: the binding quota is the
-- first on a log paused that long. A pause never ends earlier when paused again (ZADD GT)
-- and grows the log's TTL to last until u. Flag 8 of "#" says "#p" is there: the fast and
-- one-log paths hand such a log to general without reading "#p" (a member lookup is a
-- scan of a small set's listpack).
--
-- END SLOT HINT. "#e" says that no instant from hw up to the log's latest instant (hiw,
-- "#f") has room for an event of cost 1 under the quota it names, and nothing lies after
-- hiw. Then the earliest instant such an event fits is the end slot, read in one or two
-- calls: hiw if its window holds fewer than limit, else the instant the (n - limit + 1)-th
-- entry of that window leaves it. Why it holds: the one-log path writes it with a
-- reservation at the earliest instant t (found exactly: not after a full page of K_CAND
-- candidates) when t >= hiw, so t becomes hiw and no earlier instant had room; adding
-- entries never makes room, and time only moves the range's start on. What could make
-- room or move hiw otherwise drops it: any write of the general path to the log (it
-- lapses reservations, decides late claims afresh, moves displaced ones), a release (op
-- "r"), the removal of "#f", a reservation at a new latest instant that was not found
-- exactly, and any write under another quota (a rule's change of limit or window: that
-- call trims by its own window, which may drop entries the hint's quota counts). A claim
-- on time keeps it: the reservation becomes the admission at the same instant. With the
-- hint, now may have room in its own window (not in one after it): such a call reserves
-- too. Without it, the one-log
-- path searches (the newest entry, the limit-th newest and K_CAND candidates): about four
-- commands more for every reservation behind a backlog.
--
-- WEIGHTED ENTRIES. Inserting or removing a cost > 1 entry rewrites the <cum> of the C
-- entries after it, at most K_RENUM. An event that could only be written before more than
-- K_RENUM of them is placed at its earliest instant after C's newest entry instead; a
-- release that would rewrite more leaves the entry counting, as "~", until it leaves its
-- window.
--
-- INTERFACE. KEYS: the window logs L of the call, "<prefix>:{<type>}:<scope>" (scope
-- "tenant:<escaped tenant>" or "type"). P, C, LEASES, FAIRQ and FAIRH are named from
-- KEYS[1]'s "<prefix>:{<type>}:" base, as asynq's own scripts name keys from a base: they
-- share its hash tag, so its slot on a cluster.
-- ARGV for a decision:
--   1 now_ms ("": the server's TIME)   2 member (unique per event), after a "!" when fresh
--   (never sent before, so not a replay: not looked for)   3 the sentinel score
--   for now_ms, as a string ("-2^51 + 16 * now_ms")   4 max_skew_ms: "0" trusts now_ms;
--   "<ms>" checks it against the server's TIME before a write (the skew check: further
--   than ms from it, the call is decided at TIME, skewed); "~<ms>" trusts it, the caller
--   having checked its clock against TIME within the last second (throttle.Limiter's
--   clock check), so no TIME is read for the check; ms also sets SLACK
--   5 "" for a cost-1 event with no reservation, else
--     "<cost>:<wait>:<claim timeout>:<claim wait>:<weight>:<n>:<token><n>:<holder><tenant>"
--     (times in ms; token and holder prefixed by their byte lengths), after "p<priority>:"
--     for a priority above 0 (at most 1000)
--   then per quota i: limit, window_ms, now_ms - window_ms (strings); with more than one
--   quota, a last ARGV of one digit per quota: the index of its log in KEYS.
-- Returns {code, count, retry_after_ms, at_ms, binding, server_ms}: code = allowed (1) +
--   replay (2) + skewed (4) + reserved (8) + held (16) + paused (32); at_ms is the instant decided at,
--   the admission's own when allowed; retry_after_ms counts from the caller's now_ms;
--   binding is the quota (1-based; 1 if omitted) that decided: when allowed, the one
--   with the fewest slots left; else the first with no room a millisecond before the
--   earliest instant the event fits at (the one that holds it back until then), else the
--   first with none at now; count is its
--   slots in the window ending at at_ms; server_ms is 0 (or omitted) when TIME was not read.
-- ARGV for a release: 1 "r"   2 token; KEYS[1]: LEASES. Returns 1 if the token held a
--   reservation, else 0.
-- ARGV for a pause: 1 "p"   2 its end, ms   3 now_ms; KEYS[1]: the log. Returns 0 (nothing
--   written) if it ends at or before now, else 1. For a resume: 1 "u"; KEYS[1]: the log.
--   Returns 1 if the log had a pause, else 0.

-- The call's KEYS and ARGV and library functions as locals (upvalues in functions): a
-- global costs a table lookup at each use, its field another. Numeric strings are
-- converted by arithmetic (s + 0), not tonumber: Lua 5.1's tonumber converts twice
-- (lua_isnumber, then lua_tonumber), each a strtod.
local KEYS, ARGV, call, format, byte, sub, match, find = KEYS, ARGV, redis.call, string.format, string.byte, string.sub, string.match, string.find
local K_SCAN, K_CAND, K_ITER, K_LAPSE, K_RENUM, K_FAIR, K_TRIM = 64, 4, 3, 8, 32, 8, 8
local K_CAND_ARG = '4' -- K_CAND as a LIMIT argument: a Lua number there costs Redis a %.17g format
local K_PRIO = 8 -- pending reservations a prioritized event examines (PRIORITY)
local K_GAP = 16 -- bisection rounds of gap_slot: a slot before the end slot among 2^16 entries
local DEFAULT_CLAIM_TIMEOUT = 5000 -- ms, throttle.DefaultClaimTimeout
local BASE = 2251799813685248 -- 2^51
local FLOOR = '-1125899906842624' -- -2^50: below every instant, above every sentinel
local FAIR_UNIT = 1000000
-- "#e" (END SLOT HINT) scores -2^52 + limit * 2^32 + window: for limits below 2^19 and
-- windows below 2^32 ms, exact in a double and below every other sentinel.
local HINT_BASE, HINT_LIMITS, HINT_WINDOWS = 4503599627370496, 524288, 4294967296
-- A key's TTL outlasts its newest entry by its longest window plus SLACK: 2 * max_skew
-- (ARGV[4]). Entries are scored on the callers' clocks but keys expire on the server's;
-- an admission may be stamped up to max_skew before the server's clock when it runs,
-- and its entry up to max_skew after it, so a key expiring a window after its last write
-- could vanish while a late-stamped call should still count its entries.
local MAX_SKEW = ARGV[4]
local CHECK = MAX_SKEW ~= nil and MAX_SKEW ~= '0' -- the skew check (ARGV[4], INTERFACE)
local VOUCHED = false -- the caller's now_ms is within MAX_SKEW of TIME: a lease records it
if CHECK and byte(MAX_SKEW, 1) == 126 then -- "~<ms>": the caller vouches for now_ms
  MAX_SKEW, CHECK, VOUCHED = sub(MAX_SKEW, 2), false, true
end
local SLACK = MAX_SKEW and MAX_SKEW ~= '0' and 2 * tonumber(MAX_SKEW) or 0

-- ---------------------------------------------------------------------------------------
-- The fast path: an event of cost 1 on logs that hold no reservation, no weighted entry
-- and nothing after their high-water instant, as most are. There a window's slots are
-- its log's size less the entries at or before its start (ZCARD and a short ZCOUNT, both
-- cheap in a small set), and the earliest instant with room is the k-th entry of the
-- window plus W, k = slots + 1 - limit. It decides as general() would, but reads the
-- server's TIME (for the skew check) only before a write: a denial is decided on the
-- caller's clock and replies server_ms 0. With one quota it also admits an event with a
-- token, a wait or a claim timeout, as the middleware sends for a task its rule does not
-- throttle, and hands any other decision of such an event over (having written nothing)
-- to the one-log path below; to general to reserve, to admit for a later instant, to
-- replay, or with a skewed clock.

local fast_hs = nil -- the fast path's read of "#" on a log it hands to the one-log path

repeat
  local extra = ARGV[5]
  if extra and byte(extra, 1) == 115 then -- "s:" (SPACING) spaces reservations only
    extra = sub(extra, 3)
  end
  if ARGV[1] == 'r' or ARGV[1] == 'p' or ARGV[1] == 'u' or ARGV[1] == '' or extra ~= '' and (byte(extra, 1) ~= 49 or byte(extra, 2) ~= 58) then
    break -- another op (release, pause, resume), the server's clock, or a cost other than 1
  end
  local caller, server_ms = (ARGV[1] + 0), 0
  if #ARGV == 8 then
    -- With a reservation token, a wait or a claim timeout (extra), as the middleware
    -- sends, it still admits at now on a plain log: there no reservation is pending, so
    -- the token holds none, and an admission at now reads and writes what the one-log
    -- path's would. Anything else with extra is the one-log path's (the first read, of
    -- "#", is all it repeats).
    -- One quota, one log: the commonest call, with no table but the reply. Scores and
    -- bounds go to Redis as the strings the caller computed (the sentinel at now, now -
    -- window), unless the log's high-water instant is later than the caller's now.
    local key, limit, w = KEYS[1], (ARGV[6] + 0), (ARGV[7] + 0)
    -- The sentinel and, unless the member is fresh, a replay.
    local fresh = byte(ARGV[2], 1) == 33
    local member = fresh and sub(ARGV[2], 2) or ARGV[2]
    local hs
    if fresh then
      hs = call('ZSCORE', key, '#')
    else
      local r = call('ZMSCORE', key, '#', member)
      if r[2] then
        break -- a replay
      end
      hs = r[1]
    end
    local sent, now = 0, caller
    if hs then
      local x = hs + BASE
      if x % 16 ~= 0 then
        fast_hs = hs -- not a replay (looked for, unless fresh): the one-log path reads no more of it
        break -- weighted entries, entries ahead, reservations or a pause
      end
      sent = 1
      if x / 16 > now then
        now = x / 16
      end
    end
    local at, lower, sentinel = ARGV[1], ARGV[8], ARGV[3]
    if now ~= caller then
      at, lower, sentinel = now, now - w, 16 * now - BASE
    end
    -- Below lower: "#" (sent) and the entries that have left the window (old). "-inf", not
    -- FLOOR: on a plain log "#" is the only sentinel, and an infinity parses faster.
    local below = call('ZCOUNT', key, '-inf', lower)
    local old = below - sent
    local lo = call('ZCARD', key) - below
    if lo >= limit then
      if extra ~= '' then
        break -- to reserve, or admit for later: the one-log path
      end
      -- The k-th entry of the window, k = lo + 1 - limit (the first unless a limit was
      -- lowered), by rank: a string, not a number, for Redis to parse (Redis 7.0 formats a
      -- Lua number with %.17g).
      local k = format('%d', below + lo - limit)
      local e = call('ZRANGE', key, k, k, 'WITHSCORES')
      return {0, lo, e[2] + w - caller, now}
    end
    if CHECK then -- the skew check, before a write
      local t = call('TIME')
      server_ms = t[1] * 1000 + math.floor(t[2] / 1000)
      if math.abs(caller - server_ms) > (MAX_SKEW + 0) then
        break
      end
    end
    -- The member is not in the log (ZMSCORE above, in this atomic call): one ZADD. The
    -- trim waits until K_TRIM entries have left the window (old, counted above), saving a
    -- call on most admissions: every count and rank here skips them, and they are at or
    -- before hw - W, where no later call's window reaches (calls are decided at hw or
    -- after). A log so holds at most K_TRIM - 1 entries beyond its window.
    call('ZADD', key, at, member, sentinel, '#')
    if old >= K_TRIM then
      call('ZREMRANGEBYSCORE', key, FLOOR, lower)
    end
    call('PEXPIRE', key, SLACK == 0 and ARGV[7] or format('%d', w + SLACK))
    return {1, lo + 1, 0, now, 1, server_ms}
  end
  local m, nq = #KEYS, (#ARGV - 6) / 3
  local qlogs = ARGV[#ARGV]
  -- Tables made at their size (a tenant's log and the type's, up to 4 quotas): each new
  -- index past a table's size reallocates it. wi[j]: the quota with log j's longest window.
  local lj, lim, win, wi = {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {false, false}
  for i = 1, nq do
    local j, w = byte(qlogs, i) - 48, (ARGV[4 + 3 * i] + 0)
    lj[i], lim[i], win[i] = j, (ARGV[3 + 3 * i] + 0), w
    if not wi[j] or win[wi[j]] < w then
      wi[j] = i
    end
  end
  local rl = 1 -- the replay check's log: the longest window
  for j = 2, m do
    if win[wi[j]] > win[wi[rl]] then
      rl = j
    end
  end
  local fresh = byte(ARGV[2], 1) == 33
  local member = fresh and sub(ARGV[2], 2) or ARGV[2]
  local now, sent, plain = caller, {0, 0}, true
  for j = 1, m do
    local hs
    if j == rl and not fresh then
      local r = call('ZMSCORE', KEYS[j], '#', member) -- the sentinel, and a replay
      if r[2] then
        plain = false
        break
      end
      hs = r[1]
    else
      hs = call('ZSCORE', KEYS[j], '#')
    end
    sent[j] = 0
    if hs then
      local x = hs + BASE
      if x % 16 ~= 0 then -- weighted entries, entries ahead, reservations, a pause: general
        plain = false
        break
      end
      sent[j] = 1
      if x / 16 > now then
        now = x / 16
      end
    end
  end
  if not plain then
    break -- a replay, a pause, or a log that is not plain
  end
  -- Nothing lies after now: a window's slots are the entries after its start.
  local lo, lower = {0, 0, 0, 0}, {0, 0, 0, 0}
  local binding, t = nil, now
  for i = 1, nq do
    local j = lj[i]
    lower[i] = now == caller and ARGV[5 + 3 * i] or format('%d', now - win[i])
    lo[i] = call('ZCOUNT', KEYS[j], '(' .. lower[i], '+inf')
    if lo[i] >= lim[i] then
      -- The k-th entry of the window, by rank, k = lo + 1 - limit. The binding quota is
      -- the first whose k-th entry leaves last: with nothing ahead, the first with no room
      -- at t - 1, as general's.
      local r = sent[j] + call('ZCOUNT', KEYS[j], FLOOR, lower[i]) + lo[i] - lim[i]
      local e = call('ZRANGE', KEYS[j], r, r, 'WITHSCORES')[2] + win[i]
      if e > t then
        binding, t = i, e
      end
    end
  end
  if binding then
    if extra ~= '' then
      break -- to reserve or admit for later
    end
    return {0, lo[binding], t - caller, now, binding}
  end
  if CHECK then -- the skew check, before a write
    local tm = call('TIME')
    server_ms = tm[1] * 1000 + math.floor(tm[2] / 1000)
    if math.abs(caller - server_ms) > (MAX_SKEW + 0) then
      break
    end
  end
  local at = now == caller and ARGV[1] or format('%d', now)
  local left = nil
  for i = 1, nq do
    if left == nil or lim[i] - lo[i] - 1 < left then
      binding, left = i, lim[i] - lo[i] - 1
    end
  end
  local sentinel = now == caller and ARGV[3] or format('%d', 16 * now - BASE)
  for j = 1, m do -- the member is in none of them: the replay check's log has the longest window
    -- The trim waits until K_TRIM entries have left the log's longest window, as the
    -- one-quota path's (why there): the log's size after the ZADD less "#", this entry and
    -- the rest of that window (lo).
    local i = wi[j]
    call('ZADD', KEYS[j], at, member, sentinel, '#')
    if call('ZCARD', KEYS[j]) - 2 - lo[i] >= K_TRIM then
      call('ZREMRANGEBYSCORE', KEYS[j], FLOOR, lower[i])
    end
    call('PEXPIRE', KEYS[j], SLACK == 0 and ARGV[4 + 3 * i] or format('%d', win[i] + SLACK))
  end
  return {1, lo[binding] + 1, 0, now, binding, server_ms}
until true

-- grow sets a per-type key's TTL to at least ttl ms: many logs share it, so never shorten
-- it. It sets it iff it is shorter, or none (a key just made): a script's commands share
-- one time snapshot, so PTTL < ttl iff PEXPIRE GT would set it. longer: the caller's
-- guess that it is shorter (a reservation at a new latest instant); then PEXPIRE GT, and
-- NX if that did nothing (GT counts no TTL as infinite): one call where it grows. Else
-- PTTL first: one call where it is long enough already, as when reservations share an
-- instant (row (e): a failing GT and NX were two).
local function grow(key, ttl, longer)
  local ms = format('%d', ttl)
  if longer then
    if call('PEXPIRE', key, ms, 'GT') == 0 then
      call('PEXPIRE', key, ms, 'NX')
    end
  elseif call('PTTL', key) < ttl then
    call('PEXPIRE', key, ms)
  end
end

-- ---------------------------------------------------------------------------------------
-- The one-log path: an event of cost 1 under one quota, with a token (as the middleware
-- sends), a wait or a claim timeout, on a log with no weighted entry: a throttled key
-- that holds reservations, typically. It decides as general below would, in straight-line
-- steps (one function, grow, above): the window at now; else, with the end-slot hint,
-- the end slot; else, with nothing ahead, the k-th entry of the window leaving it; else
-- the log's end slot and, before it, the first K_CAND instants where an entry leaves a
-- window (none fitting and the log sparse after now: general, for gap_slot). Then an
-- admission at now, a denial, or a new reservation (on a type log, at its fair rank; on
-- a tenant log spaced, SPACING, at the end slot). A token that holds a reservation due
-- within its claim wait claims it in place (one further ahead is denied until then). It
-- hands over to general, having written nothing (or taken back the one P entry it wrote
-- to find out), for anything else: a replay, a skewed
-- clock, a lapse due, a late claim (its L entry there, or trimmed: P says so), a lease
-- on other logs, an exact check, an admission for later, a spaced gap. About 14 commands
-- for a reservation on a tenant log with the hint (17 without), against general's 22 and
-- its tables; 15 for a claim on a type log, against 17.

repeat
  local extra, spread = ARGV[5], false
  if extra and byte(extra, 1) == 115 then -- "s:" (SPACING)
    extra, spread = sub(extra, 3), true
  end
  if #ARGV ~= 8 or #KEYS ~= 1 or ARGV[1] == '' or byte(extra, 1) ~= 49 or byte(extra, 2) ~= 58 then
    break -- another op, the server's clock, several quotas or logs, or a cost other than 1
  end
  local wait, ct, cw, weight, n, rest = match(extra, '^1:(%d+):(%d+):(%d+):(%d+):(%d+):(.*)$')
  local caller, server_ms = (ARGV[1] + 0), 0
  if CHECK then -- the skew check, as general's read_clock
    local tm = call('TIME')
    server_ms = tm[1] * 1000 + math.floor(tm[2] / 1000)
    if math.abs(caller - server_ms) > (MAX_SKEW + 0) then
      break
    end
  end
  n = (n + 0)
  local fresh = byte(ARGV[2], 1) == 33
  local key, member, token = KEYS[1], fresh and sub(ARGV[2], 2) or ARGV[2], sub(rest, 1, n)
  local pm = '1:' .. token
  -- The sentinels, a replay, and the token's reservation (its L entry: see the lapse check).
  local r
  if fast_hs then -- "#" and the replay check as the fast path read them
    local q = call('ZMSCORE', key, '#f', '@' .. pm, '#e')
    r = {fast_hs, q[1], nil, q[2], q[3]}
  else
    r = call('ZMSCORE', key, '#', '#f', fresh and '#' or member, '@' .. pm, '#e')
  end
  if r[3] and not fresh then
    break -- a replay
  end
  local flags, hw = 0, -1
  if r[1] then
    local x = r[1] + BASE
    flags = x % 16
    hw = (x - flags) / 16
  end
  if flags % 2 == 1 or flags >= 8 or r[4] and flags < 4 then
    break -- weighted entries, a pause (in force or past: general removes a past one), or no P
  end
  local hiw = r[2] and (r[2] + BASE) or hw
  local limit, w = (ARGV[6] + 0), (ARGV[7] + 0)
  -- The end-slot hint "#e" (END SLOT HINT) holds for this call's quota if it names it.
  local sig = limit < HINT_LIMITS and w < HINT_WINDOWS and limit * HINT_WINDOWS + w or nil
  local hinted = r[5] and true or false
  local hint_ok = hinted and r[2] and sig and r[5] + HINT_BASE == sig
  ct = (ct + 0)
  local now = caller > hw and caller or hw
  local nows = now == caller and ARGV[1] or format('%d', now)
  local lower = now == caller and ARGV[8] or format('%d', now - w)
  local base = match(key, '^.-}:')
  local part = sub(key, #base + 1)
  local pkey = base .. 'pending:' .. part
  if flags >= 4 then
    -- None pending may lapse (general lapses them). A read without scores (each returned
    -- score is a %.17g format).
    if #call('ZRANGEBYSCORE', pkey, FLOOR, format('%d', now - ct), 'LIMIT', '0', '1') > 0 then
      break
    end
  end
  -- The token's reservation on this log is its L entry (r[4]), unless a trim took that
  -- entry while P still holds it: a late claim (a reservation at or before now - W), or
  -- one that a call under a shorter window (a rule changed since) trimmed. The writes
  -- below check for that only where it matters, at no cost in the common case: an
  -- admission at now asks P, a reservation sets its lease only if the token has none
  -- (HSETNX); either hands such a token to general, which claims by P.

  if r[4] then
    -- The token holds a reservation at held (its L entry, as checked above). Due within
    -- the claim wait: the reservation becomes the admission, in place; further ahead:
    -- denied until then, writing nothing; past: general decides afresh without it.
    local held = (r[4] + 0)
    if held < now then
      break
    end
    if held > now + (cw + 0) then
      return {24, call('ZCOUNT', key, '(' .. lower, nows), held - caller, now, 1, server_ms}
    end
    -- The window ending at held, its reservation included, as the reply's count (the
    -- claim leaves it as it is): over the limit only after a rule lowered it, when general
    -- decides the claim afresh (claim_fits).
    local hs = format('%d', held)
    local count = call('ZCOUNT', key, '(' .. format('%d', held - w), hs)
    if count > limit then
      break
    end
    call('ZREM', pkey, pm)
    if call('ZCARD', pkey) == 0 then
      flags = flags - 4
    end
    call('ZREM', key, '@' .. pm)
    if part == 'type' then -- the type's virtual time moves to the claimed tag
      local tag = call('ZSCORE', base .. 'fair', token)
      if tag then
        call('ZREM', base .. 'fair', token)
        if (tag + 0) > ((call('HGET', base .. 'fairstate', 'v') or '0') + 0) then
          call('HSET', base .. 'fairstate', 'v', tag)
        end
      end
    end
    call('HDEL', base .. 'leases', token)
    local add = {hs, member, format('%d', 16 * now + flags - flags % 4 + (hiw > now and 2 or 0) - BASE), '#'}
    if hiw > now then -- the claim changes no count: "#e" for this quota holds as it was
      add[5], add[6] = format('%d', hiw - BASE), '#f'
      if hinted and not hint_ok then -- another quota's: this call's trim may free its slots
        call('ZREM', key, '#e')
      end
    elseif r[2] then
      call('ZREM', key, '#f', '#e') -- "#e" lives only beside "#f"
    end
    call('ZADD', key, unpack(add)) -- 4 or 6 values: the admission, "#" and perhaps "#f"
    call('ZREMRANGEBYSCORE', key, FLOOR, lower)
    local ttl = (hiw > now and hiw or now) - now + w + SLACK
    if flags >= 4 then
      ttl = ttl + ct
    end
    local ttls = format('%d', ttl) -- a number argument would cost Redis a %.17g format
    if flags >= 4 then
      call('PEXPIRE', pkey, ttls)
    end
    call('PEXPIRE', key, ttls)
    return {17, count, 0, held, 1, server_ms}
  end
  local lo = call('ZCOUNT', key, '(' .. lower, nows)
  local holder, hlen, tenant, fairq, tag, fair_rank = nil, nil, nil, nil, nil, nil
  if token ~= '' and (lo >= limit or hint_ok and hiw > now) then
    -- No room at now (or, by the hint, in a window after it): it will reserve (or be
    -- admitted for later). Its lease's holder and
    -- tenant, and on a type log its fair tag and rank: a reservation waiting at that rank
    -- may be one to displace (FAIRNESS, below).
    local tail
    hlen, tail = match(sub(rest, n + 1), '^(%d+):(.*)$')
    local hn = (hlen + 0)
    holder, tenant = sub(tail, 1, hn), sub(tail, hn + 1)
    if part == 'type' then
      fairq = base .. 'fair'
      local fh = call('HMGET', base .. 'fairstate', 'v', 'l:' .. tenant)
      local v, l = ((fh[1] or '0') + 0), ((fh[2] or '0') + 0)
      tag = format('%d', (v > l and v or l) + math.floor(FAIR_UNIT / weight + 0.5))
      local rank = call('ZCOUNT', fairq, '-inf', tag)
      if call('ZCARD', pkey) > rank then
        fair_rank = rank
      end
    end
  end
  local t, exact_t = nil, true -- exact_t: t is the earliest instant cost 1 fits (see END SLOT HINT)
  if hint_ok and hiw > now then
    -- No instant in [now, hiw) fits, and nothing lies after hiw: the end slot is hiw if
    -- its window has room, else the instant the (n - limit + 1)-th entry of that window
    -- leaves it (an offset of n - limit, 0 unless a rule lowered the limit).
    local a = '(' .. format('%d', hiw - w)
    local n_t = call('ZCOUNT', key, a, format('%d', hiw))
    if n_t < limit then
      t = hiw
    else
      t = call('ZRANGEBYSCORE', key, a, '+inf', 'WITHSCORES', 'LIMIT', format('%d', n_t - limit), '1')[2] + w
    end
  elseif lo < limit then
    if hiw > now and call('ZCOUNT', key, '(' .. lower, format('%d', now + w - 1)) >= limit then
      break -- room at now, but perhaps not in a window after it: general's exact check
    end
    if flags >= 4 and token ~= '' and not r[4] and call('ZSCORE', pkey, pm) then
      break -- its reservation left L in a trim (above): general's late claim
    end
    t = now
  elseif hiw <= now then
    -- Nothing after now: the k-th entry of the window leaving it, k = lo + 1 - limit.
    local e
    if lo == limit then
      e = call('ZRANGEBYSCORE', key, '(' .. lower, '+inf', 'WITHSCORES', 'LIMIT', '0', '1')
    else
      local rank = format('%d', (r[1] and 1 or 0) + (r[2] and 1 or 0) + (hinted and 1 or 0) + call('ZCOUNT', key, FLOOR, lower) + lo - limit)
      e = call('ZRANGE', key, rank, rank, 'WITHSCORES')
    end
    t = e[2] + w
  else
    -- The end slot: after the newest entry, and after the limit-th newest leaves its window.
    local newest_at = (call('ZRANGE', key, '-1', '-1', 'WITHSCORES')[2] + 0)
    local tend = newest_at < now and now or newest_at
    local y = call('ZRANGE', key, '-' .. ARGV[6], '-' .. ARGV[6], 'WITHSCORES') -- -limit
    if y[1] and byte(y[1], 1) ~= 35 and y[2] + w > tend then -- not '#', '#f', '#p'
      tend = y[2] + w
    end
    -- Before it, the first K_CAND instants at which an entry leaves a window.
    local page = call('ZRANGEBYSCORE', key, '(' .. lower, format('%d', tend - w - 1), 'WITHSCORES', 'LIMIT', '0', K_CAND_ARG)
    local prev, exact = nil, false
    for i = 2, #page, 2 do
      local c = page[i] + w
      if c ~= prev then
        prev = c
        local a = '(' .. format('%d', c - w)
        if call('ZCOUNT', key, a, format('%d', c)) < limit then
          exact = hiw > c and call('ZCOUNT', key, a, format('%d', c + w - 1)) >= limit
          t = c
          break
        end
      end
    end
    if exact then
      break -- room at c, but perhaps not in a window after it: general's exact check
    end
    if not t and (call('ZCOUNT', key, '(' .. nows, '+inf') + limit) * w <= limit * (newest_at - now) then
      break -- sparse after now: general's gap_slot may find a slot before the end slot
    end
    -- The end slot is the earliest unless a full page left instants unchecked.
    exact_t = t ~= nil or #page < 2 * K_CAND
    t = t or tend
  end
  if t > now and t <= now + (wait + 0) then
    break -- an admission for later
  end
  if t > now and token == '' then
    return {0, lo, t - caller, now, 1, server_ms} -- a denial, writing nothing
  end
  local from = spread and t > now and part ~= 'type' and hiw + math.floor(w / limit)
  if from and t < from then
    -- SPACING, as general's: at or after hiw nothing lies after t, so room at t holds
    -- at every later instant; t before hiw (a gap) is general's to search from there.
    if t < hiw then
      break
    end
    t, exact_t = from, false -- not the earliest: no "#e" (END SLOT HINT)
  end
  -- FAIRNESS, as general's: from the instant of the reservation at the fair rank, the first
  -- of K_FAIR pending that is another tenant's, of cost 1 on this log alone (scopes "y"),
  -- priority 0 and a later tag, after now and before t. This event takes its slot (vs),
  -- and it moves to t, its own earliest instant too (the log's instants stay the same),
  -- keeping its lease and tag: one ZADD to P and the entries' ZADD move both. Met first,
  -- another tenant's on its own tenant log too (a tier's, its quotas in its lease) is
  -- general's to move: handed over, nothing written.
  local victim, vs, handover = nil, nil, false
  if fair_rank and t > now then
    local fr = format('%d', fair_rank)
    local at_rank = call('ZRANGE', pkey, fr, fr, 'WITHSCORES')[2]
    -- The page in two reads, its first entry and then the rest: the first is most often
    -- the one (each returned score costs a %.17g format, each lease a lookup).
    local from, done = 0, not at_rank
    while not done do -- two rounds: entries 1, then 2 to K_FAIR
      local n = from == 0 and 1 or K_FAIR - 1
      local page = call('ZRANGEBYSCORE', pkey, at_rank, '+inf', 'WITHSCORES', 'LIMIT', from == 0 and '0' or '1', from == 0 and '1' or format('%d', n))
      local tokens = {}
      for i = 1, #page, 2 do
        tokens[#tokens + 1] = sub(page[i], find(page[i], ':', 1, true) + 1)
      end
      local recs = #tokens > 0 and call('HMGET', base .. 'leases', unpack(tokens)) or {} -- at most K_FAIR - 1
      local tags = nil -- their fair tags, read once at the first candidate that needs them
      done = #tokens < n or from > 0
      for i = 1, #tokens do
        local s = (page[2 * i] + 0)
        if s >= t then
          done = true
          break
        end
        if recs[i] and s > now and sub(page[2 * i - 1], 1, 2) == '1:' then
          -- "<cost>:<scopes>:<created>:<n>:<holder><tenant>"; "p<priority>:..." does not match
          local vcost, vscopes, vn, vrest = match(recs[i], '^(%d+):([^:]+):%d+:(%d+):(.*)$')
          if vcost == '1' and sub(vrest, vn + 1) ~= tenant then
            tags = tags or call('ZMSCORE', fairq, unpack(tokens)) -- at most K_FAIR - 1
            if (tonumber(tags[i]) or 0) > (tag + 0) then
              if vscopes == 'y' then
                victim, vs, done = page[2 * i - 1], s, true
                break
              elseif find(vscopes, '=', 1, true) and find(match(vscopes, '^%a+'), 'y', 1, true) then
                handover, done = true, true
                break
              end
            end
          end
        end
      end
      from = n
    end
  end
  if fair_rank and t > now and not victim and not handover then
    -- None there: among the reservations of the next K_FAIR tags after this event's,
    -- wherever they wait, the earliest that can give its slot (general's, and why).
    local nt = call('ZRANGEBYSCORE', fairq, '(' .. tag, '+inf', 'LIMIT', '0', format('%d', K_FAIR))
    if #nt > 0 then
      local pms = {}
      for i, tk in ipairs(nt) do
        pms[i] = '1:' .. tk
      end
      local ss = call('ZMSCORE', pkey, unpack(pms)) -- at most K_FAIR
      local recs = call('HMGET', base .. 'leases', unpack(nt)) -- at most K_FAIR
      for i = 1, #nt do -- the earliest (the first on ties); a tiered one is general's
        local s = ss[i] and (ss[i] + 0)
        if s and s < t and recs[i] and s > now then
          local vcost, vscopes, vn, vrest = match(recs[i], '^(%d+):([^:]+):%d+:(%d+):(.*)$')
          if vcost == '1' and sub(vrest, vn + 1) ~= tenant then
            if vscopes == 'y' then
              if not victim or s < vs then
                victim, vs = pms[i], s
              end
            elseif find(vscopes, '=', 1, true) and find(match(vscopes, '^%a+'), 'y', 1, true) then
              handover = true
              break
            end
          end
        end
      end
    end
  end
  if handover then
    break -- a tiered reservation to move: general's
  end
  local leases = base .. 'leases'
  local ts = t == now and nows or format('%d', t)
  local es = victim and format('%d', vs) or ts -- this event's entry
  if t > now then
    -- Its P entry first, only if the token is not pending there (NX): one pending holds a
    -- reservation whose L entry a trim took (above), a late claim, general's, nothing
    -- written (its lease may be gone: general's lapse of its reservation on another log,
    -- after a rule's scopes changed, deletes the token's one lease). Then the lease (what
    -- general's reservation tail writes), only if the token has none: one it has is of a
    -- reservation that waits on other logs (a rule whose scopes changed): general's, its
    -- P entry taken back, so that nothing is left written. Checked so, the common case
    -- reads nothing more than it writes.
    if call('ZADD', pkey, 'NX', es, pm) == 0 then
      break
    end
    local created = server_ms -- as general's
    if created == 0 and VOUCHED then
      created = caller
    elseif created == 0 then
      local tm = call('TIME')
      server_ms = tm[1] * 1000 + math.floor(tm[2] / 1000)
      created = server_ms
    end
    if call('HSETNX', leases, token, '1:' .. (fairq and 'y' or ('t=' .. ARGV[6] .. '/' .. ARGV[7])) .. ':' .. format('%d', created) .. ':' .. hlen .. ':' .. holder .. tenant) == 0 then
      call('ZREM', pkey, pm)
      break
    end
    if victim then
      call('ZADD', pkey, ts, victim)
    end
    flags = 4 + flags % 4
  end
  -- The write: this event at now, or its reservation at t (vs); then what general's finish does.
  local grew = hiw < t -- a new latest instant on the log: its keys' TTLs most likely grow
  -- END SLOT HINT: a reservation at the earliest instant (exact_t), at or after the log's
  -- latest, leaves no instant before it with room: "#e" says so for this quota (sig). A
  -- new latest instant decided otherwise makes any "#e" wrong; else it holds as it was.
  local hint = t > now and exact_t and sig and hiw <= t
  -- Another quota's "#e" goes too: this call trims by its own window, which may drop
  -- entries that quota counts.
  local unhint = hinted and not hint and (hiw < t or not hint_ok)
  if hiw < t then
    hiw = t
  end
  local add = {es, t > now and ('@' .. pm) or member, format('%d', 16 * now + flags - flags % 4 + (hiw > now and 2 or 0) - BASE), '#'}
  if hiw > now then -- (hint implies it: t > now)
    add[#add + 1], add[#add + 2] = format('%d', hiw - BASE), '#f'
    if hint and not hint_ok then -- (with hint_ok it is there already)
      add[#add + 1], add[#add + 2] = format('%d', sig - HINT_BASE), '#e'
    elseif unhint then
      call('ZREM', key, '#e')
    end
  elseif r[2] then
    call('ZREM', key, '#f', '#e') -- "#e" lives only beside "#f"
  end
  if victim then
    add[#add + 1], add[#add + 2] = ts, '@' .. victim
  end
  call('ZADD', key, unpack(add)) -- 4 to 10 values: the entry, "#", perhaps "#f", "#e" and the one displaced
  call('ZREMRANGEBYSCORE', key, FLOOR, lower)
  local ttl = (hiw > now and hiw or now) - now + w + SLACK
  if flags >= 4 then
    ttl = ttl + ct
  end
  local ttls = format('%d', ttl)
  if flags >= 4 then
    call('PEXPIRE', pkey, ttls)
  end
  call('PEXPIRE', key, ttls)
  if t == now then
    return {1, lo + 1, 0, now, 1, server_ms}
  end
  -- On a type log the fair tag (the rest of general's reservation tail).
  local grown = {leases}
  if fairq then
    call('ZADD', fairq, tag, token)
    call('HSET', base .. 'fairstate', 'l:' .. tenant, tag)
    grown[2], grown[3] = fairq, base .. 'fairstate'
  end
  for _, k in ipairs(grown) do -- after a new latest instant, most likely to grow
    grow(k, ttl, grew)
  end
  return {8, lo, (victim and vs or t) - caller, now, 1, MAX_SKEW ~= '0' and server_ms or 0}
until true

-- ---------------------------------------------------------------------------------------
-- The general path: any call (the fast and one-log paths above handle the commonest
-- alike, with fewer steps, and break out to here, having written nothing, for everything
-- else). Its functions are defined only when a call gets here.

-- read_clock returns the caller's instant (ARGV[1], or the server's TIME if it is "" or,
-- with the skew check (CHECK), further than MAX_SKEW ms from it), the server's TIME in ms
-- (0 when not read: ARGV[1] given and no check), and 1 if the server's clock replaced the
-- caller's.
local function read_clock()
  local now_arg = ARGV[1]
  local server_ms = 0
  if now_arg == '' or CHECK then
    local t = call('TIME')
    server_ms = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  if now_arg == '' then
    return server_ms, server_ms, 0
  end
  local caller = (now_arg + 0)
  if CHECK and math.abs(caller - server_ms) > (MAX_SKEW + 0) then
    return server_ms, server_ms, 1
  end
  return caller, server_ms, 0
end

local function fmt(x)
  return format('%d', x)
end

-- cost_of is the cost of the event an L member stands for.
local function cost_of(e)
  local b = byte(e, 1)
  if b == 64 or b == 42 or b == 126 then -- '@', '*', '~'
    return tonumber(match(e, '^.(%d+):'))
  end
  return 1
end

local function cum_of(cm)
  return (sub(cm, 1, 16) + 0)
end

local function cum_member(cum, rest) -- rest: "|<L member>"
  return format('%016d', cum) .. rest
end

-- ---------------------------------------------------------------------------------------
-- Reading a log

local function new_log(l, p, c)
  return {L = l, P = p, C = c, q = {}, wmax = 0}
end

-- load reads a log's sentinels, its pause and, with member, that member's score: one call.
local function load(log, member)
  local r = call('ZMSCORE', log.L, '#', '#f', member or '#', '#p', '#e')
  log.pause = r[4] and (r[4] + BASE) or -1
  if r[1] then
    local x = r[1] + BASE
    log.flags = x % 16
    log.hw = (x - log.flags) / 16
  else
    log.flags, log.hw = 0, -1
  end
  log.nsent = (r[1] and 1 or 0) + (r[2] and 1 or 0) + (r[4] and 1 or 0) + (r[5] and 1 or 0)
  log.has_f = r[2] and true or false
  log.hinted = r[5] and true or false -- "#e": the general path drops it at its first write
  log.hiw = r[2] and (r[2] + BASE) or log.hw
  return member and r[3]
end

local function has_c(log)
  return log.flags % 2 == 1
end

local function has_p(log)
  return log.flags % 8 >= 4
end

-- extras is the sum of cost - 1 over the log's entries scored in (a, b].
local function extras(log, a, b)
  if not has_c(log) then
    return 0
  end
  local hb = call('ZREVRANGEBYSCORE', log.C, fmt(b), FLOOR, 'LIMIT', 0, 1)
  if #hb == 0 then
    return 0
  end
  local ha = call('ZREVRANGEBYSCORE', log.C, fmt(a), FLOOR, 'LIMIT', 0, 1)
  if #ha > 0 then
    return cum_of(hb[1]) - cum_of(ha[1])
  end
  local first = call('ZRANGE', log.C, 0, 0)[1]
  return cum_of(hb[1]) - cum_of(first) + cost_of(sub(first, 18)) - 1
end

-- sum is the total cost of the log's entries scored in (a, b].
local function sum(log, a, b)
  return call('ZCOUNT', log.L, '(' .. fmt(a), fmt(b)) + extras(log, a, b)
end

-- exact reports whether cost c fits at t in quota q, from the entries that can share a
-- window with t (at most K_SCAN of them, else no).
local function exact(log, q, t, c)
  local w = q.w
  local page = call('ZRANGEBYSCORE', log.L, '(' .. fmt(t - w), fmt(t + w - 1), 'WITHSCORES', 'LIMIT', 0, K_SCAN + 1)
  local n = #page / 2
  if n > K_SCAN then
    return false
  end
  local at, cs = {}, {}
  for i = 1, n do
    cs[i] = cost_of(page[2 * i - 1])
    at[i] = (page[2 * i] + 0)
  end
  -- The fullest window (x - w, x] with t <= x < t + w ends at t or at an entry after t.
  local lo, hi, s = 1, 0, 0
  local function upto(x)
    while hi < n and at[hi + 1] <= x do
      hi = hi + 1
      s = s + cs[hi]
    end
    while lo <= hi and at[lo] <= x - w do
      s = s - cs[lo]
      lo = lo + 1
    end
    return s
  end
  if upto(t) + c > q.limit then
    return false
  end
  for i = 1, n do
    if at[i] > t and (i == n or at[i + 1] > at[i]) and upto(at[i]) + c > q.limit then
      return false
    end
  end
  return true
end

-- q_fits reports whether cost c fits at t in quota q of log: the two bounds, then the
-- exact check. It leaves in q.lo the slots taken in the window ending at t, for the reply.
local function q_fits(log, q, t, c)
  local lo = sum(log, t - q.w, t)
  q.lo, q.lo_at = lo, t
  if lo + c > q.limit then
    return false
  end
  return not (log.hiw > t and sum(log, t - q.w, t + q.w - 1) + c > q.limit and not exact(log, q, t, c))
end
-- fits reports whether cost c fits at t (>= the call's now) in every quota of the log.
local function fits(log, t, c)
  for _, q in ipairs(log.q) do
    if not q_fits(log, q, t, c) then
      return false
    end
  end
  return true
end

-- newest is the instant of the log's newest entry, or nil.
local function newest(log)
  local r = call('ZRANGE', log.L, -1, -1, 'WITHSCORES')
  if #r == 0 or byte(r[1], 1) == 35 then -- '#', '#f', '#p': an empty log
    return nil
  end
  return tonumber(r[2])
end

-- end_slot is the first instant >= t0, and >= the log's newest entry, at which cost c fits
-- every quota of the log: the first t with sum(t - W, +inf) <= limit - c for each quota,
-- since no entry lies after t. All entries of cost 1: one rank. Else a bisection over
-- ranks, O(log^2 N).
local function end_slot(log, t0, c)
  local last = newest(log)
  if not last then
    return t0, nil, 0
  end
  local t = math.max(t0, last)
  local s0 = log.nsent
  local n = call('ZCARD', log.L) - s0
  for _, q in ipairs(log.q) do
    local room = q.limit - c -- the most that may lie after t - W
    local y = nil -- the first entry instant with at most room after it
    if not has_c(log) then
      if n > room then
        y = tonumber(call('ZRANGE', log.L, s0 + n - room - 1, s0 + n - room - 1, 'WITHSCORES')[2]) -- nil (no such entry) stays nil, as "if y" expects
      end
    elseif sum(log, -1, last) > room then
      local lo, hi = s0, s0 + n - 1 -- at most log2(N) rounds
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        local s = (call('ZRANGE', log.L, mid, mid, 'WITHSCORES')[2] + 0)
        if sum(log, s, last) <= room then
          hi = mid
        else
          lo = mid + 1
        end
      end
      y = tonumber(call('ZRANGE', log.L, lo, lo, 'WITHSCORES')[2]) -- nil (no such entry) stays nil, as "if y" expects
    end
    if y then
      t = math.max(t, y + q.w)
    end
  end
  return t, last, n
end

-- gap_slot looks for a slot earlier than the end slot `last` on a log of cost-1 entries
-- whose entries after t0 are sparse in every quota ((their count + limit) * W <= limit *
-- (newest - t0): a window's worth of slots unused among them), as behind a tenant that
-- reserved a minute ahead on a type log of 1 s windows, where the K_CAND candidates all
-- fall in the dense stretch before the gap. The end slot of a prefix of the log (its
-- entries up to rank j: the later of t0, the j-th entry, and the (j - room)-th entry + W)
-- grows with j, and is the end slot `last` for the whole log; a bisection over the ranks
-- after t0 keeps the half whose upper end's prefix end slot fits in the whole log, at
-- most K_GAP rounds: O(K_GAP log N). Returns a slot < last, or nil. newest, n: the log's
-- newest instant and entry count (end_slot's).
local function gap_slot(log, t0, c, last, newest_at, n)
  if has_c(log) or not newest_at then
    return nil
  end
  local s0 = log.nsent
  local a = s0 + call('ZCOUNT', log.L, FLOOR, fmt(t0)) -- the first rank after t0
  local b = s0 + n - 1
  for _, q in ipairs(log.q) do
    if (b - a + 1 + q.limit) * q.w > q.limit * (newest_at - t0) then
      return nil
    end
  end
  local lo, hi, best = a - 1, b, last
  for _ = 1, K_GAP do
    if hi - lo <= 1 then
      break
    end
    local mid = math.floor((lo + hi) / 2)
    local s = math.max(t0, (call('ZRANGE', log.L, mid, mid, 'WITHSCORES')[2] + 0))
    for _, q in ipairs(log.q) do
      local room = q.limit - c
      if mid - s0 + 1 > room then
        s = math.max(s, call('ZRANGE', log.L, mid - room, mid - room, 'WITHSCORES')[2] + q.w)
      end
    end
    if s < best and fits(log, s, c) then
      hi, best = mid, s
    else
      lo = mid
    end
  end
  if best < last then
    return best
  end
  return nil
end

-- earliest_on is the earliest instant >= t0 at which cost c fits on the log (bounded: t0,
-- then the first K_CAND instants before the end slot where an entry leaves a window, then
-- gap_slot's, then the end slot). With no entry after t0 and all of cost 1 it is exact in
-- one call per quota: the k-th entry of the window leaving it, k = slots taken + c - limit.
local function earliest_on(log, t0, c)
  if fits(log, t0, c) then
    return t0
  end
  if log.hiw <= t0 and not has_c(log) then
    local t = t0
    for _, q in ipairs(log.q) do
      local k = sum(log, t0 - q.w, t0) + c - q.limit
      if k == 1 then
        local e = call('ZRANGEBYSCORE', log.L, '(' .. fmt(t0 - q.w), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        t = math.max(t, e[2] + q.w)
      elseif k > 1 then -- by rank: an offset would walk k entries
        local r = log.nsent + call('ZCOUNT', log.L, FLOOR, fmt(t0 - q.w)) + k - 1
        t = math.max(t, call('ZRANGE', log.L, r, r, 'WITHSCORES')[2] + q.w)
      end
    end
    return t
  end
  -- The end slot bounds the search: candidates after it cannot be earlier than it.
  local last, newest_at, n = end_slot(log, t0, c)
  local cands = {}
  for _, q in ipairs(log.q) do
    local page = call('ZRANGEBYSCORE', log.L, '(' .. fmt(t0 - q.w), fmt(last - q.w - 1), 'WITHSCORES', 'LIMIT', 0, K_CAND)
    for i = 2, #page, 2 do
      cands[#cands + 1] = page[i] + q.w
    end
  end
  table.sort(cands)
  local tried, prev = 0, nil
  for _, t in ipairs(cands) do -- at most K_CAND checks
    if t ~= prev then
      if tried == K_CAND then
        break
      end
      tried, prev = tried + 1, t
      if fits(log, t, c) then
        return t
      end
    end
  end
  return gap_slot(log, t0, c, last, newest_at, n) or last
end

-- earliest is the earliest instant >= t0 at which cost c fits every log of logs: at most
-- K_ITER rounds over them, else the latest of their end slots.
local function earliest(logs, t0, c)
  local t, settled, steps = t0, 0, 0
  local i = 0
  while steps < K_ITER * #logs do
    i = i % #logs + 1
    steps = steps + 1
    local tj = earliest_on(logs[i], t, c)
    if tj > t then
      t, settled = tj, 1
    else
      settled = settled + 1
    end
    if settled >= #logs then
      return t
    end
  end
  t = t0
  for _, log in ipairs(logs) do
    t = math.max(t, end_slot(log, t0, c))
  end
  return t
end

-- ---------------------------------------------------------------------------------------
-- Writing a log

-- c_room reports whether a weighted entry can be inserted at s: at most K_RENUM weighted
-- entries lie after it.
local function c_room(log, s)
  if not has_c(log) then
    return true
  end
  return call('ZCOUNT', log.C, '(' .. fmt(s), '+inf') <= K_RENUM
end

-- c_shift rewrites the <cum> of C's entries in cms (with scores in ss) by delta and adds
-- extra (a flat list of score, member) in the same ZADD. #cms <= K_RENUM (c_insert,
-- c_remove), so ZREM takes at most K_RENUM members and ZADD 2 * K_RENUM + 2 values.
local function c_shift(log, cms, ss, delta, extra)
  if #cms > 0 then
    call('ZREM', log.C, unpack(cms)) -- at most K_RENUM members (above)
  end
  local add = extra
  for i, cm in ipairs(cms) do
    add[#add + 1] = ss[i]
    add[#add + 1] = cum_member(cum_of(cm) + delta, sub(cm, 17))
  end
  if #add > 0 then
    call('ZADD', log.C, unpack(add)) -- at most 2 * K_RENUM + 2 values (above)
  end
end

-- c_insert adds the weighted L member e of cost c at s to C (c_room must have said yes).
local function c_insert(log, e, s, c)
  local cms, ss, base = {}, {}, 0
  if has_c(log) then
    -- c_room said at most K_RENUM lie after s (read in this same atomic call), so the
    -- LIMIT reads them all and bounds the ZREM and ZADD of c_shift.
    local after = call('ZRANGEBYSCORE', log.C, '(' .. fmt(s), '+inf', 'WITHSCORES', 'LIMIT', 0, K_RENUM)
    for i = 1, #after, 2 do
      cms[#cms + 1], ss[#ss + 1] = after[i], after[i + 1]
    end
    local before = call('ZREVRANGEBYSCORE', log.C, fmt(s), FLOOR, 'LIMIT', 0, 1)
    if #before > 0 then
      base = cum_of(before[1])
    elseif #cms > 0 then
      base = cum_of(cms[1]) - cost_of(sub(cms[1], 18)) + 1
    end
  end
  c_shift(log, cms, ss, c - 1, {fmt(s), cum_member(base + c - 1, '|' .. e)})
  if not has_c(log) then
    log.flags = log.flags + 1
  end
end

-- c_remove takes the weighted L member e of cost c at s out of C; false (nothing written)
-- if more than K_RENUM entries would need a new <cum>. It reads the last K_RENUM + 1
-- entries scored at or after s, newest first (members at one instant sort by their
-- <cum>): e's entry is among them iff at most K_RENUM follow it, and those are the ones
-- to rewrite; if the read stopped short of the LIMIT, e's entry is not in C.
local function c_remove(log, e, s, c)
  local tail = call('ZREVRANGEBYSCORE', log.C, '+inf', fmt(s), 'WITHSCORES', 'LIMIT', 0, K_RENUM + 1)
  local found, cms, ss = nil, {}, {}
  for i = 1, #tail, 2 do
    if sub(tail[i], 18) == e then
      found = tail[i]
      break
    end
    cms[#cms + 1], ss[#ss + 1] = tail[i], tail[i + 1]
  end
  if not found then
    return #tail < 2 * (K_RENUM + 1)
  end
  call('ZREM', log.C, found)
  c_shift(log, cms, ss, 1 - c, {})
  return true
end

-- put writes the L member e of cost c at s (c_room must have said yes for c > 1).
local function put(log, e, s, c)
  if c > 1 then
    c_insert(log, e, s, c)
  end
  log.add[#log.add + 1] = fmt(s)
  log.add[#log.add + 1] = e
  log.hiw = math.max(log.hiw, s)
  log.dirty = true
end

-- flush sends the ZADDs put queued (they must precede reads of L).
local function flush(log)
  if #log.add > 0 then
    -- At most 3 entries: put runs at most three times on a log between flushes (this
    -- event, or its claim, and a displaced reservation's move).
    call('ZADD', log.L, unpack(log.add)) -- at most 6 values: 3 entries (above)
    log.add = {}
  end
end

-- drop removes the L member e of cost c at s; a weighted one whose removal would rewrite
-- too many <cum>s is renamed to a "~" entry, which counts until it leaves its window. An
-- entry L no longer holds leaves no "~" entry: a trim under a shorter window (a rule
-- changed since it was reserved) took it, and its C entry with it (finish trims both at
-- one floor), so it counts nowhere already.
local function drop(log, e, s, c)
  flush(log)
  local held = call('ZREM', log.L, e) == 1
  if c > 1 and not c_remove(log, e, s, c) and held then
    call('ZADD', log.L, fmt(s), '~' .. c .. ':' .. sub(e, find(e, ':', 1, true) + 1) .. '@' .. fmt(s))
  end
  log.dirty = true
end

-- pexpire sets key's TTL to ms (finish's, for a log of this call; grow's for another's).
local function pexpire(key, ms)
  call('PEXPIRE', key, ms)
end

-- finish completes the writes to a log decided at now: the queued entries, the trim of
-- what is at or before now - its longest window (also in C: removing C's front keeps every
-- later <cum> difference right), its sentinels, and TTLs that outlast every entry by the
-- longest window (and the claim timeout, with reservations). Another tenant's log (other:
-- a displaced reservation's) is not trimmed and its TTLs only grow: its own quotas, which
-- this call does not carry, may have longer windows (a tier's), whose entries a trim or
-- a shorter TTL at this call's windows would drop.
local function finish(log, now, claim_timeout)
  if not log.dirty then
    return
  end
  local floor = fmt(now - log.wmax)
  if has_c(log) and not log.other then
    call('ZREMRANGEBYSCORE', log.C, FLOOR, floor)
    if call('ZCARD', log.C) == 0 then
      log.flags = log.flags - 1
    end
  end
  if log.p_removed and has_p(log) and call('ZCARD', log.P) == 0 then
    log.flags = log.flags - 4
  end
  log.hw = math.max(log.hw, now)
  local add = log.add
  if log.pause >= 0 and log.pause <= now then -- a past pause: gone with this write
    call('ZREM', log.L, '#p')
    log.pause = -1
    if log.flags >= 8 then
      log.flags = log.flags - 8
    end
  end
  local flags = log.flags - log.flags % 4 + log.flags % 2 -- bits 1, 4 and 8; "#f" below
  if log.hiw > log.hw then
    flags = flags + 2
  end
  add[#add + 1] = fmt(16 * log.hw + flags - BASE)
  add[#add + 1] = '#'
  if log.hiw > log.hw then
    add[#add + 1] = fmt(log.hiw - BASE)
    add[#add + 1] = '#f'
    if log.hinted then -- it may have moved entries or "#f" otherwise (END SLOT HINT)
      call('ZREM', log.L, '#e')
    end
  elseif log.has_f then
    call('ZREM', log.L, '#f', '#e')
  end
  log.has_f, log.hinted = log.hiw > log.hw, false
  call('ZADD', log.L, unpack(add)) -- at most 10 values: the queued entries (at most 3) and 2 sentinels
  log.add = {}
  if not log.other then
    call('ZREMRANGEBYSCORE', log.L, FLOOR, floor)
  end
  local ttl = math.max(log.hiw, now) - now + log.wmax + SLACK
  local expire = log.other and grow or pexpire
  if has_p(log) then
    ttl = ttl + claim_timeout
    expire(log.P, ttl, true)
  end
  if has_c(log) then
    expire(log.C, ttl, true)
  end
  expire(log.L, ttl, true)
  log.dirty = false
end

-- ---------------------------------------------------------------------------------------
-- Reservations

-- lease_parse returns the cost, scopes ("t" tenant, "y" type, in log order, then the tenant
-- log's quotas: see LEASES), tenant,
-- holder and priority of a lease record.
local function lease_parse(rec)
  local p, tail = match(rec, '^p(%d+):(.*)$')
  local cost, scopes, n, rest = match(tail or rec, '^(%d+):([^:]+):%d+:(%d+):(.*)$')
  n = (n + 0)
  return (cost + 0), scopes, sub(rest, n + 1), sub(rest, 1, n), ((p or '0') + 0)
end

local function token_of(pm)
  return sub(pm, find(pm, ':', 1, true) + 1)
end

-- unreserve takes the pending reservation pm, at s, off the log.
local function unreserve(log, pm, s)
  call('ZREM', log.P, pm)
  log.p_removed = true
  drop(log, '@' .. pm, s, cost_of('@' .. pm))
end

-- reserve puts the pending reservation pm at s on the log (c_room must have said yes).
local function reserve(log, pm, s)
  put(log, '@' .. pm, s, cost_of('@' .. pm))
  call('ZADD', log.P, fmt(s), pm)
  if not has_p(log) then
    log.flags = log.flags + 4
  end
end

-- lapse removes up to K_LAPSE reservations of the log that were pending at now -
-- claim_timeout or before.
local function lapse(log, now, claim_timeout, leases, fairq)
  if not has_p(log) then
    return
  end
  local gone = call('ZRANGEBYSCORE', log.P, FLOOR, fmt(now - claim_timeout), 'WITHSCORES', 'LIMIT', 0, K_LAPSE)
  for i = 1, #gone, 2 do
    unreserve(log, gone[i], (gone[i + 1] + 0))
    local token = token_of(gone[i])
    call('HDEL', leases, token)
    if fairq then
      call('ZREM', fairq, token)
    end
  end
end

-- ---------------------------------------------------------------------------------------
-- Pause (op "p") and resume (op "u") of one log.

if ARGV[1] == 'p' then
  -- "#p" at its end, never earlier than a pause in force (GT); the log lives at least
  -- until then (its TTL only grows: its entries' TTL is set by decisions).
  local till, now = (ARGV[2] + 0), (ARGV[3] + 0)
  if till <= now then
    return 0 -- already over
  end
  call('ZADD', KEYS[1], 'GT', format('%d', till - BASE), '#p')
  -- Flag 8 of "#" sends every decision on the log to general (a log never written gets
  -- "#" at hw 0).
  local hs = call('ZSCORE', KEYS[1], '#')
  local x = hs and (hs + BASE) or 0
  if x % 16 < 8 then
    call('ZADD', KEYS[1], format('%d', x + 8 - BASE), '#')
  end
  local ttl = format('%d', till - now)
  if call('PEXPIRE', KEYS[1], ttl, 'GT') == 0 then
    call('PEXPIRE', KEYS[1], ttl, 'NX')
  end
  return 1
end
if ARGV[1] == 'u' then
  if call('ZREM', KEYS[1], '#p') == 0 then
    return 0
  end
  local hs = call('ZSCORE', KEYS[1], '#')
  if hs and (hs + BASE) % 16 >= 8 then
    call('ZADD', KEYS[1], format('%d', hs - 8), '#')
  end
  return 1
end

-- ---------------------------------------------------------------------------------------
-- Release (op "r"): give up a token's reservation on every log it holds.

if ARGV[1] == 'r' then
  local leases, token = KEYS[1], ARGV[2]
  local base = sub(leases, 1, #leases - 6) -- "<prefix>:{<type>}:"
  local rec = call('HGET', leases, token)
  if not rec then
    return 0
  end
  local cost, scopes, tenant = lease_parse(rec)
  scopes = match(scopes, '^%a+') -- its logs' letters
  local pm = cost .. ':' .. token
  local held = 0
  for i = 1, #scopes do -- at most 2 logs
    local part = sub(scopes, i, i) == 'y' and 'type' or ('tenant:' .. tenant)
    local log = new_log(base .. part, base .. 'pending:' .. part, base .. 'costs:' .. part)
    log.add = {}
    load(log)
    local s = has_p(log) and call('ZSCORE', log.P, pm)
    if s then
      held = 1
      unreserve(log, pm, (s + 0))
      if log.hinted then -- an instant before the end slot may have room now (END SLOT HINT)
        call('ZREM', log.L, '#e')
      end
      if has_c(log) then
        -- c_shift's ZREM may have emptied C, and its ZADD made it again with no TTL; no
        -- finish runs here to set one. C lives as long as its log (finish gives both one
        -- TTL), so it takes L's.
        local ttl = call('PTTL', log.L)
        if ttl > 0 then
          call('PEXPIRE', log.C, ttl)
        end
      end
    end
  end
  call('HDEL', leases, token)
  call('ZREM', base .. 'fair', token)
  return held
end

-- ---------------------------------------------------------------------------------------
-- Decide (op "d")

local caller, server_ms, skewed = read_clock()
local fresh = byte(ARGV[2], 1) == 33
local member = fresh and sub(ARGV[2], 2) or ARGV[2]
local cost, wait, claim_timeout, claim_wait, weight = 1, 0, DEFAULT_CLAIM_TIMEOUT, 0, 1
local token, holder, tenant = '', '', ''
local prio, prio_rec = 0, '' -- the priority, and its "p<priority>:" before the lease record
local spread = false -- SPACING
if ARGV[5] ~= '' then
  -- ["p<priority>:"]"<cost>:<wait>:<claim timeout>:<claim wait>:<weight>:<n>:<token><n>:<holder><tenant>"
  local p, extra = match(ARGV[5], '^p(%d+):(.*)$')
  if p then
    prio, prio_rec = (p + 0), 'p' .. p .. ':'
  end
  extra = extra or ARGV[5]
  if byte(extra, 1) == 115 then -- "s:"
    spread, extra = true, sub(extra, 3)
  end
  local c, w, ct, cw, wt, n, rest = match(extra, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(.*)$')
  cost, wait, claim_timeout, claim_wait, weight = (c + 0), (w + 0), (ct + 0), (cw + 0), (wt + 0)
  token = sub(rest, 1, (n + 0))
  local hn, tail = match(sub(rest, n + 1), '^(%d+):(.*)$')
  holder, tenant = sub(tail, 1, (hn + 0)), sub(tail, hn + 1)
end
local m = #KEYS
local base = match(KEYS[1], '^.-}:')
local LEASES, FAIRQ, FAIRH = base .. 'leases', base .. 'fair', base .. 'fairstate'
local type_log = 0
local logs = {}
for j = 1, m do
  local part = sub(KEYS[j], #base + 1)
  logs[j] = new_log(KEYS[j], base .. 'pending:' .. part, base .. 'costs:' .. part)
  logs[j].add = {}
  if part == 'type' then
    type_log = j
  end
end
local quotas = {}
local nq = math.floor((#ARGV - 5) / 3)
for i = 1, nq do
  local log = logs[nq == 1 and 1 or byte(ARGV[#ARGV], i) - 48]
  local q = {limit = (ARGV[3 + 3 * i] + 0), w = (ARGV[4 + 3 * i] + 0), log = log}
  log.q[#log.q + 1] = q
  log.wmax = math.max(log.wmax, q.w)
  quotas[#quotas + 1] = q
end
local tlog = type_log > 0 and logs[type_log] or nil

-- An admission is in every log of its call and stays longest in the one with the longest
-- window: the replay check looks there.
local replay_log = logs[1]
for j = 2, m do
  if logs[j].wmax > replay_log.wmax then
    replay_log = logs[j]
  end
end
local am = cost > 1 and ('*' .. cost .. ':' .. member) or member -- the admission's L member
local replayed_at = nil
local now = caller
for j = 1, m do
  local s = load(logs[j], logs[j] == replay_log and not fresh and am or nil)
  if s then
    replayed_at = (s + 0)
  end
  now = math.max(now, logs[j].hw)
end

-- count_at is the slots q's window ending at `at` holds after this call's writes: fits
-- measured it before an admission of pre slots, or it is counted now.
local function count_at(q, at, pre)
  if pre and q.lo_at == at then
    return q.lo + pre
  end
  return sum(q.log, at - q.w, at)
end

local function reply(allowed, replay, binding, count, at, retry, reserved, held, pause)
  return {allowed + 2 * replay + 4 * skewed + 8 * reserved + 16 * held + 32 * (pause or 0), count, retry, at, binding, server_ms}
end

-- admitted replies to an admission at `at`: the quota with the fewest slots left in its
-- window ending there binds (the first on ties). pre: see count_at.
local function admitted(at, replay, pre, was_held)
  local binding, count, left = 1, 0, nil
  for i, q in ipairs(quotas) do
    local c = count_at(q, at, pre)
    if left == nil or q.limit - c < left then
      binding, count, left = i, c, q.limit - c
    end
  end
  return reply(1, replay, binding, count, at, 0, 0, was_held)
end

if replayed_at then
  return admitted(replayed_at, 1, nil, 0)
end

-- PAUSE: a log paused until u > now denies every event until u (the latest of the call's
-- pauses), writing nothing; the binding quota is the first on a log paused that long.
local paused, pause_q = now, nil
for i, q in ipairs(quotas) do
  if q.log.pause > paused then
    paused, pause_q = q.log.pause, i
  end
end
if pause_q then
  local q = quotas[pause_q]
  return reply(0, 0, pause_q, sum(q.log, now - q.w, now), now, paused - caller, 0, 0, 1)
end

for j = 1, m do
  lapse(logs[j], now, claim_timeout, LEASES, j == type_log and FAIRQ or nil)
end

local function finish_all()
  for j = 1, m do
    finish(logs[j], now, claim_timeout)
  end
end

-- This event's reservation: pending at one instant in every log, or not at all (after a
-- change of rule, the rest of it is given up).
local pm = cost .. ':' .. token
local held_at = nil
if token ~= '' then
  local seen, whole = {}, true
  for j = 1, m do
    local s = has_p(logs[j]) and call('ZSCORE', logs[j].P, pm)
    seen[j] = s and (s + 0)
    if not seen[j] or (seen[1] and seen[j] ~= seen[1]) then
      whole = false
    end
  end
  if whole then
    held_at = seen[1]
  else
    local any = false
    for j = 1, m do
      if seen[j] then
        unreserve(logs[j], pm, seen[j])
        any = true
      end
    end
    if any and tlog then
      call('ZREM', FAIRQ, token)
    end
  end
end
local held = held_at and 1 or 0

-- fair_claimed moves the type quota's virtual time to the tag of a claimed reservation.
local function fair_claimed()
  if tlog then
    local tag = call('ZSCORE', FAIRQ, token)
    if tag then
      call('ZREM', FAIRQ, token)
      if (tag + 0) > ((call('HGET', FAIRH, 'v') or '0') + 0) then
        call('HSET', FAIRH, 'v', tag)
      end
    end
  end
  call('HDEL', LEASES, token)
end

if held_at and held_at > now + claim_wait then
  -- Not due yet: come back at the reservation's instant.
  finish_all()
  return reply(0, 0, 1, count_at(quotas[1], now, nil), now, held_at - caller, 1, 1)
end
-- claim_fits reports whether a reservation at s, claimed on time, still fits the call's
-- quotas: every window ending at s holds at most its limit, the reservation included. It
-- always does under the quotas it was made for; after a rule lowered a limit (a tier or
-- override), the reservations made before must not all run: a claim that no longer fits
-- is decided afresh, as a late one is. The window ending at the claim is enough: a window
-- holds no more admissions than the one ending at its latest admission, and every
-- admission was checked there when it was decided.
local function claim_fits(s)
  for _, q in ipairs(quotas) do
    if sum(q.log, s - q.w, s) > q.limit then
      return false
    end
  end
  return true
end

if held_at and held_at >= now and claim_fits(held_at) then
  -- Claimed ahead or on time: the reservation becomes the admission, in place.
  for j = 1, m do
    local log = logs[j]
    call('ZREM', log.P, pm)
    log.p_removed = true
    call('ZREM', log.L, '@' .. pm)
    put(log, am, held_at, 1) -- cost 1: a weighted entry keeps its C entry, renamed below
    if cost > 1 then
      for _, cm in ipairs(call('ZRANGEBYSCORE', log.C, fmt(held_at), fmt(held_at))) do
        if sub(cm, 18) == '@' .. pm then
          call('ZREM', log.C, cm)
          call('ZADD', log.C, fmt(held_at), sub(cm, 1, 17) .. am)
        end
      end
    end
  end
  fair_claimed()
  finish_all()
  return admitted(held_at, 0, nil, 1)
end
if held_at then
  -- Late, within the claim timeout, or on time but no longer fitting (claim_fits): decide
  -- afresh, without its own reservation.
  for j = 1, m do
    unreserve(logs[j], pm, held_at)
  end
  for j = 1, m do
    flush(logs[j])
  end
end

-- placeable is the earliest instant >= t0 at which the event fits and can be written: for
-- cost > 1, with at most K_RENUM weighted entries after it in every log, else the earliest
-- after the newest of them.
local function placeable(t0)
  local t = earliest(logs, t0, cost)
  if cost == 1 then
    return t
  end
  local after = nil
  for j = 1, m do
    if not c_room(logs[j], t) then
      local r = call('ZRANGE', logs[j].C, -1, -1, 'WITHSCORES')
      after = math.max(after or t, (r[2] + 0))
    end
  end
  if after then
    t = earliest(logs, after, cost)
  end
  return t
end

local t = placeable(now)
local horizon = held_at and claim_wait or wait
if t <= now + horizon then
  for j = 1, m do
    put(logs[j], am, t, cost)
  end
  if held_at then
    fair_claimed()
  end
  finish_all()
  return admitted(t, 0, t == now and cost or nil, held)
end

local scopes, letters, tq = '', '', {}
for j = 1, m do
  letters = letters .. (j == type_log and 'y' or 't')
end
for _, q in ipairs(quotas) do
  if q.log ~= tlog then
    tq[#tq + 1] = fmt(q.limit) .. '/' .. fmt(q.w)
  end
end
scopes = #tq > 0 and (letters .. '=' .. table.concat(tq, ',')) or letters -- a lease's scopes (LEASES)

-- tenant_quotas returns the tenant log's quotas a lease's scopes vs record (LEASES), and
-- the longest window: a displaced reservation of another tenant moves on its tenant log
-- under the quotas it reserved under (its tier's), not this call's.
local function tenant_quotas(vs)
  local qs, wmax = {}, 0
  for l, w in string.gmatch(match(vs, '=(.*)$') or '', '(%d+)/(%d+)') do -- its quotas: at most as many as ARGV holds
    qs[#qs + 1] = {limit = (l + 0), w = (w + 0)}
    wmax = math.max(wmax, (w + 0))
  end
  return qs, wmax
end

-- room_for reports whether this event's logs that a reservation of tenant vt does not
-- share (its tenant log, for another tenant's) have room for cost 1 at s; roomy caches it
-- per instant: one fits per instant, at most K_FAIR or K_PRIO instants per call.
local function room_for(s, vt, roomy)
  if vt == tenant then
    return true
  end
  if roomy[s] == nil then
    roomy[s] = true
    for j = 1, m do
      if roomy[s] and j ~= type_log then
        flush(logs[j])
        roomy[s] = fits(logs[j], s, 1)
      end
    end
  end
  return roomy[s]
end

-- movable reports whether a pending reservation of scopes vs (cost 1) of tenant vt can
-- give its slot to this event: it has this event's scopes; or it is another tenant's on
-- the type log, this event being on it too, and on its own tenant log or not: it moves on
-- the type log and on its tenant log under the tenant quotas its lease records (maybe
-- another tier's), and room_for checks this event's tenant logs, as for any other
-- tenant's. So tenants of every tier share the type's slots by their weights, whether a
-- tier adds tenant= quotas or not. A lease written before its scopes recorded quotas
-- ("yt" alone) is another tenant's only to an event of those scopes.
local function movable(vs, vt)
  if vs == scopes then
    return true
  end
  if vt == tenant or tlog == nil then
    return false
  end
  return vs == 'y' or find(vs, '=', 1, true) ~= nil and find(match(vs, '^%a+'), 'y', 1, true) ~= nil
end

-- displace gives the slot at sv of the pending reservation v (cost 1, of scopes vscopes,
-- movable) of tenant vt to this event: its admission am if admit, else its reservation; v
-- moves to its own earliest instant after now, keeping its lease and tag. Its logs are the
-- type log and, if its scopes have one, its tenant's, under the tenant quotas its lease
-- records; this event's own logs, for its tenant.
local function displace(v, sv, vt, admit, vscopes)
  local vlogs = {}
  if vt == tenant then
    vlogs = logs
  else
    local vletters = match(vscopes, '^%a+')
    for i = 1, #vletters do -- at most 2 logs
      if sub(vletters, i, i) == 'y' then
        vlogs[i] = tlog
      else
        local part = 'tenant:' .. vt
        local vl = new_log(base .. part, base .. 'pending:' .. part, base .. 'costs:' .. part)
        vl.q, vl.wmax = tenant_quotas(vscopes)
        vl.add, vl.other = {}, true
        load(vl)
        vlogs[i] = vl
      end
    end
  end
  for _, vl in ipairs(vlogs) do
    unreserve(vl, v, sv)
  end
  for j = 1, m do
    if admit then
      put(logs[j], am, sv, 1)
    else
      reserve(logs[j], pm, sv)
    end
    flush(logs[j])
  end
  for _, vl in ipairs(vlogs) do
    flush(vl)
  end
  local tv = earliest(vlogs, now, 1)
  for _, vl in ipairs(vlogs) do
    reserve(vl, v, tv)
    if vl.other then
      finish(vl, now, claim_timeout)
    end
  end
end

-- PRIORITY: the first of the K_PRIO reservations pending in (now, t) on the type log
-- (else the tenant log) that is of cost 1, is movable, has a lower priority,
-- where this event's other logs have room: one ZRANGEBYSCORE, one HMGET of at most K_PRIO
-- leases, at most K_PRIO fits.
local v, sv, vt, vsc = nil, nil, nil, nil
if prio > 0 and cost == 1 and token ~= '' then
  local plog = tlog or logs[1]
  local page = has_p(plog) and call('ZRANGEBYSCORE', plog.P, '(' .. fmt(now), '(' .. fmt(t), 'WITHSCORES', 'LIMIT', 0, K_PRIO) or {}
  local tokens = {}
  for i = 1, #page, 2 do
    tokens[#tokens + 1] = token_of(page[i])
  end
  local recs = #tokens > 0 and call('HMGET', LEASES, unpack(tokens)) or {} -- at most K_PRIO
  local roomy = {}
  for i = 1, #tokens do
    local rec = recs[i]
    if rec and sub(page[2 * i - 1], 1, 2) == '1:' then
      local vcost, vscopes, vten, _, vprio = lease_parse(rec)
      local s = (page[2 * i] + 0)
      if vcost == 1 and movable(vscopes, vten) and vprio < prio and room_for(s, vten, roomy) then
        v, sv, vt, vsc = page[2 * i - 1], s, vten, vscopes
        break
      end
    end
  end
  if v and sv <= now + horizon then
    displace(v, sv, vt, true, vsc)
    if held_at then
      fair_claimed()
    end
    finish_all()
    return admitted(sv, 0, nil, held)
  end
end

-- The binding quota of a denial (or reservation) at t: the first with no room at t - 1,
-- the quota that holds the event back until t (with one quota full for a second and
-- another for a minute, the minute's: its retry-after is the minute's); else, as when a
-- weighted event is placed later than it fits, the first with no room at now.
local binding = nil
if t > now and #quotas > 1 then -- one quota binds alone
  for i, q in ipairs(quotas) do
    if not q_fits(q.log, q, t - 1, cost) then
      binding = i
      break
    end
  end
end
if not binding then
  for i, q in ipairs(quotas) do
    if q.lo_at ~= now then
      q.lo, q.lo_at = sum(q.log, now - q.w, now), now
    end
    if q.lo + cost > q.limit then
      binding = i
      break
    end
  end
end
if not binding then
  for i, q in ipairs(quotas) do -- room in the window ending at now, but not in one after
    if not fits(q.log, now, cost) then
      binding = i
      break
    end
  end
end
binding = binding or 1

if token == '' then
  finish_all()
  return reply(0, 0, binding, count_at(quotas[binding], now, 0), now, t - caller, 0, held)
end

-- SPACING: a new reservation held back by a tenant quota goes no earlier than
-- floor(cost * W / limit) of it after the latest instant of its log (hiw: "#f", else hw),
-- at the earliest instant from there on at which it fits every log (placeable), unless it
-- takes a lower priority's slot (v); a fair rank below may still give it an earlier slot
-- on a type log. Later than the earliest never breaks a window, and it is not the
-- earliest: no "#e" is left (any write of general's drops it).
if spread and not v and quotas[binding].log ~= tlog then
  local q = quotas[binding]
  local from = q.log.hiw + math.floor(cost * q.w / q.limit)
  if t < from then
    t = placeable(from)
  end
end

-- Reserve: at a lower priority's slot (found above), else at the fair rank on a type quota.
local tag = nil
if tlog then
  local fh = call('HMGET', FAIRH, 'v', 'l:' .. tenant)
  tag = math.max(((fh[1] or '0') + 0), ((fh[2] or '0') + 0)) + math.floor(cost * FAIR_UNIT / weight + 0.5)
end

local placed = false
if v then
  displace(v, sv, vt, false, vsc)
  t, placed = sv, true
end
if not placed and tlog and cost == 1 then
  -- The instant of the slot at the fair rank; there, or after, the first of K_FAIR
  -- pending reservations (from the first at that instant: slots at one instant are alike)
  -- that is another tenant's of cost 1, no higher priority and a later tag (one ranked
  -- before this event keeps its slot), after now and before t, where our other quotas
  -- have room.
  local rank = call('ZCOUNT', FAIRQ, '-inf', fmt(tag))
  local at_rank = call('ZRANGE', tlog.P, rank, rank, 'WITHSCORES')[2]
  local page = at_rank and call('ZRANGEBYSCORE', tlog.P, at_rank, '+inf', 'WITHSCORES', 'LIMIT', 0, K_FAIR) or {}
  local tokens = {}
  for i = 1, #page, 2 do
    tokens[#tokens + 1] = token_of(page[i])
  end
  local recs = #tokens > 0 and call('HMGET', LEASES, unpack(tokens)) or {} -- at most K_FAIR
  local tags = nil -- their fair tags, read once at the first candidate that needs them
  local fv, fsv, fvt, fsc = nil, nil, nil, nil
  local roomy = {} -- per instant, whether our other logs have room there
  for i = 1, #tokens do
    local s = (page[2 * i] + 0)
    if s >= t then
      break
    end
    local rec = recs[i]
    if rec and s > now and sub(page[2 * i - 1], 1, 2) == '1:' then
      local vcost, vscopes, vten, _, vprio = lease_parse(rec)
      if vcost == 1 and movable(vscopes, vten) and vten ~= tenant and vprio <= prio then
        tags = tags or call('ZMSCORE', FAIRQ, unpack(tokens)) -- at most K_FAIR
        if (tonumber(tags[i]) or 0) > tag and room_for(s, vten, roomy) then
          fv, fsv, fvt, fsc = page[2 * i - 1], s, vten, vscopes
          break
        end
      end
    end
  end
  if not fv and at_rank then
    -- None there: among the reservations of the next K_FAIR tags after this event's
    -- (FAIRQ's order), wherever they wait, the earliest that can give its slot. Displaced
    -- reservations wait at the end of the backlog with their early tags; the rank counts
    -- them, so its instant can fall among them, after the later tags still waiting in
    -- place.
    local nt = call('ZRANGEBYSCORE', FAIRQ, '(' .. fmt(tag), '+inf', 'LIMIT', 0, K_FAIR)
    if #nt > 0 then
      local pms = {}
      for i, tk in ipairs(nt) do
        pms[i] = '1:' .. tk
      end
      local ss = call('ZMSCORE', tlog.P, unpack(pms)) -- at most K_FAIR
      local nrecs = call('HMGET', LEASES, unpack(nt)) -- at most K_FAIR
      for i = 1, #nt do -- of those that can give their slot, the earliest (the first on ties)
        local s = ss[i] and (ss[i] + 0)
        if s and s < t and nrecs[i] and s > now then
          local vcost, vscopes, vten, _, vprio = lease_parse(nrecs[i])
          if vcost == 1 and movable(vscopes, vten) and vten ~= tenant and vprio <= prio and room_for(s, vten, roomy) and
            (not fv or s < fsv) then
            fv, fsv, fvt, fsc = pms[i], s, vten, vscopes
          end
        end
      end
    end
  end
  if fv then
    displace(fv, fsv, fvt, false, fsc)
    t, placed = fsv, true
  end
end
if not placed then
  for j = 1, m do
    reserve(logs[j], pm, t)
  end
end

-- A lease records the server's TIME when it is made, or, when the caller vouched for its
-- clock (within MAX_SKEW of TIME, checked in the last second), the caller's: the sweep's
-- grace allows for that much (worker.DefaultSweepGrace). AllowAt (no check) reads TIME.
local created = server_ms
if created == 0 and VOUCHED then
  created = caller
elseif created == 0 then
  local t = call('TIME')
  created = t[1] * 1000 + math.floor(t[2] / 1000)
end
call('HSET', LEASES, token, prio_rec .. cost .. ':' .. scopes .. ':' .. fmt(created) .. ':' .. #holder .. ':' .. holder .. tenant)
local horizon = 0
for j = 1, m do
  horizon = math.max(horizon, math.max(t, logs[j].hiw) - now + logs[j].wmax + claim_timeout + SLACK)
end
grow(LEASES, horizon)
if tlog then
  call('ZADD', FAIRQ, fmt(tag), token)
  call('HSET', FAIRH, 'l:' .. tenant, fmt(tag))
  grow(FAIRQ, horizon)
  grow(FAIRH, horizon)
end
finish_all()
return reply(0, 0, binding, count_at(quotas[binding], now, nil), now, t - caller, 1, held)
