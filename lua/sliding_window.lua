-- sliding_window.lua: decide one event against every quota that applies to it, all or
-- nothing, and optionally hold a reservation for a denied event.
--
-- A window log is a sorted set of entries scored in ms: admissions, and reservations
-- (slots promised to denied events, at the instant they may run). An event of cost c is
-- admitted iff, for every quota q on log KEYS[j], the entries of KEYS[j] scored in
-- (now_ms - window_ms_q, +inf) number at most limit_q - c. Reservations in the future
-- count too, so a new event never takes a slot promised to an earlier one, and so do
-- admissions from a caller whose clock runs ahead. An admission adds c entries scored
-- now_ms. Several quotas may share one log (10/1s and 500/1h for one tenant). All KEYS
-- share one hash slot.
--
-- Trimming: a write removes the entries scored at or before now_ms - longest window -
-- grace_ms, and PEXPIRE keeps each set until its newest entry is that old. The grace is
-- how far behind another caller's clock may be: its call can reach Redis after a call
-- stamped later, and must still find every entry of its own window.
--
-- Without a token a denial writes nothing. With a token (the waiting task's id):
--   * a denied event that holds no reservation reserves the first instant t at which every
--     quota has room, counting all entries: c entries at t in every log, and the same in
--     the reservation set beside each log. The reply's retry_after is t - now_ms.
--   * an event whose reservation is still ahead is denied with retry_after = t - now_ms,
--     writing nothing (a replayed reservation call finds its reservation: idempotent).
--   * an event whose reservation is due is admitted iff, for every quota, the entries in
--     (now_ms - window_ms, now_ms] other than its own, plus admissions scored after
--     now_ms, leave room for c: reservations behind it do not block it. Admission turns
--     the reservation into an admission at now_ms. Otherwise it is denied until that room
--     comes, keeping its reservation where it is.
-- A reservation that is never used stops counting one window after its instant.
--
-- Fairness on a type-wide quota: first come, first served would let one tenant's backlog
-- hold every slot of the type for as long as it lasts. So when a tenant's event must
-- reserve on the type-wide log, it takes the earliest slot ahead (among the next 4 x limit
-- reservations) held by a tenant with at least two more reservations than it in the window
-- ending there, and that reservation moves behind everything on the type-wide log. Tenants
-- waiting together thus share the type's slots equally. The owners hash maps each
-- reservation on the type-wide log to "<tenant tag>/<cost>"; only cost-1 reservations move.
--
-- KEYS[j]       ZSET window log j = 1..m: member "<slot>:<member>" for an admission,
--               "<slot>@<token>" for a reservation; score = instant (ms)
-- KEYS[m+j]     ZSET reservations of log j: its reservation entries, same members and
--               scores (reservation sets always follow the logs, token or not)
-- KEYS[2m+1]    HASH owners of the reservations on the type-wide log (only with a token
--               and a type-wide quota): token -> "<tenant tag>/<cost>"
-- ARGV[1]       now_ms      caller's clock, integer ms since the Unix epoch; "" uses the
--                           server's TIME instead
-- ARGV[2]       member      unique event id (xid) of this admission; a call that finds it
--                           in a log reports the admission again and writes nothing
-- ARGV[3]       cost        slots the event takes, integer >= 1
-- ARGV[4]       max_skew_ms if > 0 and now_ms is further than this from the server's
--                           TIME, decide by the server's TIME instead (and say so)
-- ARGV[5]       token       the waiting task's id for reservations, or "" for none
-- ARGV[6]       type_log    index j of the type-wide log in KEYS, or 0 if none
-- ARGV[7]       tag         the event's tenant, as a short tag, for the owners hash
-- ARGV[8]       grace_ms    how long entries outlive their longest window, integer >= 0
-- ARGV[6+3q], ARGV[7+3q], ARGV[8+3q] for quota q = 1..:
--               j           index of the quota's log in KEYS (1..m)
--               limit       most slots in one window, integer >= cost
--               window_ms   window length, integer ms >= 1
--
-- Returns integers {allowed, replay, binding, count, remaining, retry_after_ms, reset_ms,
-- now_ms, server_ms, skewed, reserved, held}:
--   allowed        1 admitted (or replayed), 0 denied
--   replay         1 if member was already admitted: nothing was written
--   binding        the quota q that decided: on denial the first with the longest
--                  retry-after, else the first with the fewest slots left
--   count          entries counted in that quota's window after this call
--   remaining      slots left in that quota's window after this call, >= 0
--   retry_after_ms 0 when allowed; else ms until the event may be admitted, >= 1: its
--                  reservation's instant, or the largest (k-th oldest counted score +
--                  window_ms - now_ms), k = count + cost - limit. For a due reservation
--                  blocked by admissions scored after now_ms (callers whose clocks run
--                  ahead), those are looked for among the first 1000 entries after now_ms;
--                  past them it waits window_ms: later than needed, never too early.
--   reset_ms       ms until every quota's window is empty if nothing more is admitted
--   now_ms         the instant decided on (ARGV[1], or the server's TIME)
--   server_ms      the server's TIME in ms, for clock-skew checks
--   skewed         1 if now_ms was off by more than max_skew_ms and TIME was used
--   reserved       1 if the event holds a reservation after this call (denied only)
--   held           1 if the event held a (not lapsed) reservation when the call began:
--                  it is coming back for it

local time = redis.call('TIME')
local server_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local now_arg = ARGV[1]
local now = tonumber(now_arg)
local max_skew = tonumber(ARGV[4])
local skewed = 0
if now_arg == '' or (max_skew > 0 and math.abs(now - server_ms) > max_skew) then
  skewed = now_arg == '' and 0 or 1
  now = server_ms
  now_arg = string.format('%d', now)
end
local member = ARGV[2]
local cost = tonumber(ARGV[3])
local token = ARGV[5]
local type_log = tonumber(ARGV[6])
local tag = ARGV[7]
local grace = tonumber(ARGV[8])
local owners = nil -- the owners hash's key, when fairness applies
local m = #KEYS / 2
if token ~= '' and type_log > 0 then
  m = (#KEYS - 1) / 2
  owners = KEYS[2 * m + 1]
end

local function fmt(x)
  return string.format('%d', x)
end

-- An admission of cost c is c entries "1:<member>" .. "<c>:<member>", a reservation c
-- entries "1@<token>" .. "<c>@<token>": the number and the separator after it keep the
-- entries of distinct (kind, id, slot) triples distinct, whatever the ids contain, so a
-- member can never pass for a reservation or the other way round.
local function entries_of(sep, id, score)
  local e = {}
  for c = 1, cost do
    e[#e + 1] = score
    e[#e + 1] = c .. sep .. id
  end
  return e
end

-- Is this log entry an admission (not a reservation)?
local function is_admission(entry)
  return string.match(entry, '^%d+(.)') == ':'
end

local limits, windows, counts, logs = {}, {}, {}, {}
local longest = {} -- per log j, its longest window among the quotas
local nq = (#ARGV - 8) / 3
for q = 1, nq do
  local j = tonumber(ARGV[6 + 3 * q])
  logs[q] = j
  limits[q] = tonumber(ARGV[7 + 3 * q])
  windows[q] = tonumber(ARGV[8 + 3 * q])
  longest[j] = math.max(longest[j] or 0, windows[q])
end

-- trim drops the entries of log j, and of its reservation set, too old to count for any
-- caller; with the owners hash, the owners of the reservations dropped from the type log.
local function trim(j)
  local floor = fmt(now - longest[j] - grace)
  if owners and j == type_log then
    local gone = redis.call('ZRANGEBYSCORE', KEYS[m + j], '-inf', floor)
    for i = 1, #gone do
      redis.call('HDEL', owners, string.sub(gone[i], string.find(gone[i], '@', 1, true) + 1))
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', floor)
  redis.call('ZREMRANGEBYSCORE', KEYS[m + j], '-inf', floor)
end

-- expire sets the TTL of log j and its reservation set (and owners with the type log) to
-- last until the log's newest entry is too old to count; it returns that newest score.
local function expire(j)
  local newest = tonumber(redis.call('ZRANGE', KEYS[j], -1, -1, 'WITHSCORES')[2] or now)
  local ttl = fmt(math.max(newest, now) - now + longest[j] + grace)
  redis.call('PEXPIRE', KEYS[j], ttl)
  redis.call('PEXPIRE', KEYS[m + j], ttl)
  if owners and j == type_log then
    redis.call('PEXPIRE', owners, ttl)
  end
  return newest
end

-- A replay: this member's admission is still in a log. Report it again; write nothing.
local replay = false
for j = 1, m do
  if redis.call('ZSCORE', KEYS[j], '1:' .. member) then
    replay = true
    break
  end
end

-- This event's reservation: its entries "<c>@<token>" and, per log, their instant.
local own = {}
local own_at = {} -- per log j, the instant of this event's reservation in it
local reserved_at = nil -- the latest of them: when the reservation is due
if token ~= '' and not replay then
  for c = 1, cost do
    own[c] = c .. '@' .. token
  end
  for j = 1, m do
    local raw = redis.call('ZSCORE', KEYS[m + j], own[1])
    -- A reservation lapses one window after its instant (the grace only keeps it for
    -- late callers to count): then the event waits again like a new one.
    if raw and tonumber(raw) > now - longest[j] then
      own_at[j] = tonumber(raw)
      reserved_at = math.max(reserved_at or own_at[j], own_at[j])
    end
  end
end
local due = reserved_at ~= nil and reserved_at <= now
local is_own = {}
for _, e in ipairs(own) do
  is_own[e] = true
end

-- kth_due is the k-th oldest entry blocking a due reservation on log j for a window of w:
-- entries in (now - w, now] other than its own, then admissions after now.
local function kth_due(j, w, k)
  local seen = 0
  local page = redis.call('ZRANGEBYSCORE', KEYS[j], '(' .. fmt(now - w), now_arg, 'WITHSCORES', 'LIMIT', 0, k + cost)
  for i = 1, #page, 2 do
    if not is_own[page[i]] then
      seen = seen + 1
      if seen == k then
        return tonumber(page[i + 1])
      end
    end
  end
  -- Admissions after now come from callers whose clocks run ahead: few, among many
  -- reservations. Look at a bounded page; past it, wait a whole window (safe, rare).
  page = redis.call('ZRANGEBYSCORE', KEYS[j], '(' .. now_arg, '+inf', 'WITHSCORES', 'LIMIT', 0, 1000)
  for i = 1, #page, 2 do
    if is_admission(page[i]) then
      seen = seen + 1
      if seen == k then
        return tonumber(page[i + 1])
      end
    end
  end
  return now
end

local retry_after = 0
local binding = 1
for q = 1, nq do
  local j = logs[q]
  local log = KEYS[j]
  local floor = '(' .. fmt(now - windows[q])
  local count
  if replay or (reserved_at ~= nil and not due) then
    count = redis.call('ZCOUNT', log, floor, '+inf')
  elseif due then
    -- Entries up to now, less this event's own reservation, plus admissions after now:
    -- reservations behind this one do not block it.
    count = redis.call('ZCOUNT', log, floor, now_arg)
    if own_at[j] and own_at[j] > now - windows[q] and own_at[j] <= now then
      count = count - cost
    end
    count = count + redis.call('ZCOUNT', log, '(' .. now_arg, '+inf')
      - redis.call('ZCOUNT', KEYS[m + j], '(' .. now_arg, '+inf')
  else
    count = redis.call('ZCOUNT', log, floor, '+inf')
  end
  counts[q] = count
  if replay then
    -- nothing to decide
  elseif reserved_at ~= nil and not due then
    -- Not yet due: come back at the reservation's instant.
    retry_after = reserved_at - now
  elseif count + cost > limits[q] then
    local k = count + cost - limits[q]
    local kth
    if due then
      kth = kth_due(j, windows[q], k)
    else
      -- By rank, not by LIMIT offset: a backlog of reservations makes k large.
      local rank = redis.call('ZCARD', log) - count + k - 1
      kth = tonumber(redis.call('ZRANGE', log, rank, rank, 'WITHSCORES')[2])
    end
    local wait = math.max(kth + windows[q] - now, 1)
    if wait > retry_after then
      retry_after = wait
      binding = q
    end
  end
end

-- fair_slot looks for an earlier slot on the type-wide log for a denied event whose first
-- free instant there is at (quota q binding): the earliest reservation ahead of at, of cost
-- 1, whose owner holds at least two more reservations than this tenant in the window
-- ending at it, and whose instant this event's other quotas allow. It returns that
-- instant and the victim's token, or at and nil.
local function fair_slot(at, q)
  local w, limit = windows[q], limits[q]
  local page = redis.call('ZRANGEBYSCORE', KEYS[m + type_log], '(' .. now_arg, '(' .. fmt(at),
    'WITHSCORES', 'LIMIT', 0, 4 * limit)
  if #page == 0 then
    return at, nil
  end
  local ids, scores = {}, {}
  for i = 1, #page, 2 do
    ids[#ids + 1] = string.sub(page[i], string.find(page[i], '@', 1, true) + 1)
    scores[#scores + 1] = tonumber(page[i + 1])
  end
  local held_by = redis.call('HMGET', owners, unpack(ids))
  local mine_key = tag .. '/1'
  local held = {} -- reservations per owner in the window (scores[i] - w, scores[i]]
  local first, last = 1, 0
  for i = 1, #ids do
    while last < #ids and scores[last + 1] <= scores[i] do
      last = last + 1
      local owner = held_by[last] or ''
      held[owner] = (held[owner] or 0) + 1
    end
    while scores[first] <= scores[i] - w do
      local gone = held_by[first] or ''
      held[gone] = held[gone] - 1
      first = first + 1
    end
    local owner = held_by[i] or ''
    if owner ~= mine_key and string.sub(owner, -2) == '/1' and held[owner] > (held[mine_key] or 0) + 1 then
      local fits = true
      for o = 1, nq do
        if logs[o] ~= type_log and redis.call('ZCOUNT', KEYS[logs[o]],
            '(' .. fmt(scores[i] - windows[o]), '+inf') + cost > limits[o] then
          fits = false
          break
        end
      end
      if fits then
        return scores[i], ids[i]
      end
    end
  end
  return at, nil
end

local allowed = 0
local reserved = 0
local newest = {}
if replay then
  allowed = 1
elseif retry_after == 0 then
  allowed = 1
  local admitted = entries_of(':', member, now_arg)
  for j = 1, m do
    trim(j)
    if reserved_at ~= nil then
      redis.call('ZREM', KEYS[j], unpack(own))
      redis.call('ZREM', KEYS[m + j], unpack(own))
      if owners and j == type_log then
        redis.call('HDEL', owners, token)
      end
    end
    for first = 1, #admitted, 1000 do
      redis.call('ZADD', KEYS[j], unpack(admitted, first, math.min(first + 999, #admitted)))
    end
    newest[j] = expire(j)
  end
  for q = 1, nq do
    counts[q] = counts[q] + cost
  end
elseif token ~= '' then
  reserved = 1
  if reserved_at == nil then
    local at = now + retry_after
    local victim = nil
    if owners and logs[binding] == type_log and cost == 1 then
      at, victim = fair_slot(at, binding)
    end
    if victim then
      -- The victim's slot is ours; it goes behind everything, as a new reservation would.
      redis.call('ZREM', KEYS[type_log], '1@' .. victim)
      redis.call('ZREM', KEYS[m + type_log], '1@' .. victim)
    end
    local held = entries_of('@', token, fmt(at))
    for j = 1, m do
      trim(j)
      for first = 1, #held, 1000 do
        local part = {unpack(held, first, math.min(first + 999, #held))}
        redis.call('ZADD', KEYS[j], unpack(part))
        redis.call('ZADD', KEYS[m + j], unpack(part))
      end
    end
    if victim then
      local q = binding
      local count = redis.call('ZCOUNT', KEYS[type_log], '(' .. fmt(now - windows[q]), '+inf')
      local rank = redis.call('ZCARD', KEYS[type_log]) - count + (count + 1 - limits[q]) - 1
      local later = tonumber(redis.call('ZRANGE', KEYS[type_log], rank, rank, 'WITHSCORES')[2]) + windows[q]
      later = math.max(later, at)
      redis.call('ZADD', KEYS[type_log], later, '1@' .. victim)
      redis.call('ZADD', KEYS[m + type_log], later, '1@' .. victim)
    end
    if owners then
      redis.call('HSET', owners, token, tag .. '/' .. cost)
    end
    for j = 1, m do
      newest[j] = expire(j)
    end
    retry_after = at - now
  end
end

local reset = 0
local fewest = nil
for q = 1, nq do
  local j = logs[q]
  if newest[j] == nil then
    newest[j] = tonumber(redis.call('ZRANGE', KEYS[j], -1, -1, 'WITHSCORES')[2] or -1)
  end
  if newest[j] >= 0 then
    reset = math.max(reset, newest[j] + windows[q] - now)
  end
  if allowed == 1 and (fewest == nil or limits[q] - counts[q] < fewest) then
    fewest = limits[q] - counts[q]
    binding = q
  end
end

local remaining = math.max(limits[binding] - counts[binding], 0)
local held = reserved_at ~= nil and 1 or 0
return {allowed, replay and 1 or 0, binding, counts[binding], remaining, retry_after, reset, now, server_ms, skewed, reserved, held}
