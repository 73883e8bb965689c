"""changebus.schemas: the wire contract shared by every changebus component.

* the event envelope (:func:`encode_event`, :data:`HEADER_DTYPE`, ...) and
  control events (:func:`encode_control`, :func:`decode_control`);
* data-event payloads (:class:`RowEncoder`, :class:`ChangeDecoder`);
* SCN helpers, the consumer :class:`Checkpoint`;
* Avro table schemas, type mappings from Postgres and MySQL, the
  :class:`SchemaRegistry` and reader-schema compatibility;
* the portable partition hash and :class:`PartitionFilter`;
* the one exception tree rooted at :class:`ChangebusError`.

The byte-level specification is docs/protocol.md.
"""

from ._checkpoint import (
    BootstrapProgress as BootstrapProgress,
)
from ._checkpoint import (
    Checkpoint as Checkpoint,
)
from ._checkpoint import (
    Mode as Mode,
)
from ._checkpoint import (
    PartitionCheckpoint as PartitionCheckpoint,
)
from ._compat import check_compatible as check_compatible
from ._control import (
    CONTROL_SCHEMAS as CONTROL_SCHEMAS,
)
from ._control import (
    CheckpointMarker as CheckpointMarker,
)
from ._control import (
    ControlPayload as ControlPayload,
)
from ._control import (
    DataLoss as DataLoss,
)
from ._control import (
    EndOfWindow as EndOfWindow,
)
from ._control import (
    Heartbeat as Heartbeat,
)
from ._control import (
    LogicalMessage as LogicalMessage,
)
from ._control import (
    SchemaChange as SchemaChange,
)
from ._control import (
    control_schema_id as control_schema_id,
)
from ._control import (
    decode_control as decode_control,
)
from ._control import (
    encode_control as encode_control,
)
from ._envelope import (
    HEADER_DTYPE as HEADER_DTYPE,
)
from ._envelope import (
    HEADER_SIZE as HEADER_SIZE,
)
from ._envelope import (
    MAX_EVENT_SIZE as MAX_EVENT_SIZE,
)
from ._envelope import (
    EventHeader as EventHeader,
)
from ._envelope import (
    Op as Op,
)
from ._envelope import (
    check_headers as check_headers,
)
from ._envelope import (
    decode_header as decode_header,
)
from ._envelope import (
    encode_event as encode_event,
)
from ._envelope import (
    event_at as event_at,
)
from ._envelope import (
    headers_at as headers_at,
)
from ._envelope import (
    parse_stream as parse_stream,
)
from ._envelope import (
    scan_offsets as scan_offsets,
)
from ._envelope import (
    verify_event as verify_event,
)
from ._envelope import (
    verify_payloads as verify_payloads,
)
from ._partition import (
    HASH_SPACE as HASH_SPACE,
)
from ._partition import (
    PartitionFilter as PartitionFilter,
)
from ._partition import (
    key_hash as key_hash,
)
from ._payload import (
    ChangeDecoder as ChangeDecoder,
)
from ._payload import (
    DecodedChange as DecodedChange,
)
from ._payload import (
    RowEncoder as RowEncoder,
)
from ._registry import SchemaRegistry as SchemaRegistry
from ._scn import (
    MAX_SCN as MAX_SCN,
)
from ._scn import (
    NO_SCN as NO_SCN,
)
from ._scn import (
    binlog_file_number as binlog_file_number,
)
from ._scn import (
    binlog_to_scn as binlog_to_scn,
)
from ._scn import (
    format_scn as format_scn,
)
from ._scn import (
    lsn_to_scn as lsn_to_scn,
)
from ._scn import (
    parse_scn as parse_scn,
)
from ._scn import (
    scn_to_binlog as scn_to_binlog,
)
from ._scn import (
    scn_to_lsn as scn_to_lsn,
)
from ._table import AvroType as AvroType
from ._table import Column as Column
from ._table import TableSchema as TableSchema
from ._types_mysql import (
    mysql_avro_type as mysql_avro_type,
)
from ._types_mysql import (
    mysql_bit as mysql_bit,
)
from ._types_mysql import (
    mysql_set as mysql_set,
)
from ._types_mysql import (
    mysql_time_micros as mysql_time_micros,
)
from ._types_mysql import (
    mysql_unsigned_bigint as mysql_unsigned_bigint,
)
from ._types_mysql import (
    mysql_uuid as mysql_uuid,
)
from ._types_pg import (
    INTERVAL_SCHEMA as INTERVAL_SCHEMA,
)
from ._types_pg import (
    pg_avro_type as pg_avro_type,
)
from ._types_pg import (
    pg_interval as pg_interval,
)
from ._types_pg import (
    pg_numeric_text as pg_numeric_text,
)
from ._version import __version__ as __version__
from .errors import (
    BadRequestError as BadRequestError,
)
from .errors import (
    ChangebusError as ChangebusError,
)
from .errors import (
    CheckpointError as CheckpointError,
)
from .errors import (
    ConfigError as ConfigError,
)
from .errors import (
    CorruptEventError as CorruptEventError,
)
from .errors import (
    DataLossError as DataLossError,
)
from .errors import (
    EventTooLargeError as EventTooLargeError,
)
from .errors import (
    IncompatibleSchemaError as IncompatibleSchemaError,
)
from .errors import (
    OverwrittenError as OverwrittenError,
)
from .errors import (
    ProtocolError as ProtocolError,
)
from .errors import (
    SchemaError as SchemaError,
)
from .errors import (
    ScnNotFoundError as ScnNotFoundError,
)
from .errors import (
    SourceConfigError as SourceConfigError,
)
from .errors import (
    SourceError as SourceError,
)
from .errors import (
    TransportError as TransportError,
)
from .errors import (
    UnknownSchemaError as UnknownSchemaError,
)
from .errors import (
    UnknownSourceError as UnknownSourceError,
)

__all__ = [
    "CONTROL_SCHEMAS",
    "HASH_SPACE",
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "INTERVAL_SCHEMA",
    "MAX_EVENT_SIZE",
    "MAX_SCN",
    "NO_SCN",
    "AvroType",
    "BadRequestError",
    "BootstrapProgress",
    "ChangeDecoder",
    "ChangebusError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMarker",
    "Column",
    "ConfigError",
    "ControlPayload",
    "CorruptEventError",
    "DataLoss",
    "DataLossError",
    "DecodedChange",
    "EndOfWindow",
    "EventHeader",
    "EventTooLargeError",
    "Heartbeat",
    "IncompatibleSchemaError",
    "LogicalMessage",
    "Mode",
    "Op",
    "OverwrittenError",
    "PartitionCheckpoint",
    "PartitionFilter",
    "ProtocolError",
    "RowEncoder",
    "SchemaChange",
    "SchemaError",
    "SchemaRegistry",
    "ScnNotFoundError",
    "SourceConfigError",
    "SourceError",
    "TableSchema",
    "TransportError",
    "UnknownSchemaError",
    "UnknownSourceError",
    "__version__",
    "binlog_file_number",
    "binlog_to_scn",
    "check_compatible",
    "check_headers",
    "control_schema_id",
    "decode_control",
    "decode_header",
    "encode_control",
    "encode_event",
    "event_at",
    "format_scn",
    "headers_at",
    "key_hash",
    "lsn_to_scn",
    "mysql_avro_type",
    "mysql_bit",
    "mysql_set",
    "mysql_time_micros",
    "mysql_unsigned_bigint",
    "mysql_uuid",
    "parse_scn",
    "parse_stream",
    "pg_avro_type",
    "pg_interval",
    "pg_numeric_text",
    "scan_offsets",
    "scn_to_binlog",
    "scn_to_lsn",
    "verify_event",
    "verify_payloads",
]
