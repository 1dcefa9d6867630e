"""The Lua scripts of the Redis lease store, one per operation.

Every script reads the record through ``fields`` (in the prelude; ``load``
wraps it in a table), which tells a missing record from one that cannot be
read: a key of another type, a
missing ``owner``/``generation``/``state``/``lease_until`` field, a state
that is not ours or a number that is not a whole number. An unreadable
record is never changed by a script; its own reply code says so.

Reply codes of renew, complete and release (the fenced scripts):

- ``{1, ...}``            done (renew); complete and release answer ``1``,
  the cheapest reply to read
- ``{0}``                 no record: refusal MISSING
- ``{2, HGETALL pairs}``  refused; the record as it is, to name the reason
  (superseded, released, completed) without asking twice
- ``{3}``                 the record cannot be read
"""

from __future__ import annotations

__all__ = [
    "CLAIM_SCRIPT",
    "COMPLETE_SCRIPT",
    "RELEASE_SCRIPT",
    "RENEW_MANY_SCRIPT",
    "RENEW_SCRIPT",
]

# Store time in integer milliseconds from the server's clock, and integer
# formatting: Lua numbers are doubles, and the default conversion of a
# number to a string may use an exponent for large values.
PRELUDE = """
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
-- Whether f, the fields of a record (owner, generation, state, lease_until,
-- takeovers, send_id, renew_count, task_id, outcome), can be read: an owner,
-- whole numbers and a state of ours.
local function readable(f)
  local state = f[3]
  return f[1] ~= nil and whole(f[2]) and whole(f[4])
    and (f[5] == nil or whole(f[5]))
    and (state == 'held' or state == 'released' or state == 'completed')
end
-- The reply of a read command on key, or false when key is of another type
-- (WRONGTYPE). Any other error, such as a Cluster key this node does not
-- serve, stops the script.
local function read(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if reply.err and not string.find(reply.err, 'WRONGTYPE', 1, true) then
    error(reply)
  end
  return not reply.err and reply
end
-- A record's fields by name.
local function named(f)
  return {owner = f[1], generation_text = f[2], generation = tonumber(f[2]), state = f[3],
    lease_until = tonumber(f[4]), takeovers = tonumber(f[5] or '0'), send_id = f[6] or '',
    task_id = f[8] or '', outcome = f[9]}
end
"""

# The record's fields, one HMGET (a record mostly there: renew, complete,
# release, the operator's scripts).
READ = """
-- The fields of the record at key: nil when there is none, false when it
-- cannot be read. One HMGET answers for a readable record; a record without
-- an owner is looked at again.
local function fields(key)
  local f = read('HMGET', key, 'owner', 'generation', 'state', 'lease_until',
    'takeovers', 'send_id', 'renew_count', 'task_id', 'outcome')
  if not f then
    return false
  end
  if not f[1] and redis.call('EXISTS', key) == 0 then
    return nil
  end
  return readable(f) and f
end
-- The record at key: nil when there is none, false when it cannot be read.
local function load(key)
  local f = fields(key)
  return f and named(f)
end
"""

# The record's fields and the whole record (the claim).
_READ_ALL = """
-- The fields of the record at key as fields() answers them, and the whole
-- record by field name. A claim mostly finds no record: EXISTS tells that
-- in a fraction of the time a read of a missing key takes, and one HGETALL
-- reads a record that is there.
local function all_fields(key)
  if redis.call('EXISTS', key) == 0 then
    return nil
  end
  local flat = read('HGETALL', key)
  if not flat then
    return false
  end
  local h = {}
  for i = 1, #flat, 2 do
    h[flat[i]] = flat[i + 1]
  end
  local f = {h.owner, h.generation, h.state, h.lease_until, h.takeovers, h.send_id,
    h.renew_count, h.task_id, h.outcome}
  return readable(f) and f, h
end
"""

# Many fields in one argument.
_SPLITTER = """
-- The NUL-ended fields of data, one at a time: job ids, owners, task names,
-- send ids and task ids never hold a NUL, and a client spends longer
-- encoding many arguments than one.
local function splitter(data)
  local at = 1
  return function()
    local stop = string.find(data, '\\0', at, true)
    local text = string.sub(data, at, stop - 1)
    at = stop + 1
    return text
  end, function()
    return at <= #data
  end
end
"""

#: Claim the lease.
#: KEYS[1] record key; ARGV[1] six fields, each ended by a NUL byte: owner,
#: ttl in ms, task name, send id ("" when none), "1" when a send id was
#: given, task id ("" when none).
#: A completed record is of this run when no send id was given, the send id
#: is the record's, or it is "task:" and the record's task id (a message
#: without a send id, and the completer's task id).
#: Returns "generation lease_until now takeovers"  acquired (one string: the
#:                                           common reply, and the cheapest to read)
#:         {2, holder, generation, lease_until, now}   held by a live lease elsewhere
#:         {3, generation, send_id, outcome or nil}    already completed by this run
#:         {4}                                         the record cannot be read
CLAIM_SCRIPT = (
    PRELUDE
    + _READ_ALL
    + _SPLITTER
    + """
local key = KEYS[1]
local field = splitter(ARGV[1])
local owner, ttl_ms, task_name, send_id = field(), tonumber(field()), field(), field()
local send_id_given, task_id = field() == '1', field()
local f, h = all_fields(key)
if f == false then
  return {4}
end
local r = f and named(f)
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
  if not send_id_given or send_id == r.send_id
      or (r.task_id ~= '' and send_id == 'task:' .. r.task_id) then
    return {3, r.generation, r.send_id, r.outcome}
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
local generation_text, lease_until_text, now_text = int(generation), int(now + ttl_ms), int(now)
local takeovers_text = int(takeovers)
redis.call('HSET', key, 'owner', owner, 'generation', generation_text,
  'lease_until', lease_until_text, 'state', 'held', 'task_name', task_name,
  'claimed_at', now_text, 'renew_count', '0', 'takeovers', takeovers_text,
  'send_id', send_id, 'task_id', task_id)
if h and (h.renewed_at or h.completed_at or h.outcome or h.released_at
    or h.released_by or h.release_reason) then
  -- the previous run's; a new record never had them
  redis.call('HDEL', key, 'renewed_at', 'completed_at', 'outcome', 'released_at',
    'released_by', 'release_reason')
end
return generation_text .. ' ' .. lease_until_text .. ' ' .. now_text .. ' ' .. takeovers_text
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
    PRELUDE
    + READ
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
    + PRELUDE
    + READ
    + _SPLITTER
    + _FENCE_FUNCTIONS
    + """
local field, more = splitter(ARGV[1])
local now = now_ms()
local now_text = int(now)
local lease_until_by_ttl = {}
local replies = {now}
local i = 0
while more() do
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
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation, ARGV[3] the outcome
#: bytes (absent when there is no outcome).
#: Returns 1 completed, or a fenced refusal (see above).
COMPLETE_SCRIPT = (
    PRELUDE
    + READ
    + _FENCE
    + """
if ARGV[3] then
  redis.call('HSET', key, 'state', 'completed', 'completed_at', int(now), 'outcome', ARGV[3])
else
  redis.call('HSET', key, 'state', 'completed', 'completed_at', int(now))
  if r[9] then
    -- a claim clears the previous run's outcome; a record written by hand may not
    redis.call('HDEL', key, 'outcome')
  end
end
return 1
"""
)

#: Release the lease: the owner is cleared, the generation kept.
#: KEYS[1] record key; ARGV[1] owner, ARGV[2] generation.
#: Returns 1 released, or a fenced refusal (see above).
RELEASE_SCRIPT = (
    PRELUDE
    + READ
    + _FENCE
    + """
redis.call('HSET', key, 'state', 'released', 'owner', '', 'lease_until', int(now),
  'released_at', int(now))
return 1
"""
)

#: reply codes of the fenced scripts and of the force release
DONE, MISSING, REFUSED, UNREADABLE = 1, 0, 2, 3
#: reply codes of the claim
HELD_ELSEWHERE, ALREADY_COMPLETED, CLAIM_UNREADABLE = 2, 3, 4
