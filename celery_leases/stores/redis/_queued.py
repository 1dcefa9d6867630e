"""The Redis store's queued marks (``lease_queue_unique``): scripts and replies.

A job's mark is a hash at ``{prefix}queued:{{{job_id}}}`` (for example
``leases:queued:{report-7}``) with the fields ``task_id``, ``queued_at``
and ``queued_until`` (store milliseconds), and an expiry at
``queued_until``, so Redis deletes a mark that ran out. Its hash tag is the
record's, so on a cluster both sit in one slot; the record's scan pattern
(``{prefix}{*}``) does not match it.
"""

from __future__ import annotations

from typing import Any

from celery_leases.stores.queued import QueuedMark

__all__ = [
    "EXTEND_QUEUED_SCRIPT",
    "MARK_QUEUED_SCRIPT",
    "QUEUED_SCRIPT",
    "STORE_NOW",
    "UNMARK_QUEUED_SCRIPT",
    "mark_key",
    "queued_mark",
]

#: Lua: the store time in integer milliseconds from the server's clock
#: (``now``), and ``int(n)``, a number formatted as an integer (a Lua number
#: may print with an exponent)
STORE_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function int(n)
  return string.format('%d', n)
end
"""

_NOW = (
    STORE_NOW
    + """local found = redis.call('HMGET', KEYS[1], 'task_id', 'queued_at', 'queued_until')
local live = found[1] and tonumber(found[3]) and tonumber(found[3]) > now
"""
)

#: Place the mark unless a live one of another task id is there; a live one
#: of this task id runs out ARGV[2] ms from now instead (queued_at is kept).
#: KEYS[1] mark key; ARGV[1] task id, ARGV[2] ttl in ms.
#: Returns {task_id, queued_at, queued_until}: the live mark after the call.
MARK_QUEUED_SCRIPT = (
    _NOW
    + """
if live and found[1] ~= ARGV[1] then
  return {found[1], found[2], found[3]}
end
local queued_at = int(now)
if live then
  queued_at = found[2]
end
local until_ms = now + tonumber(ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'task_id', ARGV[1], 'queued_at', queued_at,
  'queued_until', int(until_ms))
redis.call('PEXPIREAT', KEYS[1], int(until_ms))
return {ARGV[1], queued_at, int(until_ms)}
"""
)

#: Make the live mark of the task id run out ARGV[2] ms from now; place none.
#: KEYS[1] mark key; ARGV[1] task id, ARGV[2] ttl in ms.
#: Returns {task_id, queued_at, queued_until}: the live mark after the call
#: (this one, extended, or another task id's), or {} when there is none.
EXTEND_QUEUED_SCRIPT = (
    _NOW
    + """
if not live then
  return {}
end
if found[1] ~= ARGV[1] then
  return {found[1], found[2], found[3]}
end
local until_ms = int(now + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'queued_until', until_ms)
redis.call('PEXPIREAT', KEYS[1], until_ms)
return {found[1], found[2], until_ms}
"""
)

#: Take the mark away if it names the task id.
#: KEYS[1] mark key; ARGV[1] task id.
#: Returns 1: a live mark of the task id was taken away; 0: none.
UNMARK_QUEUED_SCRIPT = (
    _NOW
    + """
if found[1] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if live then
  return 1
end
return 0
"""
)

#: The live mark.
#: KEYS[1] mark key.
#: Returns {task_id, queued_at, queued_until}, or {} when there is none.
QUEUED_SCRIPT = (
    _NOW
    + """
if live then
  return {found[1], found[2], found[3]}
end
return {}
"""
)


def mark_key(prefix: str, job_id: str) -> str:
    """The Redis key of ``job_id``'s queued mark."""
    return f"{prefix}queued:{{{job_id}}}"


def queued_mark(job_id: str, reply: Any) -> QueuedMark | None:
    """The mark in a reply of :data:`MARK_QUEUED_SCRIPT`,
    :data:`EXTEND_QUEUED_SCRIPT` or :data:`QUEUED_SCRIPT`."""
    if not reply:
        return None
    task_id, queued_at, queued_until = reply
    if isinstance(task_id, bytes):
        task_id = task_id.decode("utf-8")
    return QueuedMark(job_id, str(task_id), int(queued_at), int(queued_until))
