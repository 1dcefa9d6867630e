"""The Lua scripts of the Redis lease store, one per operation.

Every script reads the record through ``load`` (in the prelude), which tells
a missing record from one that cannot be read: a key of another type, a
missing ``owner``/``generation``/``state``/``lease_until`` field, a state
that is not ours or a number that is not a whole number. An unreadable
record is never changed by a script; its own reply code says so.

Reply codes of renew, complete and release (the fenced scripts):

- ``{1, ...}``            done
- ``{0}``                 no record: refusal MISSING
- ``{2, HGETALL pairs}``  refused; the record as it is, to name the reason
  (superseded, released, completed) without asking twice
- ``{3}``                 the record cannot be read
"""

from __future__ import annotations

__all__ = [
    "CLAIM_SCRIPT",
    "COMPLETE_SCRIPT",
    "FORCE_RELEASE_SCRIPT",
    "PURGE_ONE_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW_SCRIPT",
]

# Store time in integer milliseconds from the server's clock, and integer
# formatting: Lua numbers are doubles, and the default conversion of a
# number to a string may use an exponent for large values.
_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n)
  return string.format('%d', n)
end
local function whole(text)
  return text and string.match(text, '^%d+$') ~= nil
end
-- The record at key: nil when there is none, false when it cannot be read.
local function load(key)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    return nil
  end
  if kind ~= 'hash' then
    return false
  end
  local f = redis.call('HMGET', key, 'owner', 'generation', 'state', 'lease_until',
    'takeovers', 'send_id')
  local state = f[3]
  if not f[1] or not whole(f[2]) or not whole(f[4])
      or (f[5] and not whole(f[5]))
      or not (state == 'held' or state == 'released' or state == 'completed') then
    return false
  end
  return {owner = f[1], generation_text = f[2], generation = tonumber(f[2]), state = state,
    lease_until = tonumber(f[4]), takeovers = tonumber(f[5] or '0'), send_id = f[6] or ''}
end
"""

#: Claim the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] ttl in ms, ARGV[3] task name,
#: ARGV[4] send id ("" when none), ARGV[5] "1" when a send id was given.
#: Returns {1, generation, lease_until, now, takeovers}  acquired
#:         {2, holder, generation, lease_until, now}     held by a live lease elsewhere
#:         {3, generation, send_id, outcome or nil}      already completed by this send
#:         {4}                                           the record cannot be read
CLAIM_SCRIPT = (
    _PRELUDE
    + """
local key = KEYS[1]
local owner, ttl_ms, task_name, send_id = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local r = load(key)
if r == false then
  return {4}
end
local now = now_ms()
-- Every claim takes max(previous + 1, clock): after a restart from an older
-- file, or a failover to a replica that missed the last claims, the clock is
-- still above every generation handed out before (I1).
local generation, takeovers
if r == nil then
  -- a new record (or one purged, or lost) starts at the clock
  generation, takeovers = now, 0
elseif r.state == 'completed' then
  if ARGV[5] ~= '1' or send_id == r.send_id then
    return {3, r.generation, r.send_id, redis.call('HGET', key, 'outcome')}
  end
  -- another send of a completed job: a new run
  generation, takeovers = math.max(r.generation + 1, now), 0
elseif r.state == 'held' and r.lease_until > now then
  return {2, r.owner, r.generation, r.lease_until, now}
else
  generation, takeovers = math.max(r.generation + 1, now), r.takeovers
  if r.state == 'held' then
    -- the holder's lease ran out without a release: it died or stalled
    takeovers = takeovers + 1
  end
end
local lease_until = now + ttl_ms
redis.call('HSET', key, 'owner', owner, 'generation', int(generation),
  'lease_until', int(lease_until), 'state', 'held', 'task_name', task_name,
  'claimed_at', int(now), 'renew_count', '0', 'takeovers', int(takeovers),
  'send_id', send_id)
if r ~= nil then
  -- a new record never had these; an old one's belong to the previous run
  redis.call('HDEL', key, 'renewed_at', 'completed_at', 'outcome', 'released_at',
    'released_by', 'release_reason')
end
return {1, generation, lease_until, now, takeovers}
"""
)

# The fence of renew, complete and release: owner and generation match and
# the lease is held (a run-out lease nobody claimed since still matches).
_FENCE = """
local key = KEYS[1]
local r = load(key)
if r == nil then
  return {0}
end
if r == false then
  return {3}
end
if r.owner ~= ARGV[1] or r.generation_text ~= ARGV[2] or r.state ~= 'held' then
  return {2, redis.call('HGETALL', key)}
end
local now = now_ms()
"""

#: Renew the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation, ARGV[3] ttl in ms.
#: Returns {1, lease_until, now} renewed, or a fenced refusal (see above).
RENEW_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
local lease_until = now + tonumber(ARGV[3])
redis.call('HSET', key, 'lease_until', int(lease_until), 'renewed_at', int(now))
redis.call('HINCRBY', key, 'renew_count', 1)
return {1, lease_until, now}
"""
)

#: Complete the job and store its outcome; the record keeps owner and generation.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation, ARGV[3] outcome
#: bytes, ARGV[4] "1" when there is an outcome.
#: Returns {1} completed, or a fenced refusal (see above).
COMPLETE_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
redis.call('HSET', key, 'state', 'completed', 'completed_at', int(now))
if ARGV[4] == '1' then
  redis.call('HSET', key, 'outcome', ARGV[3])
else
  redis.call('HDEL', key, 'outcome')
end
return {1}
"""
)

#: Release the lease: the owner is cleared, the generation kept.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation.
#: Returns {1} released, or a fenced refusal (see above).
RELEASE_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
redis.call('HSET', key, 'state', 'released', 'owner', '', 'lease_until', int(now),
  'released_at', int(now))
return {1}
"""
)

#: An operator's release: whoever holds it, the generation moves on by one.
#: KEYS[1] record key; ARGV[1] who released it, ARGV[2] why.
#: Returns {1, HGETALL pairs}  released; the record after the release
#:         {0}                 no record
#:         {2, HGETALL pairs}  the job is completed: left as it is
#:         {3}                 the record cannot be read
FORCE_RELEASE_SCRIPT = (
    _PRELUDE
    + """
local key = KEYS[1]
local r = load(key)
if r == nil then
  return {0}
end
if r == false then
  return {3}
end
if r.state == 'completed' then
  return {2, redis.call('HGETALL', key)}
end
local now = now_ms()
redis.call('HSET', key, 'generation', int(r.generation + 1), 'state', 'released',
  'owner', '', 'lease_until', int(now), 'released_at', int(now),
  'released_by', ARGV[1], 'release_reason', ARGV[2])
return {1, redis.call('HGETALL', key)}
"""
)

#: Delete one completed or released record if it finished long enough ago
#: (a late duplicate must still find the job completed). A record made
#: again starts at the clock, above the deleted one's generation (I1), as a
#: record a store lost would. A key that is not a readable record is never
#: deleted.
#: KEYS[1] record key; ARGV[1] retention in ms.
#: Returns 1 deleted, 0 kept.
PURGE_ONE_SCRIPT = (
    _PRELUDE
    + """
local r = load(KEYS[1])
if not r then
  return 0
end
local finished
if r.state == 'completed' then
  finished = redis.call('HGET', KEYS[1], 'completed_at')
elseif r.state == 'released' then
  -- records released before released_at existed ended their lease at release
  finished = redis.call('HGET', KEYS[1], 'released_at') or int(r.lease_until)
else
  return 0
end
if not whole(finished) then
  return 0
end
local now = now_ms()
if tonumber(finished) <= now - tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

#: reply codes of the fenced scripts and of the force release
DONE, MISSING, REFUSED, UNREADABLE = 1, 0, 2, 3
#: reply codes of the claim
ACQUIRED, HELD_ELSEWHERE, ALREADY_COMPLETED, CLAIM_UNREADABLE = 1, 2, 3, 4
