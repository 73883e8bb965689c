"""Telling a service manager how a daemon is doing: the ``sd_notify`` protocol.

A daemon started by systemd with ``Type=notify`` finds the path of a Unix
datagram socket in ``NOTIFY_SOCKET`` (a leading ``@`` names an abstract
socket) and sends it newline-separated ``KEY=VALUE`` states: ``READY=1``
once it serves (``systemctl start`` returns then, and a ``systemctl
reload`` waits for it instead of signalling a daemon that is still
importing its modules), ``RELOADING=1`` / ``READY=1`` around a reload,
``STOPPING=1`` when it begins to shut down, ``STATUS=...`` free text for
``systemctl status``.

:func:`notify` does nothing without ``NOTIFY_SOCKET`` (a daemon started any
other way) and never raises: the service manager's view is advisory, a
failed send is logged at debug level and the daemon carries on. The send is
one non-blocking ``sendto`` of a few bytes on a local socket: safe to call
from the event loop. Thread-safe (no shared state).
"""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify"]

log = logging.getLogger("changebus.sdnotify")


def notify(*states: str) -> bool:
    """Send ``states`` (e.g. ``"READY=1"``) to the service manager; True when sent."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address or not states:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.sendto("\n".join(states).encode(), address)
    except OSError as exc:
        log.debug("service manager notification failed: %s", exc)
        return False
    return True
