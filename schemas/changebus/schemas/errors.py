"""One exception tree for every changebus component.

Every error raised on purpose by changebus derives from :class:`ChangebusError`.
Callers decide what to do from *data*, not from type checks scattered around:

* ``retriable`` -- trying the same operation again later may succeed (a relay
  restarting, a source that is briefly unreachable, a reader overtaken by the
  writer). ``False`` means the input or the configuration must change first.
* ``http_status`` -- the status a daemon answers with when the error reaches
  an HTTP boundary (400 for bad input, 404 for unknown things, ...).
* ``code`` -- a stable, machine-readable short name, sent in JSON error
  bodies (``{"error": code, "message": ..., "retriable": ...}``).

The way back is :meth:`ChangebusError.from_json`: a client turns an error
body into the exception of the same ``code`` (with the server's
``retriable`` verdict and details), so both ends agree on what an answer
means without a hand-written table per caller. Every class that defines its
own ``code`` and keeps the base constructor is registered for it.

Tree::

    ChangebusError
    +-- ConfigError                  bad or missing configuration
    +-- ProtocolError                the wire contract was broken
    |   +-- CorruptEventError        checksum / length / magic mismatch
    |   +-- CheckpointError          a checkpoint that cannot be parsed or used
    |   +-- BadRequestError          malformed request parameters
    +-- SchemaError                  Avro schema problems
    |   +-- UnknownSchemaError       no schema with that id / version
    |   +-- IncompatibleSchemaError  reader cannot read writer's data
    |   +-- SchemaChangedError       a stream stopped at a table's new schema
    |       |                        version (retriable: restart to continue)
    |       +-- SchemaChangeRefusedError  a dropped / retyped column that no
    |                                option allows (also an IncompatibleSchemaError)
    +-- UnknownSourceError           a source / partition nobody serves
    +-- AuthError                    the request is not allowed (not retriable)
    |   +-- UnauthorizedError        no or unknown credentials (401)
    |   +-- ForbiddenError           a known principal asked for more than granted (403)
    +-- NotYetError                  the server cannot answer this yet (retriable)
    +-- BootstrapFailedError         a bootstrap server cannot bring a consumer up to date
    +-- EventTooLargeError           an event or window over a configured limit
    +-- ScnNotFoundError             checkpoint older than what is kept (retriable
    |                                through another server, e.g. bootstrap)
    +-- OverwrittenError             a reader was overtaken by the writer (retriable)
    +-- DataLossError                a known gap in the change stream
    +-- SourceError                  the source database misbehaves (retriable)
    |   +-- SourceConfigError        the source's settings forbid capture
    +-- TransportError               network / HTTP failure talking to a peer
                                     (retriable; also an ``OSError``)

The classes are plain exceptions; they carry no references to live objects
and are safe to pickle (they cross process boundaries in the fetchers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "AuthError",
    "BadRequestError",
    "BootstrapFailedError",
    "ChangebusError",
    "CheckpointError",
    "ConfigError",
    "CorruptEventError",
    "DataLossError",
    "EventTooLargeError",
    "ForbiddenError",
    "IncompatibleSchemaError",
    "NotYetError",
    "OverwrittenError",
    "ProtocolError",
    "SchemaChangeRefusedError",
    "SchemaChangedError",
    "SchemaError",
    "ScnNotFoundError",
    "SourceConfigError",
    "SourceError",
    "StoreUnavailableError",
    "TransportError",
    "UnauthorizedError",
    "UnknownSchemaError",
    "UnknownSourceError",
]


class ChangebusError(Exception):
    """Root of every changebus error.

    ``retriable`` and ``http_status`` are class-level defaults; an instance may
    override ``retriable`` through the keyword argument of the same name.
    """

    retriable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, retriable: bool | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        if retriable is not None:
            # Instance attribute shadows the ClassVar default on purpose.
            self.__dict__["retriable"] = retriable
        self.details: dict[str, Any] = details

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        # registered for from_json: a class of its own code, built like the base class
        if "code" in cls.__dict__ and cls.__init__ is ChangebusError.__init__:
            _BY_CODE.setdefault(cls.code, cls)

    @classmethod
    def from_json(
        cls, body: Mapping[str, Any], *, status: int | None = None, where: str = ""
    ) -> ChangebusError:
        """The exception an error body (:meth:`to_json`) stands for.

        The class is chosen by ``body["error"]`` (the ``code``); an unknown or
        missing code falls back on the HTTP ``status`` (400 bad request, 404
        unknown source, 409 overwritten, 410 SCN not found, 413 too large,
        408, 429 and 5xx transport), else :class:`ChangebusError`. The server's
        ``retriable`` verdict is kept when it is a boolean; the other keys
        become ``details``. ``where`` (e.g. ``"relay http://h:8470"``) is put
        in front of the message. Never raises.
        """
        code = body.get("error")
        found = _BY_CODE.get(code) if isinstance(code, str) else None
        if found is None:
            found = _BY_STATUS.get(status or 0)
            if found is None:
                found = TransportError if (status or 0) >= 500 else ChangebusError
        message = str(body.get("message") or "")
        if not message:
            message = f"answered {status}" if status else "failed"
        if where:
            message = f"{where}: {message}"
        retriable = body.get("retriable")
        exc = found(message, retriable=retriable if isinstance(retriable, bool) else None)
        # (not as keyword arguments: a body's key such as "self" would clash)
        exc.details.update(
            (str(k), v) for k, v in body.items() if k not in ("error", "message", "retriable")
        )
        return exc

    def to_json(self) -> dict[str, Any]:
        """The JSON body a daemon sends for this error (never holds secrets)."""
        body: dict[str, Any] = {
            "error": self.code,
            "message": self.message,
            "retriable": self.retriable,
        }
        body.update(self.details)
        return body

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.__dict__.get("retriable"), self.details))


_BY_CODE: dict[str, type[ChangebusError]] = {"internal": ChangebusError}


def _rebuild(
    cls: type[ChangebusError], message: str, retriable: bool | None, details: dict[str, Any]
) -> ChangebusError:
    return cls(message, retriable=retriable, **details)


class ConfigError(ChangebusError):
    """The configuration is invalid; the message names the key and the fix."""

    code = "config"


class ProtocolError(ChangebusError):
    """A peer broke the wire contract."""

    http_status = 400
    code = "protocol"


class CorruptEventError(ProtocolError):
    """An event failed validation (magic, version, length or checksum)."""

    http_status = 500
    code = "corrupt_event"


class CheckpointError(ProtocolError):
    """A checkpoint could not be parsed, or is inconsistent."""

    code = "bad_checkpoint"


class BadRequestError(ProtocolError):
    """Malformed request parameters."""

    code = "bad_request"


class SchemaError(ChangebusError):
    """A problem with Avro schemas."""

    code = "schema"


class UnknownSchemaError(SchemaError):
    """No schema is registered under the requested id or version."""

    http_status = 404
    code = "unknown_schema"


class IncompatibleSchemaError(SchemaError):
    """A reader schema cannot read data written with a writer schema."""

    code = "incompatible_schema"


class SchemaChangedError(SchemaError):
    """A stream reached a table's new schema version and stopped before its first row.

    Retriable: the reader keeps the new schema (the Spark source in its schema
    tracking location), so starting the same query again continues with it.
    ``details`` name the table, the old and new versions and the columns
    added, dropped and retyped.
    """

    retriable = True
    code = "schema_changed"


class SchemaChangeRefusedError(SchemaChangedError, IncompatibleSchemaError):
    """A schema change that drops or retypes columns, which no option allows.

    Not retriable as it is: the query must allow the change explicitly
    (the Spark source's ``allowSchemaChanges``) or start afresh.
    """

    retriable = False
    code = "schema_change_refused"


class UnknownSourceError(ChangebusError):
    """A source or physical partition that this server does not serve."""

    http_status = 404
    code = "unknown_source"


class AuthError(ChangebusError):
    """The server refuses the request for who sent it (or for not saying who)."""

    http_status = 403
    code = "auth"


class UnauthorizedError(AuthError):
    """No credentials, or credentials the server does not know (HTTP 401)."""

    http_status = 401
    code = "unauthorized"


class ForbiddenError(AuthError):
    """A known principal asked for a partition, source or scope it was not granted (403)."""

    http_status = 403
    code = "forbidden"


class NotYetError(ChangebusError):
    """The server cannot answer this yet (its applier or producer is behind); retry soon."""

    retriable = True
    http_status = 503
    code = "not_yet"


class BootstrapFailedError(ChangebusError):
    """A bootstrap server cannot bring this consumer up to date (e.g. its history is too short)."""

    http_status = 410
    code = "bootstrap_failed"


class EventTooLargeError(ChangebusError):
    """An event or a transaction window is over a configured size limit."""

    http_status = 413
    code = "too_large"


class ScnNotFoundError(ChangebusError):
    """The requested SCN is older than the oldest one kept.

    ``details`` carries ``oldest_scn`` (and ``prev_scn``): the consumer must
    catch up elsewhere (the bootstrap server) before it can come back.
    """

    retriable = True
    http_status = 410
    code = "scn_not_found"


class OverwrittenError(ChangebusError):
    """A reader's range was overwritten by the writer while it was read."""

    retriable = True
    http_status = 409
    code = "overwritten"


class DataLossError(ChangebusError):
    """A range of SCNs is known to be missing (purged binlog, lost slot, ...)."""

    http_status = 500
    code = "data_loss"


class FencedError(ChangebusError):
    """A write for a work unit this member no longer owns was refused.

    Another member of the consumer group claimed the unit since (see
    :class:`~changebus.schemas.UnitStore`); ``units`` names the refused
    units in their text form (``<partition>.<bucket>``).
    """

    http_status = 409
    code = "fenced"

    def __init__(self, message: str, *, units: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        #: the refused units (text form)
        self.units = units


class SourceError(ChangebusError):
    """The source database failed or went away; usually temporary."""

    retriable = True
    http_status = 503
    code = "source"


class SourceConfigError(SourceError):
    """The source's settings forbid capture (e.g. ``wal_level`` is not logical)."""

    retriable = False
    code = "source_config"


class StoreUnavailableError(ChangebusError):
    """A daemon's own database (the bootstrap store) lost its connection; it reconnects."""

    retriable = True
    http_status = 503
    code = "store_unavailable"


class TransportError(ChangebusError, OSError):
    """A network or HTTP failure while talking to a peer."""

    retriable = True
    http_status = 502
    code = "transport"


_BY_STATUS: dict[int, type[ChangebusError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: UnknownSourceError,
    409: OverwrittenError,
    410: ScnNotFoundError,
    413: EventTooLargeError,
    # a proxy's or load balancer's "slow down" / "too slow": try again (or elsewhere)
    408: TransportError,
    429: TransportError,
}
