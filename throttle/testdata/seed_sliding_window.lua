-- seed_sliding_window.lua: the plain sliding-window-log script this project started from,
-- kept as a benchmark fixture (not product code): the yardstick our script is compared with.
-- Admit one event if fewer than ARGV[3] were admitted in the last ARGV[2] ms.
-- KEYS[1]  ZSET of admitted events; member = event id, score = admit time (ms)
-- ARGV[1]  now_ms     caller's clock, integer milliseconds since the Unix epoch
-- ARGV[2]  window_ms  window length in milliseconds
-- ARGV[3]  limit      max events per window, integer > 0
-- ARGV[4]  member     unique id for this event
-- Returns {allowed 0|1, count in the window after this call}
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local count = redis.call('ZCARD', key)
local allowed = 0
if count < limit then
  redis.call('ZADD', key, now, ARGV[4])
  count = count + 1
  allowed = 1
end
redis.call('EXPIRE', key, math.ceil(window / 1000))
return {allowed, count}
