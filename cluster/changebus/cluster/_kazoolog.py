"""kazoo's logger, its debug lines kept free of credentials.

Every :class:`kazoo.client.KazooClient` of :mod:`._session` logs through
:data:`KAZOO_LOG`, whose filter blanks, in the arguments of each line, the
fields of kazoo's requests and answers that hold a secret
(:data:`_SECRET_FIELDS`), digest ACL ids, and the ``session_passwd`` its
connect lines print. A line of a shape not foreseen loses its arguments
rather than show them. Thread-safe (logging filters run on kazoo's threads).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["KAZOO_LOG"]


#: fields of kazoo's requests and answers (named tuples) its debug lines must not show:
#: an ``Auth``'s credentials, a ``Connect``'s session password (whoever has it and the
#: session id can take the session over: close a leader's, or keep a dead one alive),
#: and the digest ACLs of ``Create``/``SetACL`` (a salted hash of the password)
_SECRET_FIELDS = ("auth", "passwd", "acl", "acls")


def _blanked(arg: Any, depth: int = 0) -> Any:
    """``arg`` with :data:`_SECRET_FIELDS` and digest ids blanked, through the tuples and
    lists of an answer (a ``GetACL``'s ``([ACL, ...], stat)``), three levels deep."""
    if depth > 3 or not isinstance(arg, tuple | list):
        return arg
    if type(arg) in (tuple, list):
        return type(arg)(_blanked(a, depth + 1) for a in arg)
    named: Any = arg  # (a named tuple of kazoo's, or a class of no fields)
    fields = getattr(named, "_fields", None)
    if not fields:
        return arg
    if fields == ("scheme", "id") and getattr(named, "scheme", "") == "digest":
        return named._replace(id="***")
    hidden = {f: "***" for f in _SECRET_FIELDS if f in fields}
    if hidden:
        return named._replace(**hidden)
    return named._replace(**{f: _blanked(getattr(named, f), depth + 1) for f in fields})


class _HideAuth(logging.Filter):
    """Blanks credentials and session passwords in kazoo's debug log lines
    (:data:`_SECRET_FIELDS`, and the ``session_passwd`` its connect lines print)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple):
            return True
        if "session_passwd" in str(record.msg):
            # ("Using session_id: %r session_passwd: %s", "Session created, ...")
            record.args = tuple("***" if i == 1 else a for i, a in enumerate(args))
            return True
        try:
            record.args = tuple(_blanked(a) for a in args)
        except Exception:  # noqa: BLE001 - a shape not foreseen: the line goes, args unshown
            record.args = ()
            record.msg = f"{record.msg} (arguments not shown)"
        return True


#: kazoo logs through this logger (given to every KazooClient of :mod:`._session`)
KAZOO_LOG = logging.getLogger("changebus.cluster.kazoo")
KAZOO_LOG.addFilter(_HideAuth())
