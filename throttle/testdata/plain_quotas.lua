-- plain_quotas.lua: the seed's algorithm (seed_sliding_window.lua) for several quotas on
-- several keys, all or nothing: a benchmark fixture, not product code. It decides row (c)
-- of the benchmark (a tenant quota of two windows and a type quota) exactly, as the seed
-- decides one quota, with none of the limiter's rules beyond the seed's (no skew
-- high-water mark, no reservations, no weights, no pause): what the seed's own algorithm
-- costs on row (c), the yardstick for what the limiter's rules add there.
-- KEYS     the window logs (ZSETs of admitted events, scored by admit time in ms)
-- ARGV[1]  now_ms   ARGV[2] member
-- then per quota: limit, window_ms, the index of its key in KEYS; a key's quotas follow
-- one another, its longest window first
-- Returns {1} when admitted, else {0, the first quota with no room}
local now = tonumber(ARGV[1])
local n = (#ARGV - 2) / 3
local wmax = {}
for i = 1, n do -- a key's first quota is its longest: trim by it, count it by ZCARD
  local k = tonumber(ARGV[3 * i + 2])
  local limit, window = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local count
  if not wmax[k] then
    wmax[k] = window
    redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now - window)
    count = redis.call('ZCARD', KEYS[k])
  else
    count = redis.call('ZCOUNT', KEYS[k], '(' .. (now - window), '+inf')
  end
  if count >= limit then
    return {0, i}
  end
end
for k = 1, #KEYS do
  redis.call('ZADD', KEYS[k], now, ARGV[2])
  redis.call('PEXPIRE', KEYS[k], wmax[k])
end
return {1}
