"""Consumer configuration: one frozen, validated dataclass.

Units: durations are float seconds (``_s``), sizes are bytes (``_bytes``),
counts are plain ints. Every value is checked once, in ``__post_init__``;
a bad one raises :class:`~changebus.schemas.ConfigError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from changebus.schemas import (
    MAX_BUCKETS,
    ChangebusError,
    ConfigError,
    PartitionFilter,
    TableSchema,
    Unit,
    check_group_name,
    parse_scn,
)
from changebus.schemas.config import url_without_user
from changebus.schemas.security import ClientAuth

from ._assembler import DEFAULT_MAX_WINDOW_BYTES

__all__ = ["ConsumerConfig"]


@dataclass(frozen=True)
class ConsumerConfig:
    """How a :class:`~changebus.client.Consumer` reads one physical partition.

    Subscription:

    * ``relays`` -- base URLs of relays serving the same partition, tried in
      order; on failure the consumer moves to the next (failover), and after
      a full round of failures waits (exponential backoff with jitter from
      ``backoff_initial_s`` up to ``backoff_max_s``). ``max_attempts``
      consecutive failed requests (0: never give up) raise
      :class:`~changebus.client.RelayUnavailableError`.
    * ``zookeeper`` and ``cluster`` -- instead of (or besides) ``relays``: a
      ZooKeeper connect string and a cluster name. The consumer reads the
      relays serving ``partition`` (required then) from the cluster's
      routing table, the leader first (``prefer_followers``: the followers
      first), and follows the table's changes without a restart (see
      :mod:`._cluster`). Static ``relays`` given as well come after the
      table's. While nobody serves the partition the consumer waits
      (``max_attempts`` bounds the wait as it bounds failed requests).
      Bootstrap servers registered in the cluster are used when
      ``bootstrap_servers`` is empty. ``zookeeper_session_timeout_s`` is the
      consumer's ZooKeeper session timeout.
    * ``partition`` -- the physical partition (buffer) name; may be omitted
      when the relay has exactly one.
    * ``sources`` -- logical source names to receive (empty: all).
    * ``filter`` -- a partition filter on the key hash (``mod:3:0``,
      ``range:LO:HI``, ``slice:I/N``; text or a :class:`PartitionFilter`):
      consumers with disjoint filters share the stream between them.
    * ``start`` -- where to begin when the persister has no checkpoint:
      ``"earliest"`` (the oldest window a relay keeps), ``"latest"`` (only
      windows committed from now on) or an SCN (decimal, ``X/Y`` or
      ``file:pos``): the windows *after* it. A stored checkpoint always wins.

    Transfer: ``follow`` keeps one response open and lets the relay push
    windows as they commit (otherwise long-poll requests); ``wait_s`` is how
    long the relay holds a request (or an idle follow response) with nothing
    new; ``max_bytes`` bounds one response or push and ``follow_bytes`` one
    follow response. ``max_window_bytes`` bounds what the consumer holds of
    one answer, window, event or bootstrap page: a server sending more (a
    broken or hostile one) stops the consumer with a non-retriable
    :class:`~changebus.schemas.ProtocolError` instead of growing its memory;
    raise it for transactions larger than 512 MiB. A connection silent for ``wait_s + read_margin_s``
    counts as broken. ``until_scn`` makes a bounded read: once a relay window
    at or past that SCN is queued the consumer fetches nothing more, and the
    iterator ends after yielding it, ``run(callbacks)`` returns after
    dispatching it (a Spark task reading an SCN range). A bootstrap's catch-up
    stops at ``until_scn`` too; its snapshot holds rows as of the snapshot's
    own SCN, which may be later.

    Flow control: at most ``queue_windows`` windows and about ``queue_bytes``
    bytes wait between fetching and processing; beyond that the consumer
    stops reading from the relay (TCP back-pressure).

    Delivery: ``on_data_loss`` -- ``"raise"``
    (:class:`~changebus.client.DataLossDetectedError`) or ``"deliver"`` (a
    window with ``data_loss`` set); ``yield_empty_windows`` -- whether the
    iterator yields windows with nothing in them (their position is always
    checkpointed); ``auto_commit`` -- the iterator persists the checkpoint
    past a window when the next one is asked for (otherwise call
    :meth:`~changebus.client.Consumer.commit`). Schemas: ``reader_schemas`` maps a source name to the
    schema the application reads its rows as; ``resolve_latest`` reads every
    other source as its newest known version (a version that cannot be read
    as it, a column's type changed incompatibly, comes in its own shape, with a
    warning); ``refuse_newer_writers`` -- a
    row of a version newer than its reader schema whose columns differ
    raises the retriable :class:`~changebus.schemas.SchemaChangedError`
    instead of being read into the reader's shape, which drops the new
    columns (a reader whose schema is fixed: the Spark source). ``columnar`` leaves the data
    events of relay windows undecoded (``Window.raw_events``, for a columnar
    decoder such as :func:`changebus.client.spark.arrow_batches`; ``events``
    is then empty).

    Bootstrap: ``bootstrap_servers`` -- base URLs of bootstrap servers (tried
    in order, failover with the same backoff). When every relay answers that
    the position is older than it keeps (HTTP 410), or when the consumer
    starts with no checkpoint and ``start = "earliest"``, the consumer reads a
    snapshot then the catch-up log from a bootstrap server and returns to the
    relays at the catch-up target; windows say so (``Window.phase``) and the
    checkpoint holds the bootstrap progress (a restart resumes it).
    ``bootstrap_page_bytes`` bounds one snapshot or catch-up page.
    ``bootstrap_catchup_only`` never takes a snapshot: the bootstrap server
    replays its log's windows after the position as they are (a reader that
    must see each window exactly once, such as a Spark task reading an SCN
    sub-range), and a position its log no longer reaches raises
    :class:`~changebus.schemas.ScnNotFoundError`. Without
    bootstrap servers a consumer that fell off raises
    :class:`~changebus.client.FellOffRelayError`, unless ``on_fell_off =
    "latest"``: it then jumps to the relay's newest SCN, skipping the changes
    in between (an explicit choice of the application).

    Security: ``auth`` (a :class:`~changebus.schemas.security.ClientAuth`)
    is used for every relay and bootstrap server connection: CA file, client
    certificate, host name check and bearer token. A 401 or 403 answer
    (:class:`~changebus.schemas.UnauthorizedError`,
    :class:`~changebus.schemas.ForbiddenError`) and a TLS handshake that
    fails verification stop the consumer at once (not retriable).

    Consumer groups: ``group`` (a name) with ``zookeeper`` makes this
    consumer a member of a group that shares ``partitions`` (default: the
    one ``partition``) between its members: each partition is cut into
    ``buckets`` key buckets (the relay's mod filter), and each (partition,
    bucket) unit is owned by one member at a time, with its own fenced
    checkpoint (see :class:`~changebus.client.Consumer` and its engine,
    ``changebus.client._group``). ``member_name`` labels
    this member in ``changebus group status`` (default ``host:pid``);
    ``commit_interval_s`` is how often at most a unit's checkpoint is written
    to the store (and always when a unit is revoked or the consumer closes).
    In group mode ``cluster`` is optional: without it ``relays`` are static.

    Callbacks: each call has ``callback_time_budget_s``; a recoverable error
    rolls back and replays the windows since the last checkpoint, at most
    ``max_rollbacks`` times in a row (-1: no limit), ``rollback_backoff_s``
    apart (doubling); the checkpoint is taken every
    ``checkpoint_every_windows`` windows. The windows kept for such a replay
    (those since the last checkpoint stored) hold at most
    ``max_replay_bytes`` (0: twice ``max_window_bytes``, 1 GiB by default):
    past it (``on_checkpoint`` returning
    ``SKIP_CHECKPOINT`` for too long) the consumer stops with
    :class:`~changebus.client.ConsumerAbortedError` rather than grow.
    """

    relays: tuple[str, ...] = ()
    partition: str | None = None
    sources: tuple[str, ...] = ()
    filter: PartitionFilter | str | None = None
    start: str = "earliest"
    client_id: str = ""
    follow: bool = True
    wait_s: float = 10.0
    max_bytes: int = 1 << 20
    follow_bytes: int = 64 << 20
    max_window_bytes: int = DEFAULT_MAX_WINDOW_BYTES
    until_scn: int | None = None
    queue_windows: int = 256
    queue_bytes: int = 16 << 20
    connect_timeout_s: float = 5.0
    read_margin_s: float = 10.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    backoff_multiplier: float = 2.0
    max_attempts: int = 0
    on_data_loss: Literal["raise", "deliver"] = "raise"
    yield_empty_windows: bool = False
    auto_commit: bool = True
    reader_schemas: Mapping[str, TableSchema] = field(default_factory=dict, hash=False)
    resolve_latest: bool = False
    refuse_newer_writers: bool = False
    columnar: bool = False
    callback_time_budget_s: float = 300.0
    max_rollbacks: int = 10
    rollback_backoff_s: float = 0.05
    checkpoint_every_windows: int = 1
    max_replay_bytes: int = 0
    bootstrap_servers: tuple[str, ...] = ()
    bootstrap_page_bytes: int = 1 << 20
    bootstrap_catchup_only: bool = False
    on_fell_off: Literal["raise", "latest"] = "raise"
    zookeeper: str = ""
    cluster: str = ""
    prefer_followers: bool = False
    zookeeper_session_timeout_s: float = 10.0
    auth: ClientAuth = field(default_factory=ClientAuth)
    group: str = ""
    partitions: tuple[str, ...] = ()
    buckets: int = 64
    member_name: str = ""
    commit_interval_s: float = 1.0

    def __post_init__(self) -> None:
        relays: object = self.relays
        if isinstance(relays, str):
            relays = (relays,)
        self._check_group()
        if self.columnar and self.group:
            # (a group splits windows by their decoded events: with none, every unit's
            # position moved on and nothing was delivered; review)
            raise ConfigError("columnar reads windows undecoded: not in a group")
        if self.group and not self.cluster.strip():
            pass  # a group reads static relays when no cluster is named
        elif bool(self.zookeeper.strip()) != bool(self.cluster.strip()):
            raise ConfigError(
                "zookeeper and cluster go together: give the ZooKeeper connect string"
                " (host:port[,host:port]) and the cluster name, or neither"
            )
        if self.zookeeper.strip():
            if not self.partition and not self.group:
                raise ConfigError("partition: name the partition to read when using zookeeper")
            if not 0.2 <= self.zookeeper_session_timeout_s <= 600:
                raise ConfigError("zookeeper_session_timeout_s must be within 0.2..600 s")
        elif not isinstance(relays, tuple | list) or not relays:
            raise ConfigError(
                "relays: give at least one relay URL, or zookeeper and cluster"
                " to read them from a cluster's routing table"
            )
        if not isinstance(relays, tuple | list):
            raise ConfigError("relays: give a list of relay URLs")
        cleaned = []
        for url in relays:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"relays: {url_without_user(url)!r} is not an http:// or https:// URL"
                )
            cleaned.append(url.rstrip("/"))
        object.__setattr__(self, "relays", tuple(cleaned))
        if self.group and not self.cluster.strip() and not cleaned:
            raise ConfigError(
                f"group {self.group!r}: give the relays (or a cluster to find them in)"
            )
        servers: object = self.bootstrap_servers
        if isinstance(servers, str):
            servers = (servers,)
        if not isinstance(servers, tuple | list):
            raise ConfigError("bootstrap_servers: give a list of URLs")
        for url in servers:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"bootstrap_servers: {url_without_user(url)!r} is not an http:// or"
                    " https:// URL"
                )
        object.__setattr__(self, "bootstrap_servers", tuple(u.rstrip("/") for u in servers))
        if self.on_fell_off not in ("raise", "latest"):
            raise ConfigError("on_fell_off must be 'raise' or 'latest'")
        object.__setattr__(self, "sources", tuple(self.sources))
        if any(not s or "," in s for s in self.sources):
            raise ConfigError(f"sources: bad source name in {list(self.sources)}")
        if isinstance(self.filter, str):
            try:
                object.__setattr__(self, "filter", PartitionFilter.parse(self.filter))
            except ChangebusError as exc:
                raise ConfigError(f"filter: {exc.message}") from None
        if self.start not in ("earliest", "latest"):
            try:
                parse_scn(self.start)
            except ChangebusError:
                raise ConfigError(
                    f"start must be earliest, latest or an SCN, got {self.start!r}"
                ) from None
        for name in ("wait_s", "connect_timeout_s", "read_margin_s", "rollback_backoff_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s or self.backoff_multiplier < 1:
            raise ConfigError(
                "backoff: need 0 < backoff_initial_s <= backoff_max_s and backoff_multiplier >= 1"
            )
        for name in (
            "max_bytes",
            "follow_bytes",
            "queue_windows",
            "queue_bytes",
            "bootstrap_page_bytes",
            "max_window_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if 0 < self.max_replay_bytes < self.max_window_bytes or self.max_replay_bytes < 0:
            raise ConfigError(
                f"max_replay_bytes ({self.max_replay_bytes}) must be 0 (twice max_window_bytes)"
                f" or at least max_window_bytes ({self.max_window_bytes}): one window is always"
                " kept until its checkpoint"
            )
        if self.max_bytes > self.max_window_bytes:
            raise ConfigError(
                f"max_bytes ({self.max_bytes}) must not pass max_window_bytes "
                f"({self.max_window_bytes}): an answer of max_bytes would be refused"
            )
        if self.max_attempts < 0 or self.max_rollbacks < -1:
            raise ConfigError("max_attempts must be >= 0 and max_rollbacks >= -1")
        if self.callback_time_budget_s <= 0 or self.checkpoint_every_windows < 1:
            raise ConfigError("callback_time_budget_s must be > 0, checkpoint_every_windows >= 1")
        if self.until_scn is not None and self.until_scn < -1:
            raise ConfigError("until_scn must be >= -1")
        if self.on_data_loss not in ("raise", "deliver"):
            raise ConfigError("on_data_loss must be 'raise' or 'deliver'")
        readers: dict[str, object] = dict(self.reader_schemas)
        for name, schema in readers.items():
            if not isinstance(schema, TableSchema) or schema.name != name:
                raise ConfigError(f"reader_schemas[{name!r}] must be a TableSchema named {name!r}")
        object.__setattr__(self, "reader_schemas", MappingProxyType(readers))
        if not isinstance(self.auth, ClientAuth):
            raise ConfigError("auth must be a changebus.schemas.security.ClientAuth")

    def _check_group(self) -> None:
        parts: object = self.partitions
        if isinstance(parts, str):
            parts = (parts,)
        if not isinstance(parts, tuple | list):
            raise ConfigError("partitions: give a list of partition names")
        object.__setattr__(self, "partitions", tuple(parts))
        if not self.group:
            if self.partitions:
                raise ConfigError("partitions: only a consumer group (group=...) reads several")
            return
        check_group_name(self.group)
        if not self.zookeeper.strip():
            raise ConfigError(f"group {self.group!r}: a consumer group needs zookeeper")
        if not self.partitions:
            if not self.partition:
                raise ConfigError(
                    f"group {self.group!r}: name the partitions to share (partitions or partition)"
                )
            object.__setattr__(self, "partitions", (self.partition,))
        elif self.partition and self.partition not in self.partitions:
            raise ConfigError("partition: must be one of partitions in a group")
        if len(set(self.partitions)) != len(self.partitions):
            raise ConfigError("partitions: a partition is named twice")
        for name in self.partitions:
            try:
                Unit(name, 0)
            except ConfigError:
                raise ConfigError(f"partitions: {name!r} is not a partition name") from None
        if not 1 <= self.buckets <= MAX_BUCKETS:
            raise ConfigError(f"buckets must be within 1..{MAX_BUCKETS}, got {self.buckets}")
        if self.filter is not None:
            raise ConfigError("filter: a consumer group chooses the key buckets itself")
        if not 0 <= self.commit_interval_s <= 3600:
            raise ConfigError("commit_interval_s must be within 0..3600 s")
        if "/" in self.member_name or len(self.member_name) > 128:
            raise ConfigError("member_name: at most 128 characters, no '/'")

    @property
    def key_filter(self) -> PartitionFilter | None:
        """The partition filter, parsed (``filter`` as given may be text)."""
        f = self.filter
        return f if isinstance(f, PartitionFilter) else None

    @property
    def start_scn(self) -> int | None:
        """The SCN of ``start``, or None for ``earliest`` / ``latest``."""
        if self.start in ("earliest", "latest"):
            return None
        return parse_scn(self.start)

    @property
    def uses_cluster(self) -> bool:
        """Whether the relays come from a cluster's routing table (``zookeeper``)."""
        return bool(self.zookeeper.strip())
