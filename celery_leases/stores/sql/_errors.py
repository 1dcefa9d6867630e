"""Which driver errors of the SQL lease store are an outage, which a configuration.

Used by :mod:`celery_leases.stores.sql._store`.
"""

from __future__ import annotations

from sqlalchemy import exc

from celery_leases.errors import LeaseConfigurationError, LeaseError, StoreUnavailable
from celery_leases.values import is_whole

#: the driver errors a store call turns into a LeaseError
DRIVER_ERRORS = (exc.StatementError, exc.TimeoutError)

#: SQLSTATEs of an operational error that is a configuration, not an outage:
#: class 28 (invalid authorization), no such database, insufficient privilege
_PERMANENT_SQLSTATES = ("3D000", "42501")

#: MySQL's error numbers of a configuration: no rights on the database,
#: wrong password, unknown database, no rights on the table or a column,
#: a privilege missing, no such table or column
_PERMANENT_MYSQL_ERRORS = (1044, 1045, 1049, 1142, 1143, 1227, 1146, 1054)

#: MySQL's error number of a transaction InnoDB ended as a deadlock (rolled back)
MYSQL_DEADLOCK = 1213

#: what drivers say when they give no SQLSTATE (a failed connection attempt)
_PERMANENT_MESSAGES = (
    "password authentication failed",
    "no password supplied",
    "no pg_hba.conf entry",
    "does not exist",
    "permission denied",
    "no such table",
    "no such column",
    "has no column named",
    "readonly database",
)

FIX = (
    "This is not an outage and trying again will not help: check the user, "
    "password, database and rights in the store URL, and the lease table."
)


def permanent(error: BaseException) -> bool:
    """Whether a driver error is a refusal that trying again cannot change.

    Connection refused or reset, timeouts, a database shutting down or a
    SQLite file locked past the busy timeout are unavailability; credentials,
    rights, a missing database or table and a value the database refuses
    are configuration.
    """
    if isinstance(
        error, (exc.DataError, exc.ProgrammingError, exc.IntegrityError, exc.NotSupportedError)
    ):
        return True
    if not isinstance(error, exc.OperationalError):
        return False
    orig = getattr(error, "orig", None)
    return refused_for_good(orig if orig is not None else error)


def refused_for_good(error: BaseException) -> bool:
    """Whether a driver's operational error (``orig`` of SQLAlchemy's, the
    cause of a framework's) is a refusal that trying again cannot change:
    credentials, rights, a missing database or table."""
    number = mysql_error_number(error)
    if number is not None:
        return number in _PERMANENT_MYSQL_ERRORS
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate.startswith("28") or sqlstate in _PERMANENT_SQLSTATES
    text = str(error).lower()
    return any(message in text for message in _PERMANENT_MESSAGES)


def mysql_error_number(error: object) -> int | None:
    """MySQL's error number of a driver error (PyMySQL's are ``(errno, message)``), or None."""
    number = next(iter(getattr(error, "args", ())), None)
    return number if is_whole(number) else None


def reason(error: BaseException) -> str:
    """The first line of what the driver said."""
    orig = getattr(error, "orig", None)
    text = str(orig if orig is not None else error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def lost_connection(error: BaseException) -> bool:
    """Whether the call failed because its connection died (and was discarded)."""
    return isinstance(error, exc.DBAPIError) and error.connection_invalidated


def store_error(
    error: exc.StatementError | exc.TimeoutError,
    url: str,
    table_name: str,
    operation: str,
    job_id: str | None = None,
    owner: str | None = None,
    generation: int | None = None,
) -> LeaseError:
    """The LeaseError for a driver error of one operation: StoreUnavailable
    for an outage, LeaseConfigurationError for a refusal that trying again
    cannot change (or a value the driver could not send).

    Args:
        url: the store's URL, password masked.
    """
    where = f"{url} (table {table_name!r})"
    about = f" of job {job_id!r}" if job_id is not None else ""
    if isinstance(error, (exc.DBAPIError, exc.TimeoutError)):
        if permanent(error):
            return LeaseConfigurationError(
                f"SQL lease store {where} refused {operation}{about}: {reason(error)}. {FIX}",
                job_id=job_id,
                owner=owner,
                generation=generation,
            )
        return StoreUnavailable(
            f"SQL lease store {where} failed during {operation}{about}: {reason(error)}. "
            "Check that the database is running and reachable; the outcome is unknown.",
            job_id=job_id,
            owner=owner,
            generation=generation,
        )
    # a value the driver could not send (not a database error)
    return LeaseConfigurationError(
        f"SQL lease store {url} could not send {operation}{about}: {reason(error)}",
        job_id=job_id,
        owner=owner,
        generation=generation,
    )
