"""The Lua scripts of the Redis lease store's operator calls: a forced
release and the purge of one finished record.

Used by :mod:`celery_leases.stores.redis._store` (``force_release`` and ``purge``,
which ``celery leases release`` and ``celery leases purge`` call). They read
the record as the worker's scripts in
:mod:`~celery_leases.stores.redis._scripts` do, and never change a record
they cannot read.
"""

from __future__ import annotations

from celery_leases.stores.redis._scripts import PRELUDE, READ

__all__ = ["FORCE_RELEASE_SCRIPT", "PURGE_ONE_SCRIPT"]

#: An operator's release: whoever holds it, the generation moves on by one.
#: KEYS[1] record key; ARGV[1] who released it, ARGV[2] why.
#: Returns {1, HGETALL pairs}  released; the record after the release
#:         {0}                 no record
#:         {2, HGETALL pairs}  the job is completed: left as it is
#:         {3}                 the record cannot be read
FORCE_RELEASE_SCRIPT = (
    PRELUDE
    + READ
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
    PRELUDE
    + READ
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
