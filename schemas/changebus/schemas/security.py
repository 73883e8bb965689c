"""changebus.schemas.security: TLS and authentication settings shared by every component.

* :class:`ClientAuth` -- how an outgoing changebus connection (consumer,
  CLI, Spark source, bootstrap -> relay, relay -> relay) verifies the server
  (CA file, host name check), presents a client certificate (mTLS) and a
  bearer token. Details: :mod:`changebus.schemas._client_auth`.
"""

from ._client_auth import ClientAuth as ClientAuth

__all__ = ["ClientAuth"]
