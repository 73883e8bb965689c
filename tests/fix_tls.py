"""Throwaway certificates for TLS tests (trustme): a CA, a server and client certificates.

``tls_ca`` is one test CA per session; ``tls_files`` writes, into a fresh
directory, everything a test needs as PEM files (the daemons and the client
library take file paths, as an operator's config does):

* ``ca`` -- the CA certificate (what clients and mTLS servers trust);
* ``server_cert`` / ``server_key`` -- issued to ``127.0.0.1``, ``::1`` and
  ``localhost``;
* ``client_cert`` / ``client_key`` -- a client certificate whose subject is
  ``CN=reader,O=changebus tests`` (what an mTLS principal matches);
* ``other_ca`` -- a second CA that signed nothing here (a wrong-CA check).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

CLIENT_SUBJECT = "CN=reader,O=changebus tests"


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    client_subject: str = CLIENT_SUBJECT


@pytest.fixture(scope="session")
def tls_ca() -> trustme.CA:
    return trustme.CA()


def write_tls_files(ca: trustme.CA, where: Path) -> TlsFiles:
    """Issue a server and a client certificate from ``ca`` and write them all to ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    server = ca.issue_cert("127.0.0.1", "::1", "localhost")
    client = ca.issue_cert(common_name="reader", organization_name="changebus tests")
    files = TlsFiles(
        ca=where / "ca.pem",
        server_cert=where / "server.pem",
        server_key=where / "server.key",
        client_cert=where / "client.pem",
        client_key=where / "client.key",
        other_ca=where / "other-ca.pem",
    )
    ca.cert_pem.write_to_path(str(files.ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    for extra in server.cert_chain_pems[1:]:
        extra.write_to_path(str(files.server_cert), append=True)
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    trustme.CA().cert_pem.write_to_path(str(files.other_ca))
    return files


@pytest.fixture
def tls_files(tls_ca: trustme.CA, tmp_path: Path) -> TlsFiles:
    return write_tls_files(tls_ca, tmp_path / "tls")
