"""Recovery of a buffer's files after a restart or a crash.

One job: decide what a reopened buffer may serve. The last published state
(:meth:`~._meta.MetaFile.load`) names the live events; every one of them is
verified against the ring (magic, version, op, lengths, both CRCs) and
against its event table record (SCN, length, op). Any mismatch -- a crash
in the middle of a write can leave torn pages when the machine itself went
down -- makes the buffer start empty *after* the last published SCN
(``prev_scn = last_scn``), so a consumer is sent to the bootstrap server
rather than given damaged or missing events.

Runs once, in the constructor, before any reader or writer exists.
"""

from __future__ import annotations

import logging

import numpy as np

from changebus.schemas import CorruptEventError, check_headers, headers_at, verify_payloads

from ._meta import BufferMeta, MetaFile
from ._tables import CircularTable

__all__ = ["recover"]

log = logging.getLogger("changebus.relay.buffer")


def recover(
    meta: BufferMeta,
    events: CircularTable,
    ring: memoryview,
    metafile: MetaFile,
    name: str,
) -> BufferMeta:
    """Validate what the last published state says is live; trim damage."""
    n = meta.tail_event - meta.head_event
    if n <= 0:
        return meta
    rec = events.get(meta.head_event, meta.tail_event)
    phys = (rec["pos"] % np.uint64(meta.capacity)).astype(np.int64)
    try:
        headers = headers_at(ring, phys)
        check_headers(ring, phys, headers)
        verify_payloads(ring, phys, headers)
        if not (
            (headers["scn"] == rec["scn"]).all()
            and (headers["total_length"] == rec["length"]).all()
            and (headers["op"] == rec["op"]).all()
        ):
            raise CorruptEventError("event table does not match the ring")
    except CorruptEventError as exc:
        log.warning(
            "buffer %s: damaged after a crash (%s); starting empty after SCN %d",
            name,
            exc,
            meta.last_scn,
        )
        fresh = BufferMeta(
            meta.capacity,
            meta.event_slots,
            meta.index_slots,
            head_event=meta.tail_event,
            tail_event=meta.tail_event,
            head_pos=meta.tail_pos,
            tail_pos=meta.tail_pos,
            prev_scn=meta.last_scn,
            last_scn=meta.last_scn,
            index_head=meta.index_tail,
            index_tail=meta.index_tail,
        )
        metafile.publish(fresh)
        return fresh
    log.info("buffer %s: recovered %d events, SCN %d..%d", name, n, meta.min_scn, meta.last_scn)
    return meta
