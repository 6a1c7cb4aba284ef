-- plain_reserve.lua: the seed's algorithm (seed_sliding_window.lua) with a reservation, as
-- plainly as the issue's rules allow: a benchmark fixture, not product code. It is the
-- least a script does for row (d) of the benchmark (a hot key whose window is full, a
-- task reserving the next free slot) with reservations that are points in time, claimed
-- by token, lapsing when unclaimed and released when their task is gone: an entry in the
-- window log at the reserved instant, a pending entry (for lapses), a lease (for
-- releases), and their TTLs. None of the limiter's other rules (skew high-water mark,
-- replays, fairness, weights, pause, spacing) and no lapse or claim done: what writing a
-- reservation in that shape costs, the yardstick for what the limiter's other rules add
-- (a design with fewer keys per reservation could cost less). The log must be full from
-- now on, as in rows (d) and (e): the end slot is then the limit-th newest entry's instant
-- plus the window, or the newest entry's if later. An admission is checked against the
-- window ending at now only, not against those of the reservations ahead: in a gap
-- between reservations it can break one of their windows (rows (d0) and (e0) allow one
-- call in a hundred to be admitted).
-- KEYS[1]  the window log   KEYS[2] its pending set   KEYS[3] the leases hash
-- ARGV[1]  now_ms   ARGV[2] window_ms   ARGV[3] limit   ARGV[4] token
-- Returns {1, 0} when admitted, else {0, the reserved instant}; {0, -1} for a token that
-- holds a reservation already (a claim: not timed here)
local key, now = KEYS[1], tonumber(ARGV[1])
local window, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local member = '@' .. ARGV[4]
if redis.call('ZSCORE', key, member) then
  return {0, -1}
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
newest = newest and tonumber(newest) or now
if redis.call('ZCOUNT', key, '(' .. (now - window), now) < limit then
  redis.call('ZADD', key, now, member)
  redis.call('PEXPIRE', key, math.max(newest, now) - now + window) -- outlasting the reservations ahead
  return {1, 0}
end
local t = tonumber(redis.call('ZRANGE', key, -limit, -limit, 'WITHSCORES')[2]) + window
if newest > t then
  t = newest
end
redis.call('ZADD', key, t, member)
redis.call('ZADD', KEYS[2], t, ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], now)
local ttl = t - now + window
redis.call('PEXPIRE', key, ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return {0, t}
