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
    Checkpoint as Checkpoint,
    Mode as Mode,
    PartitionCheckpoint as PartitionCheckpoint,
)
from ._compat import check_compatible as check_compatible
from ._control import (
    CONTROL_SCHEMAS as CONTROL_SCHEMAS,
    CheckpointMarker as CheckpointMarker,
    ControlPayload as ControlPayload,
    DataLoss as DataLoss,
    EndOfWindow as EndOfWindow,
    Heartbeat as Heartbeat,
    LogicalMessage as LogicalMessage,
    SchemaChange as SchemaChange,
    control_schema_id as control_schema_id,
    decode_control as decode_control,
    encode_control as encode_control,
)
from ._crc import crc32 as crc32
from ._envelope import (
    HEADER_DTYPE as HEADER_DTYPE,
    HEADER_SIZE as HEADER_SIZE,
    MAGIC as MAGIC,
    MAX_EVENT_SIZE as MAX_EVENT_SIZE,
    VERSION as VERSION,
    EventHeader as EventHeader,
    Op as Op,
    check_headers as check_headers,
    decode_header as decode_header,
    encode_event as encode_event,
    event_at as event_at,
    headers_at as headers_at,
    parse_stream as parse_stream,
    scan_offsets as scan_offsets,
    verify_event as verify_event,
    verify_payloads as verify_payloads,
)
from ._partition import (
    HASH_SPACE as HASH_SPACE,
    PartitionFilter as PartitionFilter,
    key_hash as key_hash,
)
from ._payload import (
    ChangeDecoder as ChangeDecoder,
    DecodedChange as DecodedChange,
    RowChange as RowChange,
    RowEncoder as RowEncoder,
)
from ._registry import SchemaRegistry as SchemaRegistry
from ._scn import (
    MAX_SCN as MAX_SCN,
    NO_SCN as NO_SCN,
    binlog_file_number as binlog_file_number,
    binlog_to_scn as binlog_to_scn,
    format_scn as format_scn,
    lsn_to_scn as lsn_to_scn,
    parse_scn as parse_scn,
    scn_to_binlog as scn_to_binlog,
    scn_to_lsn as scn_to_lsn,
)
from ._table import (
    AvroType as AvroType,
    Column as Column,
    TableSchema as TableSchema,
    avro_name as avro_name,
    field_name as field_name,
)
from ._types_mysql import (
    mysql_avro_type as mysql_avro_type,
    mysql_bit as mysql_bit,
    mysql_boolean as mysql_boolean,
    mysql_json as mysql_json,
    mysql_set as mysql_set,
    mysql_time_micros as mysql_time_micros,
    mysql_timestamp as mysql_timestamp,
    mysql_unsigned_bigint as mysql_unsigned_bigint,
    mysql_uuid as mysql_uuid,
)
from ._types_pg import (
    INTERVAL_SCHEMA as INTERVAL_SCHEMA,
    pg_avro_type as pg_avro_type,
    pg_interval as pg_interval,
    pg_numeric_text as pg_numeric_text,
)
from ._varint import (
    AVRO_PRESENT_SMALL as AVRO_PRESENT_SMALL,
    avro_long as avro_long,
    avro_present_long as avro_present_long,
)
from ._version import __version__ as __version__
from .errors import (
    BadRequestError as BadRequestError,
    ChangebusError as ChangebusError,
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    CorruptEventError as CorruptEventError,
    DataLossError as DataLossError,
    EventTooLargeError as EventTooLargeError,
    IncompatibleSchemaError as IncompatibleSchemaError,
    OverwrittenError as OverwrittenError,
    ProtocolError as ProtocolError,
    SchemaError as SchemaError,
    ScnNotFoundError as ScnNotFoundError,
    SourceConfigError as SourceConfigError,
    SourceError as SourceError,
    TransportError as TransportError,
    UnknownSchemaError as UnknownSchemaError,
    UnknownSourceError as UnknownSourceError,
)

__all__ = [
    "AVRO_PRESENT_SMALL",
    "CONTROL_SCHEMAS",
    "HASH_SPACE",
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "INTERVAL_SCHEMA",
    "MAGIC",
    "MAX_EVENT_SIZE",
    "MAX_SCN",
    "NO_SCN",
    "VERSION",
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
    "RowChange",
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
    "avro_long",
    "avro_name",
    "avro_present_long",
    "binlog_file_number",
    "binlog_to_scn",
    "check_compatible",
    "check_headers",
    "control_schema_id",
    "crc32",
    "decode_control",
    "decode_header",
    "encode_control",
    "encode_event",
    "event_at",
    "field_name",
    "format_scn",
    "headers_at",
    "key_hash",
    "lsn_to_scn",
    "mysql_avro_type",
    "mysql_bit",
    "mysql_boolean",
    "mysql_json",
    "mysql_set",
    "mysql_time_micros",
    "mysql_timestamp",
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
