"""Avro resolution helpers for column readers outside this slice (public, stable names).

The schemas slice generates its own readers (row and column) from the
writer and reader schemas. Other slices that build specialised readers over
the same payloads (the Spark source's vectorised decoder,
``changebus.client.spark``) need the same three decisions, and must make
them exactly as the generated readers do, so they take them from here:

* :func:`resolution_plan`: which writer fields a reader drops and which it
  adds (null), or :class:`UnsupportedSchema` when the resolution needs
  fastavro (type promotions, aliases, other defaults);
* :func:`expanded_type`: a field type with named-type references replaced by
  their definitions;
* :func:`read_string_array`: an Avro ``array<string>`` (the not-sent lists).

Pure functions; thread-safe.
"""

from __future__ import annotations

from ._avroread import (
    _expanded as expanded_type,
    _plan as resolution_plan,
    _Resolution as Resolution,
    _string_array as read_string_array,
    _Unsupported as UnsupportedSchema,
)

__all__ = [
    "Resolution",
    "UnsupportedSchema",
    "expanded_type",
    "read_string_array",
    "resolution_plan",
]
