"""The Spark source's options: parsed once from Spark's option map, validated, frozen.

Spark hands a data source its ``.option(key, value)`` pairs as strings in a
case-insensitive map. :meth:`SourceOptions.parse` reads them into a frozen
dataclass (one unit per quantity: ``_s`` seconds, ``_bytes`` bytes) and
rejects unknown keys, so a typo such as ``maxRowPerTrigger`` fails the query
at once instead of being ignored. Nothing here imports pyspark: the module is
plain data and is pickled to the executors inside the reader.

Positions (``startingScn`` / ``endingScn``) are :data:`Position` values:
``"earliest"``, ``"latest"``, one SCN for every physical partition, or a JSON
object ``{"partition": scn, ...}`` naming them one by one (the same shape as
the source's offsets in Spark's checkpoint).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from changebus.schemas import ChangebusError, ConfigError, PartitionFilter, parse_scn
from changebus.schemas.config import url_without_user
from changebus.schemas.security import ClientAuth

from .._assembler import DEFAULT_MAX_WINDOW_BYTES

__all__ = [
    "OPTION_NAMES",
    "SCHEMA_CHANGE_KINDS",
    "AtTime",
    "Position",
    "SourceOptions",
    "parse_position",
]


@dataclass(frozen=True, slots=True)
class AtTime:
    """A position given as a commit time (``startingTimestamp`` / ``endingTimestamp``)."""

    time_ms: int


#: ``"earliest"`` / ``"latest"`` / one SCN / ``{partition: scn}`` / a commit time
Position = str | int | dict[str, int] | AtTime

#: every option the source accepts (lower case) -> what it means, for errors and docs
OPTION_NAMES: dict[str, str] = {
    "relays": "comma-separated relay base URLs serving the same partitions (failover order)",
    "zookeeper": "instead of relays: ZooKeeper connect string of a relay cluster (with cluster)",
    "cluster": "the relay cluster's name: relays (and bootstrap servers) from its routing table",
    "preferfollowers": "true: with zookeeper, read from followers first, the leader last",
    "partitions": "comma-separated physical partition names (default: every one the relay has)",
    "sources": "comma-separated logical source (table) names (default: every source)",
    "filter": "key-hash filter (mod:N:B.., range:LO:HI or slice:I/N) this query reads",
    "startingscn": "earliest | latest | an SCN | JSON {partition: scn} (first start only)",
    "endingscn": "batch reads: latest | an SCN | JSON {partition: scn} (inclusive)",
    "startingtimestamp": "start at the first window committed at/after this time (ms since epoch)",
    "endingtimestamp": "batch reads: end at the last window committed at/before this time (ms)",
    "maxrowspertrigger": "admission control: about this many change events per micro-batch",
    "maxbytespertrigger": "admission control: about this many event bytes per micro-batch",
    "minrowspertrigger": "skip a trigger while fewer change events are available (with"
    " maxTriggerDelay)",
    "maxtriggerdelay": "with minRowsPerTrigger: the longest wait between two batches (15m; ms, s,"
    " m, h units)",
    "numpartitions": "Spark partitions per physical partition and batch",
    "splitby": "scn: numPartitions consecutive SCN sub-ranges of similar volume (default);"
    " key: numPartitions key-hash slices",
    "failondataloss": "true: a range the relay no longer keeps fails the query",
    "bootstrapurl": "bootstrap server base URL(s), comma-separated: earliest = snapshot + live,"
    " and a range the relays no longer keep is recovered through it",
    "bootstrapurls": "the same as bootstrapUrl",
    "maxbytesperrequest": "bytes per relay response while reading",
    "maxwindowbytes": "the largest transaction (window) a task holds (512 MiB): a larger one"
    " stops the query; raise it for larger transactions (a task holds several times it)",
    "arrowbatchrows": "rows per Arrow record batch handed to Spark",
    "arrowbatchbytes": "wire bytes of the windows in an Arrow record batch, at most (about)",
    "requesttimeouts": "seconds a relay request may take before failing over",
    "includepreimage": "true: updates with a before-image also give an update_preimage row",
    "includenotsent": "true: a _not_sent column names the values the source did not send",
    "tls.cafile": "CA certificates (PEM file) that verify https:// relays and bootstrap servers",
    "tls.certfile": "client certificate (PEM) for mTLS, with tls.keyFile",
    "tls.keyfile": "the client certificate's private key (PEM file)",
    "tls.checkhostname": "false: do not compare the server certificate's name with the URL host",
    "tokenfile": "file holding the bearer token (preferred over token: options show in plans)",
    "token": "the bearer token itself (prefer tokenFile: options may show in plans and the UI)",
    "schematrackinglocation": "streaming: a directory (inside the checkpoint location) keeping the"
    " query's table schemas across schema changes and restarts",
    "allowschemachanges": "streaming: comma-separated non-additive schema changes to read past"
    " (drop, retype); refused otherwise",
}

#: the non-additive schema changes ``allowSchemaChanges`` can allow
SCHEMA_CHANGE_KINDS = ("drop", "retype")


def parse_position(text: str, what: str, *, allow_earliest: bool = True) -> Position:
    """Parse ``startingScn`` / ``endingScn`` text (see the module docstring)."""
    t = text.strip()
    low = t.lower()
    if low == "latest" or (low == "earliest" and allow_earliest):
        return low
    if t.startswith("{"):
        try:
            data = json.loads(t)
        except ValueError as exc:
            raise ConfigError(f"{what}: bad JSON {t!r}: {exc}") from None
        if not isinstance(data, dict) or not data:
            raise ConfigError(f"{what}: JSON must be a non-empty object {{partition: scn}}")
        out: dict[str, int] = {}
        for name, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ConfigError(f"{what}: the SCN of {name!r} must be a number or SCN text")
            out[str(name)] = _scn(str(value), what) if isinstance(value, str) else value
            if out[str(name)] < -1:
                raise ConfigError(f"{what}: the SCN of {name!r} must be >= -1")
        return out
    return _scn(t, what)


def _scn(text: str, what: str) -> int:
    if text.strip() == "-1":
        return -1
    try:
        return parse_scn(text)
    except ChangebusError:
        raise ConfigError(
            f"{what} must be earliest, latest, an SCN (decimal, X/Y or file:pos) or a JSON"
            f" object {{partition: scn}}, got {text!r}"
        ) from None


def _bool(options: Mapping[str, str], key: str, default: bool) -> bool:
    raw = options.get(key)
    if raw is None:
        return default
    low = str(raw).strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {key}: expected true or false, got {raw!r}")


def _int(options: Mapping[str, str], key: str, default: int, minimum: int) -> int:
    raw = options.get(key)
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"option {key}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"option {key}: must be >= {minimum}, got {value}")
    return value


_DELAY_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def _duration_s(options: Mapping[str, str], key: str, default_s: float) -> float:
    """A time such as ``15m``, ``30s``, ``500ms`` (a bare number: milliseconds, as Spark's)."""
    raw = options.get(key)
    if raw is None:
        return default_s
    text = str(raw).strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = text[len(number) :].strip() or "ms"
    try:
        value = float(number) * _DELAY_UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigError(
            f"option {key}: expected a duration such as 30s, 15m or 500ms, got {raw!r}"
        ) from None
    if not (0 <= value < math.inf):  # (nan fails both)
        raise ConfigError(f"option {key}: must be a finite duration >= 0, got {raw!r}")
    return value


def _split_by(raw: str) -> Literal["key", "scn"]:
    low = raw.strip().lower()
    if low == "key":
        return "key"
    if low == "scn":
        return "scn"
    raise ConfigError(f"option splitBy: expected key or scn, got {raw!r}")


def _list(options: Mapping[str, str], key: str) -> tuple[str, ...]:
    raw = options.get(key)
    if raw is None:
        return ()
    items = tuple(s.strip() for s in str(raw).split(",") if s.strip())
    if not items:
        # (an unset variable passed along: "" read as "no restriction" widened the query
        # to every source or partition without a word)
        raise ConfigError(f"option {key} is set but names nothing ({raw!r}): leave it out")
    if len(set(items)) != len(items):
        raise ConfigError(f"option {key}: duplicate names in {raw!r}")
    return items


def _schema_changes(options: Mapping[str, str]) -> frozenset[str]:
    kinds = frozenset(k.lower() for k in _list(options, "allowschemachanges"))
    unknown = sorted(kinds - set(SCHEMA_CHANGE_KINDS))
    if unknown:
        raise ConfigError(
            f"option allowSchemaChanges: unknown kind(s) {unknown}; give a comma-separated"
            f" list of {', '.join(SCHEMA_CHANGE_KINDS)} (added columns and widened types"
            " need no option)"
        )
    return kinds


def _auth(options: Mapping[str, str]) -> ClientAuth:
    """The ``tls.*``, ``tokenFile`` and ``token`` options as a :class:`ClientAuth`."""

    def path(key: str) -> Path | None:
        raw = options.get(key, "").strip()
        return Path(raw) if raw else None

    token = options.get("token", "").strip()
    if token and "tokenfile" in options:
        raise ConfigError("give the option tokenFile or token, not both")
    try:
        return ClientAuth(
            ca_file=path("tls.cafile"),
            cert_file=path("tls.certfile"),
            key_file=path("tls.keyfile"),
            check_hostname=_bool(options, "tls.checkhostname", True),
            token=token,
            token_file=path("tokenfile"),
        )
    except ConfigError as exc:
        raise ConfigError(f"options tls.* / tokenFile / token: {exc.message}") from None


@dataclass(frozen=True)
class SourceOptions:
    """What one ``format("changebus")`` query reads, and how (module docstring).

    * ``relays`` -- relay base URLs, tried in order (failover);
    * ``zookeeper`` / ``cluster`` -- instead of (or besides) ``relays``: the
      relays come from the cluster's routing table, read on the driver at
      reader creation and again for each planning request (so the query
      follows the table), and by each executor's consumer, which follows
      the table while it reads; ``prefer_followers`` puts the followers
      first. Without ``bootstrap`` the bootstrap servers registered in the
      cluster are used;
    * ``partitions`` -- physical partitions to read (empty: all of the relay's);
    * ``sources`` -- tables to read (empty: all); ``key_filter`` a key-hash
      subset of them;
    * ``starting`` / ``ending`` -- positions (``ending`` for batch reads);
    * ``max_rows_per_trigger`` / ``max_bytes_per_trigger`` -- read limits of a
      micro-batch in change events / event bytes (0: no limit); a micro-batch
      always ends on a transaction boundary and takes at least one whole
      transaction, so it may exceed a limit by the rest of one transaction;
    * ``min_rows_per_trigger`` / ``max_trigger_delay_s`` -- Kafka's
      ``minOffsetsPerTrigger`` / ``maxTriggerDelay``: a trigger is skipped
      while fewer change events are available, unless this long has passed
      since the last trigger that was not skipped (0: never skipped);
    * ``num_partitions`` -- Spark partitions per physical partition and batch;
      ``split_by`` ``scn`` (the default): the batch's SCN range is cut into
      this many consecutive sub-ranges holding similar numbers of events (the
      relay's ``/v1/splits``; evenly by SCN distance from a relay without it),
      each window read by one task; ``key``: the key-hash space (or
      ``key_filter``) is cut into this many slices that the relay filters
      server-side, so every task reads every window's header and end marker
      (the per-window work is done ``num_partitions`` times; only a single
      huge transaction is spread over the tasks this way);
    * ``bootstrap`` -- bootstrap server URLs (failover order); with them
      ``earliest`` is a snapshot followed by the live stream, and a range the
      relays no longer keep is read through a bootstrap server instead;
    * ``fail_on_data_loss`` -- without ``bootstrap``: whether an evicted range
      fails the query (else it is skipped with a warning, as Spark's Kafka
      source does);
    * ``max_bytes_per_request``, ``arrow_batch_rows``, ``request_timeout_s`` --
      transfer tuning; ``arrow_batch_bytes`` -- an Arrow batch is handed to
      Spark once its windows' wire bytes reach it, whatever its rows (wide rows:
      65,536 of 64 KB each made a 4 GB batch, past Arrow's 2 GiB string
      columns); ``max_window_bytes`` -- the largest window (transaction)
      a task or the driver holds (the client's ``max_window_bytes``); ``include_preimage`` -- emit ``update_preimage`` rows;
    * ``include_not_sent`` -- add the ``_not_sent`` column (the values the
      source did not send, Postgres' unchanged TOAST);
    * ``schema_tracking_location`` -- streaming: the directory of the query's
      schema log (``._schemalog``), which keeps the table schemas the query
      reads with across schema changes and restarts (empty: none, each start
      takes the relays' newest versions);
    * ``allow_schema_changes`` -- streaming: the non-additive schema changes
      (``drop``, ``retype``) the query reads past; any other stops it with
      :class:`~changebus.schemas.SchemaChangeRefusedError`;
    * ``auth`` -- TLS settings and bearer token of every connection, on the
      driver and in the executors (``tls.*``, ``tokenFile``, ``token``; the
      files must be readable at the same paths on every executor). Its
      ``repr`` never shows the token.
    """

    relays: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    key_filter: PartitionFilter | None = None
    starting: Position = "latest"
    ending: Position = "latest"
    max_rows_per_trigger: int = 0
    max_bytes_per_trigger: int = 0
    min_rows_per_trigger: int = 0
    max_trigger_delay_s: float = 900.0
    num_partitions: int = 1
    split_by: Literal["key", "scn"] = "scn"
    fail_on_data_loss: bool = True
    max_bytes_per_request: int = 4 << 20
    max_window_bytes: int = DEFAULT_MAX_WINDOW_BYTES
    arrow_batch_rows: int = 65536
    arrow_batch_bytes: int = 64 << 20
    request_timeout_s: float = 30.0
    include_preimage: bool = True
    include_not_sent: bool = False
    mode: Literal["stream", "batch"] = field(default="stream", compare=False)
    zookeeper: str = ""
    cluster: str = ""
    prefer_followers: bool = False
    schema_tracking_location: str = ""
    allow_schema_changes: frozenset[str] = frozenset()
    auth: ClientAuth = field(default_factory=ClientAuth)

    def __post_init__(self) -> None:
        if bool(self.zookeeper.strip()) != bool(self.cluster.strip()):
            raise ConfigError(
                "options zookeeper and cluster go together: give the ZooKeeper connect string"
                " and the cluster name"
            )
        if not self.relays and not self.zookeeper.strip():
            raise ConfigError(
                "option relays: give at least one relay URL, or the options zookeeper and"
                " cluster to read them from a cluster's routing table"
            )
        for url in self.relays:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"option relays: {url_without_user(url)!r} is not an http:// or https:// URL"
                )
        for url in self.bootstrap:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"option bootstrapUrl: {url_without_user(url)!r} is not an http:// or"
                    " https:// URL"
                )
        if self.num_partitions < 1 or self.arrow_batch_rows < 1 or self.max_bytes_per_request < 1:
            raise ConfigError("numPartitions, arrowBatchRows, maxBytesPerRequest must be >= 1")
        if self.max_bytes_per_request > self.max_window_bytes:
            raise ConfigError("maxBytesPerRequest must not pass maxWindowBytes")
        if not (0 < self.request_timeout_s < math.inf):  # (nan fails both)
            raise ConfigError("requestTimeoutS must be a finite number of seconds > 0")
        if min(self.max_rows_per_trigger, self.max_bytes_per_trigger) < 0:
            raise ConfigError("maxRowsPerTrigger and maxBytesPerTrigger must be >= 1")
        if self.min_rows_per_trigger < 0 or self.max_trigger_delay_s < 0:
            raise ConfigError("minRowsPerTrigger and maxTriggerDelay must be >= 0")
        if 0 < self.max_rows_per_trigger < self.min_rows_per_trigger:
            raise ConfigError(
                f"minRowsPerTrigger ({self.min_rows_per_trigger}) is larger than"
                f" maxRowsPerTrigger ({self.max_rows_per_trigger})"
            )

    @classmethod
    def parse(
        cls, options: Mapping[str, str], *, mode: Literal["stream", "batch"] = "stream"
    ) -> SourceOptions:
        """Read Spark's option map (keys in any case); unknown keys are an error."""
        opts = {str(k).lower(): str(v) for k, v in options.items()}
        unknown = sorted(k for k in opts if k not in OPTION_NAMES)
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for format('changebus'); known: "
                + ", ".join(sorted(OPTION_NAMES))
            )
        if "bootstrapurl" in opts and "bootstrapurls" in opts:
            raise ConfigError("give bootstrapUrl or bootstrapUrls, not both")
        bootstrap = tuple(
            u.rstrip("/") for u in _list(opts, "bootstrapurl") + _list(opts, "bootstrapurls")
        )
        relays = tuple(u.rstrip("/") for u in _list(opts, "relays"))
        key_filter = None
        if "filter" in opts:
            try:
                key_filter = PartitionFilter.parse(opts["filter"])
            except ChangebusError as exc:
                raise ConfigError(f"option filter: {exc.message}") from None
        starting: Position = "latest" if mode == "stream" else "earliest"
        if "startingscn" in opts:
            starting = parse_position(opts["startingscn"], "startingScn")
        if "startingtimestamp" in opts:
            if "startingscn" in opts:
                raise ConfigError("give startingScn or startingTimestamp, not both")
            starting = AtTime(_int(opts, "startingtimestamp", 0, 0))
        ending: Position = "latest"
        if "endingscn" in opts or "endingtimestamp" in opts:
            if mode == "stream":
                raise ConfigError(
                    "options endingScn / endingTimestamp are for batch reads (spark.read) only"
                )
            if "endingscn" in opts and "endingtimestamp" in opts:
                raise ConfigError("give endingScn or endingTimestamp, not both")
            if "endingscn" in opts:
                ending = parse_position(opts["endingscn"], "endingScn", allow_earliest=False)
            else:
                ending = AtTime(_int(opts, "endingtimestamp", 0, 0))
        if "maxtriggerdelay" in opts and "minrowspertrigger" not in opts:
            raise ConfigError("option maxTriggerDelay goes with minRowsPerTrigger")
        timeout_raw = opts.get("requesttimeouts", "30")
        try:
            timeout_s = float(timeout_raw)
        except ValueError:
            raise ConfigError(f"option requestTimeoutS: not a number: {timeout_raw!r}") from None
        return cls(
            relays=relays,
            bootstrap=bootstrap,
            partitions=_list(opts, "partitions"),
            sources=_list(opts, "sources"),
            key_filter=key_filter,
            starting=starting,
            ending=ending,
            max_rows_per_trigger=_int(opts, "maxrowspertrigger", 0, 1),
            max_bytes_per_trigger=_int(opts, "maxbytespertrigger", 0, 1),
            min_rows_per_trigger=_int(opts, "minrowspertrigger", 0, 1),
            max_trigger_delay_s=_duration_s(opts, "maxtriggerdelay", 900.0),
            num_partitions=_int(opts, "numpartitions", 1, 1),
            split_by=_split_by(opts.get("splitby", "scn")),
            fail_on_data_loss=_bool(opts, "failondataloss", True),
            max_bytes_per_request=_int(opts, "maxbytesperrequest", 4 << 20, 1024),
            max_window_bytes=_int(opts, "maxwindowbytes", DEFAULT_MAX_WINDOW_BYTES, 1 << 20),
            arrow_batch_rows=_int(opts, "arrowbatchrows", 65536, 1),
            arrow_batch_bytes=_int(opts, "arrowbatchbytes", 64 << 20, 1 << 20),
            request_timeout_s=timeout_s,
            include_preimage=_bool(opts, "includepreimage", True),
            include_not_sent=_bool(opts, "includenotsent", False),
            mode=mode,
            zookeeper=opts.get("zookeeper", "").strip(),
            cluster=opts.get("cluster", "").strip(),
            prefer_followers=_bool(opts, "preferfollowers", False),
            schema_tracking_location=opts.get("schematrackinglocation", "").strip(),
            allow_schema_changes=_schema_changes(opts),
            auth=_auth(opts),
        )

    def slices(self) -> list[PartitionFilter | None]:
        """The key-hash filters of the ``num_partitions`` Spark partitions.

        Without a ``key_filter`` the hash space is cut into equal ranges
        (``slice:i/n``); a range filter is cut the same way; a mod filter's
        buckets are cut into contiguous runs (at most one slice per bucket).
        Together the slices select exactly what ``key_filter`` selects.
        """
        n = self.num_partitions
        f = self.key_filter
        if n == 1:
            return [f]
        if f is None:
            return [PartitionFilter.slice(i, n) for i in range(n)]
        if f.modulus is None:
            width = f.hi - f.lo
            n = min(n, width)
            bounds = [f.lo + i * width // n for i in range(n + 1)]
            return [PartitionFilter.range(bounds[i], bounds[i + 1]) for i in range(n)]
        buckets = sorted(f.buckets)
        k = min(n, len(buckets))
        # contiguous runs of buckets, whose text stays short (``mod:M:a-b``): dealt out
        # round-robin, a wide filter's slices listed every other bucket, past what a
        # filter may hold, and every task failed (review)
        cuts = [i * len(buckets) // k for i in range(k + 1)]
        return [PartitionFilter.mod(f.modulus, buckets[cuts[i] : cuts[i + 1]]) for i in range(k)]
