"""changebus.client: the consumer library.

Reads one physical partition from one or more relays (failover with
backoff), validates and decodes every event, and hands the application whole
transactions (:class:`Window` of :class:`ChangeEvent`) in commit order:

* iterator API -- ``async for window in Consumer(config)``, or
  ``for window in SyncConsumer(config)`` without asyncio;
* callback API (after Databus) -- :class:`Callbacks` / :class:`AsyncCallbacks`
  with rollback and replay on recoverable errors;
* checkpoints -- persisted after each processed window through a
  :class:`CheckpointPersister` (:class:`FileCheckpointPersister` replaces a
  file atomically); delivery is at-least-once;
* replicas -- :class:`SqliteReplica` / :class:`PostgresReplica` apply a
  stream to tables of another database with idempotent upserts and the
  checkpoint in the same transaction (effectively-once);
* consumer groups -- ``ConsumerConfig(group=..., zookeeper=...)`` makes a
  :class:`Consumer` (or :class:`SyncConsumer`) a member of a group on
  ZooKeeper sharing partitions cut into key buckets (work units,
  :class:`~changebus.schemas.Unit`): sticky, incremental rebalancing told to
  a :class:`RebalanceListener`, each unit's windows in SCN order
  (``Window.unit``), no order across units; the fenced unit checkpoints of a group
  (:class:`~changebus.schemas.UnitStore`) in files (:class:`FileUnitStore`,
  one host, ``flock``), a PostgreSQL table (:class:`PostgresUnitStore`) or,
  effectively-once, in a replica's own database: :class:`SqliteReplica` and
  :class:`PostgresReplica` are unit stores too and apply a unit's window and
  its fenced checkpoint in one transaction;
* ``changebus tail`` -- prints a stream as JSON lines.

Errors are part of the :mod:`changebus.schemas` tree: a position older than
the relays keep raises :class:`FellOffRelayError` (HTTP 410), a gap in the
stream :class:`DataLossDetectedError`, an unrecoverable callback
:class:`ConsumerAbortedError`.

Low level: :class:`RelayStream` reads a relay's stream as validated
:class:`RawWindow` objects into an async sink, with failover over several
relays (:class:`StreamConfig`); the consumer, the bootstrap server's
producer, the Spark source and relay chaining are built on it.
:class:`RelayInfo` asks one relay (or bootstrap server) its small JSON
questions -- status, sources, schemas, a bootstrap server's status -- as
typed answers (:class:`PartitionStatus`, :class:`PartitionSources` of
:class:`SourceInfo`, :class:`SourceSchemas`, :class:`BootstrapStatus`);
:class:`RelayQueries` asks a list of them in order with the same failover
(the first that answers, or every one that does). :class:`RelaySchemas`
looks up a relay's table schemas for a decoder; :func:`safe_url` strips
credentials from a URL for logs.

TLS and authentication: :class:`ClientAuth` (from
:mod:`changebus.schemas.security`; ``ConsumerConfig(auth=...)``) holds the
CA file, client certificate, host name check and bearer token;
:func:`open_session` opens the :class:`aiohttp.ClientSession` that every
changebus connection (consumer, relay chaining, bootstrap server) uses, and
:func:`pg_session_defaults` the libpq settings (TCP keepalives, ``tcp_user_timeout``)
its Postgres sessions take unless their DSN sets them.

With ``bootstrap_servers`` configured, a consumer that fell off the relays
(or starts from nothing) reads a snapshot and the catch-up log from a
bootstrap server and returns to the relays by itself (:mod:`._bootstrap`);
windows tell the application (``Window.phase``, ``Window.bootstrapping``).
"""

from changebus.schemas import BootstrapFailedError as BootstrapFailedError
from changebus.schemas.security import ClientAuth as ClientAuth

from ._apply import Replica as Replica
from ._apply_pg import PostgresReplica as PostgresReplica
from ._apply_sqlite import SqliteReplica as SqliteReplica
from ._assembler import RawWindow as RawWindow
from ._callbacks import (
    AsyncCallbacks as AsyncCallbacks,
    CallbackResult as CallbackResult,
    Callbacks as Callbacks,
)
from ._config import ConsumerConfig as ConsumerConfig
from ._consumer import Consumer as Consumer
from ._errors import (
    ConsumerAbortedError as ConsumerAbortedError,
    DataLossDetectedError as DataLossDetectedError,
    FellOffRelayError as FellOffRelayError,
    RelayUnavailableError as RelayUnavailableError,
)
from ._http import open_session as open_session, safe_url as safe_url
from ._info import (
    BootstrapStatus as BootstrapStatus,
    PartitionSources as PartitionSources,
    PartitionStatus as PartitionStatus,
    RelayInfo as RelayInfo,
    RelayQueries as RelayQueries,
    RelaySchemas as RelaySchemas,
    SourceInfo as SourceInfo,
    SourceSchemas as SourceSchemas,
)
from ._model import (
    ChangeEvent as ChangeEvent,
    ChangeOp as ChangeOp,
    RawEvents as RawEvents,
    Window as Window,
)
from ._persist import (
    CheckpointPersister as CheckpointPersister,
    FileCheckpointPersister as FileCheckpointPersister,
    MemoryCheckpointPersister as MemoryCheckpointPersister,
)
from ._pgsession import pg_session_defaults as pg_session_defaults
from ._rebalance import RebalanceListener as RebalanceListener
from ._stream import (
    RelayStream as RelayStream,
    ResponseCheck as ResponseCheck,
    StreamConfig as StreamConfig,
    StreamSink as StreamSink,
)
from ._sync import SyncConsumer as SyncConsumer
from ._unitstore_file import FileUnitStore as FileUnitStore
from ._unitstore_pg import PostgresUnitStore as PostgresUnitStore

__all__ = [
    "AsyncCallbacks",
    "BootstrapFailedError",
    "BootstrapStatus",
    "CallbackResult",
    "Callbacks",
    "ChangeEvent",
    "ChangeOp",
    "CheckpointPersister",
    "ClientAuth",
    "Consumer",
    "ConsumerAbortedError",
    "ConsumerConfig",
    "DataLossDetectedError",
    "FellOffRelayError",
    "FileCheckpointPersister",
    "FileUnitStore",
    "MemoryCheckpointPersister",
    "PartitionSources",
    "PartitionStatus",
    "PostgresReplica",
    "PostgresUnitStore",
    "RawEvents",
    "RawWindow",
    "RebalanceListener",
    "RelayInfo",
    "RelayQueries",
    "RelaySchemas",
    "RelayStream",
    "RelayUnavailableError",
    "Replica",
    "ResponseCheck",
    "SourceInfo",
    "SourceSchemas",
    "SqliteReplica",
    "StreamConfig",
    "StreamSink",
    "SyncConsumer",
    "Window",
    "open_session",
    "pg_session_defaults",
    "safe_url",
]
