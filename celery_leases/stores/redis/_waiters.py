"""The Redis store's waiters (``lease_on_busy="wait"``): scripts and replies.

A job's waiters are one hash at ``{prefix}waiters:{{{job_id}}}`` (for
example ``leases:waiters:{report-7}``): a field per waiting send id, whose
value is ``<since>:<until>:<task id>\\0<payload>`` (store milliseconds).
The key expires at the latest ``until`` of its entries, so Redis deletes
the waiters of a job nobody ended; an entry that ran out inside a live key
is swept by the next take, or by a registration that finds the job full.
Its hash tag is the record's, so on a cluster both sit in one slot; the
record's scan pattern (``{prefix}{*}``) does not match it.
"""

from __future__ import annotations

from typing import Any

from celery_leases.stores.redis._queued import STORE_NOW
from celery_leases.stores.waiters import Waiter

__all__ = [
    "ADD_WAITER_SCRIPT",
    "TAKE_WAITERS_SCRIPT",
    "WAITERS_SCRIPT",
    "entry_value",
    "live_waiters",
    "waiters_key",
]

# the store's clock (now, int), and the until of an entry's value
_NOW = (
    STORE_NOW
    + """local function until_of(value)
  local first = string.find(value, ':', 1, true)
  local second = string.find(value, ':', first + 1, true)
  return tonumber(string.sub(value, first + 1, second - 1))
end
"""
)

#: Register a send as a waiter, unless the job has ARGV[4] live waiters of
#: other sends (those that ran out are swept first, when it looks full).
#: KEYS[1] waiters key; ARGV[1] send id, ARGV[2] ttl in ms, ARGV[3] task id,
#: NUL, payload; ARGV[4] the most waiters.
#: Returns 1: registered; 0: the job is full.
ADD_WAITER_SCRIPT = (
    _NOW
    + """
local others = redis.call('HLEN', KEYS[1]) - redis.call('HEXISTS', KEYS[1], ARGV[1])
if others >= tonumber(ARGV[4]) then
  local entries = redis.call('HGETALL', KEYS[1])
  others = 0
  for i = 1, #entries, 2 do
    if until_of(entries[i + 1]) <= now then
      redis.call('HDEL', KEYS[1], entries[i])
    elseif entries[i] ~= ARGV[1] then
      others = others + 1
    end
  end
  if others >= tonumber(ARGV[4]) then
    return 0
  end
end
local until_ms = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], int(now) .. ':' .. int(until_ms) .. ':' .. ARGV[3])
local left = redis.call('PTTL', KEYS[1])
if left < 0 or now + left < until_ms then
  redis.call('PEXPIREAT', KEYS[1], int(until_ms))
end
return 1
"""
)

#: Delete the job's waiters that have a payload (marks, whose value ends
#: with the NUL byte, stay) and return them.
#: KEYS[1] waiters key.
#: Returns {now, send id, value, send id, value, ...}, every entry taken
#: (the caller keeps the live ones).
TAKE_WAITERS_SCRIPT = (
    _NOW
    + """
local entries = redis.call('HGETALL', KEYS[1])
local taken = {int(now)}
for i = 1, #entries, 2 do
  if string.sub(entries[i + 1], -1) ~= '\\0' then
    redis.call('HDEL', KEYS[1], entries[i])
    table.insert(taken, entries[i])
    table.insert(taken, entries[i + 1])
  end
end
return taken
"""
)

#: The job's waiters, as TAKE_WAITERS_SCRIPT returns them, left in place.
#: KEYS[1] waiters key.
WAITERS_SCRIPT = (
    _NOW
    + """
local entries = redis.call('HGETALL', KEYS[1])
table.insert(entries, 1, int(now))
return entries
"""
)


def waiters_key(prefix: str, job_id: str) -> str:
    """The Redis key of ``job_id``'s waiters."""
    return f"{prefix}waiters:{{{job_id}}}"


def entry_value(task_id: str, payload: bytes) -> bytes:
    """ARGV[3] of :data:`ADD_WAITER_SCRIPT`."""
    return task_id.encode("utf-8") + b"\0" + payload


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def live_waiters(job_id: str, reply: Any) -> list[Waiter]:
    """The live waiters in a reply of :data:`TAKE_WAITERS_SCRIPT` or
    :data:`WAITERS_SCRIPT`, in the order they registered."""
    now = int(reply[0])
    waiters = []
    for send_id, value in zip(reply[1::2], reply[2::2], strict=True):
        since, until, rest = _as_bytes(value).split(b":", 2)
        task_id, payload = rest.split(b"\0", 1)
        if int(until) > now:
            waiters.append(
                Waiter(
                    job_id,
                    _as_bytes(send_id).decode("utf-8"),
                    task_id.decode("utf-8"),
                    payload,
                    int(since),
                    int(until),
                )
            )
    return sorted(waiters, key=lambda waiter: waiter.waiting_since_ms)
