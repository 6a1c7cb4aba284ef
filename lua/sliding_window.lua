-- sliding_window.lua: decide one event against every quota that applies to it, all or
-- nothing.
--
-- An event of cost c is admitted iff, for every quota q on log KEYS[j], the entries of
-- KEYS[j] scored in (now_ms - window_ms_q, +inf) number at most limit_q - c. Entries from
-- a caller whose clock runs ahead (scores above now_ms) count too. An admission trims
-- each log by its longest window, adds c entries scored now_ms, and sets PEXPIRE so the
-- log outlives its newest entry by that window. A denial writes nothing. Several quotas
-- may share one log (10/1s and 500/1h for one tenant). All KEYS share one hash slot.
--
-- KEYS[j]       ZSET window log: member = "<slot>:<event id>", score = admission time (ms)
-- ARGV[1]       now_ms    caller's clock, integer ms since the Unix epoch; "" uses the
--                         server's TIME instead
-- ARGV[2]       member    unique event id (xid); a replay with the same id finds it in a
--                         log and reports the admission again without taking a slot
-- ARGV[3]       cost      slots the event takes, integer >= 1
-- ARGV[4]       max_skew_ms  if > 0 and now_ms is further than this from the server's
--                         TIME, decide by the server's TIME instead (and say so)
-- ARGV[2+3q], ARGV[3+3q], ARGV[4+3q] for quota q = 1..:
--               j         index into KEYS of the quota's log
--               limit     most slots in one window, integer >= cost
--               window_ms window length, integer ms >= 1
--
-- Returns integers {allowed, replay, binding, count, remaining, retry_after_ms, reset_ms,
-- now_ms, server_ms, skewed}:
--   allowed        1 admitted (or replayed), 0 denied
--   replay         1 if member was already in a log: nothing was written
--   binding        the quota q that decided: on denial the one with the longest
--                  retry-after, else the one with the fewest slots left
--   count          slots in use in that quota's window after this call
--   remaining      slots left in that quota's window after this call, >= 0
--   retry_after_ms 0 when allowed; else ms until every quota has room for cost, >= 1:
--                  the largest (k-th oldest score in the window + window_ms - now_ms),
--                  k = count + cost - limit
--   reset_ms       ms until every quota's window is empty if nothing more is admitted
--   now_ms         the instant decided on (ARGV[1], or the server's TIME)
--   server_ms      the server's TIME in ms, for clock-skew checks
--   skewed         1 if now_ms was off by more than max_skew_ms and TIME was used

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

-- An event of cost c is c entries "1:<member>" .. "<c>:<member>": the number before the
-- first ':' keeps the entries of distinct (member, slot) pairs distinct, whatever the
-- member contains.
local replay = false
for j = 1, #KEYS do
  if redis.call('ZSCORE', KEYS[j], '1:' .. member) then
    replay = true
    break
  end
end

-- Count every quota's window without writing: a denial leaves the logs untouched.
local logs, limits, windows, counts = {}, {}, {}, {}
local longest = {}
local nq = (#ARGV - 4) / 3
local retry_after = 0
local binding = 1
for q = 1, nq do
  local j = tonumber(ARGV[2 + 3 * q])
  logs[q] = KEYS[j]
  limits[q] = tonumber(ARGV[3 + 3 * q])
  windows[q] = tonumber(ARGV[4 + 3 * q])
  if longest[j] == nil or windows[q] > windows[longest[j]] then
    longest[j] = q
  end
  local floor = '(' .. string.format('%d', now - windows[q])
  counts[q] = redis.call('ZCOUNT', logs[q], floor, '+inf')
  if not replay and counts[q] + cost > limits[q] then
    local k = counts[q] + cost - limits[q]
    local kth = redis.call('ZRANGEBYSCORE', logs[q], floor, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)
    local wait = tonumber(kth[2]) + windows[q] - now
    if wait < 1 then
      wait = 1
    end
    if wait > retry_after then
      retry_after = wait
      binding = q
    end
  end
end

local allowed = 0
if replay or retry_after == 0 then
  allowed = 1
end

if allowed == 1 and not replay then
  local entries = {}
  for c = 1, cost do
    entries[#entries + 1] = now_arg
    entries[#entries + 1] = c .. ':' .. member
  end
  for j = 1, #KEYS do
    local w = windows[longest[j]]
    redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', string.format('%d', now - w))
    for first = 1, #entries, 1000 do
      redis.call('ZADD', KEYS[j], unpack(entries, first, math.min(first + 999, #entries)))
    end
    local newest = tonumber(redis.call('ZRANGE', KEYS[j], -1, -1, 'WITHSCORES')[2])
    if newest > now then
      redis.call('PEXPIRE', KEYS[j], string.format('%d', newest - now + w))
    else
      redis.call('PEXPIRE', KEYS[j], ARGV[4 + 3 * longest[j]])
    end
  end
  for q = 1, nq do
    counts[q] = counts[q] + cost
  end
end

local reset = 0
local fewest = nil
for q = 1, nq do
  local newest = redis.call('ZRANGE', logs[q], -1, -1, 'WITHSCORES')[2]
  if newest then
    local left = tonumber(newest) + windows[q] - now
    if left > reset then
      reset = left
    end
  end
  if allowed == 1 and (fewest == nil or limits[q] - counts[q] < fewest) then
    fewest = limits[q] - counts[q]
    binding = q
  end
end

local remaining = limits[binding] - counts[binding]
if remaining < 0 then
  remaining = 0
end
return {allowed, replay and 1 or 0, binding, counts[binding], remaining, retry_after, reset, now, server_ms, skewed}
