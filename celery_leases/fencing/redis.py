"""Fenced writes to Redis keys: ``SET``, ``HSET`` and ``XADD`` through Lua.

Each fenced key ``K`` has a fence hash beside it that keeps the newest
token accepted for ``K`` (fields ``job_id`` and ``generation``)::

    <prefix>fence:{K}         when K has no hash tag
    <prefix>fence:{t}:K       when K has a hash tag {t}

so the fence and the key always share a Redis Cluster slot. The fence hash
never expires, even when the value is written with ``ex=``: a fence that
expired would let an older generation write again. One script per
command checks the fence, moves it and writes the value, atomically on the
server.

Errors of your own Redis client (connection refused, a timeout) pass
through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from celery_leases.errors import LeaseConfigurationError
from celery_leases.fencing import (
    FenceResult,
    FencingToken,
    OnRepeat,
    Token,
    check_on_repeat,
    check_resource,
    check_token,
    stale_token_error,
)
from celery_leases.stores.checks import MAX_GENERATION
from celery_leases.values import as_text, is_number, is_whole

try:
    import redis
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "celery_leases.fencing.redis needs redis-py: pip install 'celery-leases[redis]'",
        name=exc.name,
    ) from exc

__all__ = ["DEFAULT_PREFIX", "RedisFence", "fence_key"]

DEFAULT_PREFIX = "celery_leases:"

Value = str | bytes | int | float

# --- Lua scripts -----------------------------------------------------------
#
# Every script starts with the same fence check.
#   KEYS[1]  the fence hash
#   ARGV[1]  job_id of the token
#   ARGV[2]  generation of the token (decimal integer)
#   ARGV[3]  on_repeat: 'apply' | 'refuse' | 'accept'
# and answers with one of
#   {1, previous, extra}    written; previous = generation accepted before
#                           ('' if none); extra = the XADD entry id, or ''
#   {0, accepted, job}      a repeat accepted as a no-op (on_repeat 'accept')
#   {-1, accepted, job}     refused: older than the accepted generation, a
#                           refused repeat, or the same generation of another
#                           job. Nothing was written.
_FENCE_CHECK = """
local fence = KEYS[1]
local job, generation, on_repeat = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local f = redis.call('HMGET', fence, 'job_id', 'generation')
local previous = f[2] or ''
if f[2] then
  local accepted = tonumber(f[2])
  if generation < accepted or (generation == accepted and
      (job ~= f[1] or on_repeat == 'refuse')) then
    return {-1, f[2], f[1]}
  end
  if generation == accepted and on_repeat == 'accept' then
    return {0, f[2], f[1]}
  end
end
redis.call('HSET', fence, 'job_id', job, 'generation', ARGV[2])
"""

#: Fence only (for a FenceChecker). KEYS[1] fence hash; ARGV[1..3] as above.
ADVANCE_SCRIPT = (
    _FENCE_CHECK
    + """
return {1, previous, ''}
"""
)

#: Fenced SET. KEYS[1] fence hash, KEYS[2] the key; ARGV[1..3] as above,
#: ARGV[4] the value, ARGV[5] expiry in ms or '' for none (the fence keeps none).
SET_SCRIPT = (
    _FENCE_CHECK
    + """
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
else
  redis.call('SET', KEYS[2], ARGV[4])
end
return {1, previous, ''}
"""
)

#: Fenced HSET. KEYS[1] fence hash, KEYS[2] the hash; ARGV[1..3] as above,
#: ARGV[4..] field, value, field, value, ... (one HSET per pair: no unpack
#: limit on large mappings).
HSET_SCRIPT = (
    _FENCE_CHECK
    + """
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return {1, previous, ''}
"""
)

#: Fenced XADD with an automatic id. KEYS[1] fence hash, KEYS[2] the stream;
#: ARGV[1..3] as above, ARGV[4] approximate MAXLEN or '' for none,
#: ARGV[5..] field, value, ... Returns the new entry id as extra.
XADD_SCRIPT = (
    _FENCE_CHECK
    + """
local args = {'XADD', KEYS[2]}
if ARGV[4] ~= '' then
  table.insert(args, 'MAXLEN')
  table.insert(args, '~')
  table.insert(args, ARGV[4])
end
table.insert(args, '*')
for i = 5, #ARGV do
  table.insert(args, ARGV[i])
end
local id = redis.call(unpack(args))
return {1, previous, id}
"""
)


def _hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag of ``key``, or ``None`` when it has none."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def fence_key(key: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The fence hash of ``key``; it lies in the same Cluster slot as ``key``.

    Raises:
        LeaseConfigurationError: ``key`` has no hash tag but contains ``}``
            (no fence name can share its slot), or ``prefix`` contains a brace.
    """
    key = check_resource(key)
    if "{" in prefix or "}" in prefix:
        raise LeaseConfigurationError(f"the fence prefix must not contain braces: {prefix!r}")
    tag = _hash_tag(key)
    if tag is not None:
        return f"{prefix}fence:{{{tag}}}:{key}"
    if "}" in key:
        raise LeaseConfigurationError(
            f"key {key!r} contains '}}' but no hash tag, so no fence key can share its "
            "Cluster slot; give it a hash tag, for example {account-42}:balance"
        )
    return f"{prefix}fence:{{{key}}}"


def _check_expiry(ex: object) -> str:
    if ex is None:
        return ""
    if not is_number(ex) or not math.isfinite(ex) or ex <= 0:
        raise LeaseConfigurationError(f"ex must be a positive number of seconds, got {ex!r}")
    return str(max(1, round(ex * 1000)))


def _pairs(mapping: Mapping[str, Value], what: str) -> list[Value]:
    if not mapping:
        raise LeaseConfigurationError(f"a fenced {what} needs at least one field")
    flat: list[Value] = []
    for field, value in mapping.items():
        flat.extend((field, value))
    return flat


class RedisFence:
    """Fenced writes to the keys of one Redis database.

    Args:
        client: a ``redis.Redis`` client (``decode_responses`` either way).
        prefix: prefix of the fence hashes; no braces.
        on_repeat: the default for writes that repeat the accepted
            generation (see :data:`~celery_leases.fencing.OnRepeat`).

    Each method raises :class:`~celery_leases.errors.StaleFencingToken`
    (with ``accepted``) when the token is older than the one accepted for
    the key; nothing is written then.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        on_repeat: OnRepeat = "apply",
    ) -> None:
        fence_key("x", prefix)  # check the prefix once, here
        self.client = client
        self.prefix = prefix
        self.on_repeat = check_on_repeat(on_repeat)
        self._advance = client.register_script(ADVANCE_SCRIPT)
        self._set = client.register_script(SET_SCRIPT)
        self._hset = client.register_script(HSET_SCRIPT)
        self._xadd = client.register_script(XADD_SCRIPT)

    def fence_key(self, key: str) -> str:
        """The fence hash of ``key`` (see :func:`fence_key`)."""
        return fence_key(key, self.prefix)

    def _run(
        self,
        script: Any,
        key: str,
        value_key: str | None,
        token: FencingToken,
        on_repeat: OnRepeat | None,
        args: Sequence[Value],
    ) -> FenceResult:
        job_id, generation = check_token(token)
        if generation > MAX_GENERATION:  # Lua numbers are doubles
            raise LeaseConfigurationError(
                f"generation {generation} is too large for a Redis fence (limit 2**53)",
                job_id=job_id,
                generation=generation,
            )
        mode = self.on_repeat if on_repeat is None else check_on_repeat(on_repeat)
        keys = [self.fence_key(key)] if value_key is None else [self.fence_key(key), value_key]
        reply = script(keys=keys, args=[job_id, str(generation), mode, *args])
        code = int(reply[0])
        known = as_text(reply[1])
        if code == 1:
            previous = int(known) if known else None
            entry_id = as_text(reply[2]) or None
            return FenceResult(key, job_id, generation, True, previous, entry_id=entry_id)
        if code == 0:
            return FenceResult(key, job_id, generation, False, int(known))
        raise stale_token_error(
            key, job_id, generation, accepted=int(known), accepted_job=as_text(reply[2])
        )

    def set(
        self,
        key: str,
        value: Value,
        token: FencingToken,
        *,
        ex: float | None = None,
        on_repeat: OnRepeat | None = None,
    ) -> FenceResult:
        """``SET key value [PX ex]`` if ``token`` may write ``key``.

        Args:
            key: the key; it is also the fenced resource.
            value: the value.
            token: the lease (or any ``FencingToken``).
            ex: expiry of the value in seconds; the fence never expires.
            on_repeat: overrides the default for this write.

        Returns:
            The :class:`~celery_leases.fencing.FenceResult`, with
            ``previous`` (the generation accepted before, if any).

        Raises:
            StaleFencingToken: the token is stale; the value is unchanged.
        """
        return self._run(self._set, key, key, token, on_repeat, [value, _check_expiry(ex)])

    def hset(
        self,
        key: str,
        mapping: Mapping[str, Value],
        token: FencingToken,
        *,
        on_repeat: OnRepeat | None = None,
    ) -> FenceResult:
        """``HSET key field value ...`` if ``token`` may write ``key``.

        Raises:
            StaleFencingToken: the token is stale; the hash is unchanged.
        """
        return self._run(self._hset, key, key, token, on_repeat, _pairs(mapping, "HSET"))

    def xadd(
        self,
        stream: str,
        fields: Mapping[str, Value],
        token: FencingToken,
        *,
        maxlen: int | None = None,
        on_repeat: OnRepeat | None = None,
    ) -> FenceResult:
        """``XADD stream [MAXLEN ~ n] * field value ...`` if ``token`` may write.

        The stream then holds only entries of non-decreasing generations.

        Returns:
            The result, with the new entry's id in ``entry_id``.

        Raises:
            StaleFencingToken: the token is stale; nothing was appended.
        """
        if maxlen is not None and not is_whole(maxlen, 1):
            raise LeaseConfigurationError(f"maxlen must be a positive integer, got {maxlen!r}")
        args: list[Value] = ["" if maxlen is None else str(maxlen), *_pairs(fields, "XADD")]
        return self._run(self._xadd, stream, stream, token, on_repeat, args)

    def advance(
        self, resource: str, token: FencingToken, *, on_repeat: OnRepeat = "apply"
    ) -> FenceResult:
        """Move the fence of ``resource`` alone (a ``FenceStorage`` for checkers).

        Raises:
            StaleFencingToken: the token is stale.
        """
        return self._run(self._advance, resource, None, token, on_repeat, [])

    def accepted(self, key: str) -> Token | None:
        """The token last accepted for ``key`` (without owner), or ``None``."""
        job_id, generation = self.client.hmget(self.fence_key(key), ["job_id", "generation"])
        if generation is None:
            return None
        return Token(as_text(job_id), int(as_text(generation)))
