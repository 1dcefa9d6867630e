"""The Lua scripts of the Redis lease store, one per operation.

Every script reads the record through ``fields`` (in the prelude; ``load``
wraps it in a table), which tells a missing record from one that cannot be
read: a key of another type, a
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

import hashlib

__all__ = [
    "CLAIM_SCRIPT",
    "COMPLETE_SCRIPT",
    "FORCE_RELEASE_SCRIPT",
    "PURGE_ONE_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW_MANY_SCRIPT",
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
-- The fields of the record at key (owner, generation, state, lease_until,
-- takeovers, send_id, renew_count, task_id): nil when there is none, false when it
-- cannot be read. One HMGET answers for a readable record; a key of another
-- type answers WRONGTYPE (any other error, such as a Cluster key this node
-- does not serve, stops the script), and a record without an owner is looked
-- at again.
local function fields(key)
  local f = redis.pcall('HMGET', key, 'owner', 'generation', 'state', 'lease_until',
    'takeovers', 'send_id', 'renew_count', 'task_id')
  if f.err then
    if string.find(f.err, 'WRONGTYPE', 1, true) then
      return false
    end
    error(f)
  end
  if not f[1] then
    if redis.call('EXISTS', key) == 0 then
      return nil
    end
    return false
  end
  local state = f[3]
  if not whole(f[2]) or not whole(f[4])
      or (f[5] and not whole(f[5]))
      or not (state == 'held' or state == 'released' or state == 'completed') then
    return false
  end
  return f
end
-- The record at key: nil when there is none, false when it cannot be read.
local function load(key)
  local f = fields(key)
  if not f then
    return f
  end
  return {owner = f[1], generation_text = f[2], generation = tonumber(f[2]), state = f[3],
    lease_until = tonumber(f[4]), takeovers = tonumber(f[5] or '0'), send_id = f[6] or '',
    task_id = f[8] or ''}
end
"""

#: Claim the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] ttl in ms, ARGV[3] task name,
#: ARGV[4] send id ("" when none), ARGV[5] "1" when a send id was given,
#: ARGV[6] task id ("" when none).
#: A completed record is of this run when no send id was given, the send id
#: is the record's, or it is "task:" and the record's task id (a message
#: without a send id, and the completer's task id).
#: Returns {1, generation, lease_until, now, takeovers}  acquired
#:         {2, holder, generation, lease_until, now}     held by a live lease elsewhere
#:         {3, generation, send_id, outcome or nil}      already completed by this run
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
  -- 'task:' is TASK_ID_SEND_PREFIX
  if ARGV[5] ~= '1' or send_id == r.send_id
      or (r.task_id ~= '' and send_id == 'task:' .. r.task_id) then
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
  'send_id', send_id, 'task_id', ARGV[6])
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
# fence() answers (nil, the record's fields) when the fence lets the caller
# through, else the refusal reply; renew_record() moves a fenced record's
# lease on.
_FENCE_FUNCTIONS = """
local function fence(key, owner, generation_text)
  local f = fields(key)
  if f == nil then
    return {0}
  end
  if f == false then
    return {3}
  end
  if f[1] ~= owner or f[2] ~= generation_text or f[3] ~= 'held' then
    return {2, redis.call('HGETALL', key)}
  end
  return nil, f
end
local function renew_record(key, f, lease_until_text, now_text)
  redis.call('HSET', key, 'lease_until', lease_until_text, 'renewed_at', now_text,
    'renew_count', whole(f[7]) and #f[7] < 16 and int(tonumber(f[7]) + 1) or '1')
end
"""

_FENCE = (
    _FENCE_FUNCTIONS
    + """
local key = KEYS[1]
local refused, r = fence(key, ARGV[1], ARGV[2])
if refused then
  return refused
end
local now = now_ms()
"""
)

#: Renew the lease.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation, ARGV[3] ttl in ms.
#: Returns {1, lease_until, now} renewed, or a fenced refusal (see above).
RENEW_SCRIPT = (
    _PRELUDE
    + _FENCE
    + """
local lease_until = now + tonumber(ARGV[3])
renew_record(key, r, int(lease_until), int(now))
return {1, lease_until, now}
"""
)

#: Renew many leases in one call, each fenced as RENEW_SCRIPT fences it.
#: KEYS[1] the first lease's record key (it routes the call on a Cluster);
#: ARGV[1] the leases, each as four fields ended by a NUL byte: record key,
#: owner, generation, ttl in ms (one argument, not four per lease: a client
#: spends far longer encoding many arguments than one; job ids and owners
#: never hold a NUL).
#: Returns {now, i, refusal, j, refusal, ...}: lease i (from 1) was refused,
#: with its fenced refusal (see above); every lease not named was renewed
#: until now + its ttl.
#: Redis Cluster refuses declared keys of different slots, so only the first
#: key is declared; the flag lets the script reach the others as long as
#: this node serves their slots (else the call fails with an error, and the
#: caller renews each lease alone). A single server ignores the flag.
RENEW_MANY_SCRIPT = (
    "#!lua flags=allow-cross-slot-keys\n"
    + _PRELUDE
    + _FENCE_FUNCTIONS
    + """
local data = ARGV[1]
local at = 1
local function field()
  local stop = string.find(data, '\\0', at, true)
  local text = string.sub(data, at, stop - 1)
  at = stop + 1
  return text
end
local now = now_ms()
local now_text = int(now)
local lease_until_by_ttl = {}
local replies = {now}
local i = 0
while at <= #data do
  i = i + 1
  local key, owner, generation_text, ttl_text = field(), field(), field(), field()
  local refused, r = fence(key, owner, generation_text)
  if refused then
    replies[#replies + 1] = i
    replies[#replies + 1] = refused
  else
    -- the leases of one worker mostly share a ttl: format each end once
    local lease_until_text = lease_until_by_ttl[ttl_text]
    if not lease_until_text then
      lease_until_text = int(now + tonumber(ttl_text))
      lease_until_by_ttl[ttl_text] = lease_until_text
    end
    renew_record(key, r, lease_until_text, now_text)
  end
end
return replies
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


class Script:
    """A Lua script and the SHA1 that EVALSHA names it by.

    The store calls ``client.evalsha`` itself rather than through redis-py's
    ``Script``, whose per-call work (copying keys and arguments into new
    tuples, an import, a type check) is a tenth of a claim's Python time.
    """

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
