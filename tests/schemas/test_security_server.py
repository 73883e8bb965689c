"""TLS and authentication in the server frame, through real servers and aiohttp clients.

The app is the frame's own (``server_app`` plus two routes) inside
``Server``; the relay and the bootstrap server get the same by passing
their ``[security]`` table.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from changebus.schemas import ConfigError
from changebus.schemas.security import (
    PrincipalConfig,
    SecurityConfig,
    TlsConfig,
    hash_token,
    principal_of,
    reload_all,
)
from changebus.schemas.server import Server, json_response, server_app

pytestmark = pytest.mark.usefixtures("no_blocking")

#: the ``tls_files`` fixture's type (tests/fix_tls.py, not a module mypy sees from here)
TlsFiles = Any

log = logging.getLogger("changebus.test.security")

READER_TOKEN = "r" * 43
ADMIN_TOKEN = "a" * 43


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def client_ctx(tls: TlsFiles, ca: Path | None = None, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca or tls.ca))
    if cert:
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
    return ctx


def security(tls: TlsFiles | None, **kw: Any) -> SecurityConfig:
    principals = [
        PrincipalConfig("reader", (hash_token(READER_TOKEN),), partitions=("p1",)),
        PrincipalConfig("admin", (hash_token(ADMIN_TOKEN),), scopes=("admin",)),
    ]
    if tls is not None and kw.get("client_ca"):
        principals.append(PrincipalConfig("cert-reader", cert_subjects=(tls.client_subject,)))
    tls_cfg = None
    if tls is not None:
        tls_cfg = TlsConfig(
            tls.server_cert,
            tls.server_key,
            tls.ca if kw.get("client_ca") else None,
            kw.get("client_cert", "optional"),
        )
    return SecurityConfig(tls=tls_cfg, principals=tuple(principals))


async def whoami(request: web.Request) -> web.Response:
    p = principal_of(request)
    partition = request.query.get("partition")
    if partition is not None:
        p.check_partition(partition)
    return json_response({"principal": p.name})


async def mutate(request: web.Request) -> web.Response:
    return json_response({"done": principal_of(request).name})


def make_server(sec: SecurityConfig | None, host: str = "127.0.0.1") -> Server:
    app = server_app("sectest", readiness=lambda: (True, {}), logger=log, security=sec)
    app.router.add_get("/v1/whoami", whoami)
    app.router.add_post("/v1/mutate", mutate)
    return Server(app, name="sectest", host=host, port=0, logger=log, security=sec)


@asynccontextmanager
async def running(sec: SecurityConfig | None) -> AsyncIterator[Server]:
    async with make_server(sec) as server:
        yield server


async def get(
    url: str, ctx: ssl.SSLContext | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url, ssl=ctx if ctx is not None else True, headers=headers) as resp,
    ):
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, body, resp.headers


async def test_tls_handshake_and_wrong_ca(tls_files: TlsFiles) -> None:
    async with running(security(tls_files)) as server:
        assert server.url.startswith("https://127.0.0.1:")
        status, body, _ = await get(
            f"{server.url}/v1/whoami", client_ctx(tls_files), bearer(READER_TOKEN)
        )
        assert (status, body) == (200, {"principal": "reader"})
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(f"{server.url}/healthz", client_ctx(tls_files, ca=tls_files.other_ca))
        # plain HTTP to the TLS port gets no answer
        with pytest.raises(aiohttp.ClientError):
            await get(server.url.replace("https", "http") + "/healthz")


async def test_no_or_wrong_token_is_401_json_with_www_authenticate(tls_files: TlsFiles) -> None:
    async with running(security(tls_files)) as server:
        ctx = client_ctx(tls_files)
        url = f"{server.url}/v1/whoami"
        for headers in (
            None,
            bearer("x" * 43),
            bearer("short"),
            {"Authorization": f"Basic {READER_TOKEN}"},
            {"Authorization": "Bearer"},
        ):
            status, body, h = await get(url, ctx, headers)
            assert status == 401, headers
            assert body["error"] == "unauthorized" and body["retriable"] is False
            assert h["WWW-Authenticate"].startswith("Bearer")
        # unknown routes are 401 too (no probing of what exists)
        status, body, _ = await get(f"{server.url}/v1/nothing", ctx)
        assert status == 401
        # the open endpoints answer without credentials (also with bad ones)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await get(f"{server.url}{path}", ctx))[0] == 200
            assert (await get(f"{server.url}{path}", ctx, bearer("x" * 43)))[0] == 200
        # the 401s were counted by the error middleware
        status, text, _ = await get(f"{server.url}/metrics", ctx)
        assert 'route="/v1/whoami",status="401"' in text


async def test_scopes_and_partitions_are_403(tls_files: TlsFiles) -> None:
    async with running(security(tls_files)) as server, aiohttp.ClientSession() as http:
        ctx = client_ctx(tls_files)
        url = f"{server.url}/v1/mutate"
        async with http.post(url, ssl=ctx, headers=bearer(READER_TOKEN)) as resp:
            assert resp.status == 403
            body = await resp.json()
            assert body["error"] == "forbidden" and "'reader'" in body["message"]
            assert "admin" in body["message"]
        async with http.post(url, ssl=ctx, headers=bearer(ADMIN_TOKEN)) as resp:
            assert resp.status == 200 and (await resp.json()) == {"done": "admin"}
        status, body, _ = await get(
            f"{server.url}/v1/whoami?partition=p2", ctx, bearer(READER_TOKEN)
        )
        assert status == 403 and "partition 'p2'" in body["message"]
        status, _, _ = await get(f"{server.url}/v1/whoami?partition=p2", ctx, bearer(ADMIN_TOKEN))
        assert status == 200


async def test_mtls_subject_authenticates(tls_files: TlsFiles) -> None:
    async with running(security(tls_files, client_ca=True)) as server:
        url = f"{server.url}/v1/whoami"
        status, body, _ = await get(url, client_ctx(tls_files, cert=True))
        assert (status, body) == (200, {"principal": "cert-reader"})
        # optional: a client without a certificate is let in, and needs a token
        status, body, _ = await get(url, client_ctx(tls_files))
        assert status == 401
        status, body, _ = await get(url, client_ctx(tls_files), bearer(READER_TOKEN))
        assert (status, body) == (200, {"principal": "reader"})
        # a token wins over the certificate
        status, body, _ = await get(url, client_ctx(tls_files, cert=True), bearer(ADMIN_TOKEN))
        assert (status, body) == (200, {"principal": "admin"})


async def test_mtls_unknown_subject_is_401(tls_files: TlsFiles, tls_ca: trustme.CA) -> None:
    other = tls_ca.issue_cert(common_name="stranger", organization_name="changebus tests")
    other.cert_chain_pems[0].write_to_path(str(tls_files.client_cert))
    other.private_key_pem.write_to_path(str(tls_files.client_key))
    async with running(security(tls_files, client_ca=True)) as server:
        status, body, _ = await get(f"{server.url}/v1/whoami", client_ctx(tls_files, cert=True))
        assert status == 401 and "subject" in body["message"]


async def test_required_client_cert_refuses_clients_without_one(tls_files: TlsFiles) -> None:
    async with running(security(tls_files, client_ca=True, client_cert="required")) as server:
        url = f"{server.url}/v1/whoami"
        with pytest.raises(aiohttp.ClientError):
            await get(url, client_ctx(tls_files), bearer(READER_TOKEN))
        status, body, _ = await get(url, client_ctx(tls_files, cert=True))
        assert (status, body) == (200, {"principal": "cert-reader"})


def write_server_cert(ca: trustme.CA, tls: TlsFiles) -> None:
    cert = ca.issue_cert("127.0.0.1", "::1", "localhost")
    cert.cert_chain_pems[0].write_to_path(str(tls.server_cert))
    cert.private_key_pem.write_to_path(str(tls.server_key))


async def http_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> int:
    """One keep-alive HTTP/1.1 request on an open connection, authenticated (an
    unauthenticated client's connection is closed after its answer); returns the status."""
    auth = f"Authorization: Bearer {READER_TOKEN}\r\n"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length"))
    await reader.readexactly(length)
    return int(lines[0].split()[1])


async def test_reload_swaps_the_certificate_for_new_connections_only(
    tls_files: TlsFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    new_ca = trustme.CA()
    new_ca_file = tmp_path / "new-ca.pem"
    new_ca.cert_pem.write_to_path(str(new_ca_file))
    async with running(security(tls_files)) as server:
        old_ctx = client_ctx(tls_files)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=old_ctx)
        try:
            assert await http_on(reader, writer, "/v1/whoami") == 200
            old_cert = writer.get_extra_info("peercert")
            # a bad file: the old certificate stays, the failure is logged
            tls_files.server_cert.write_text("not a certificate")
            with caplog.at_level(logging.WARNING, logger="changebus.server.tls"):
                assert await server.reload_tls() is False
            assert "previous certificate stays" in caplog.text
            assert (await get(f"{server.url}/healthz", old_ctx))[0] == 200
            # good files: new connections get the new certificate
            write_server_cert(new_ca, tls_files)
            assert await reload_all() == 1  # what SIGHUP runs
            assert (await get(f"{server.url}/healthz", client_ctx(tls_files, new_ca_file)))[
                0
            ] == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await get(f"{server.url}/healthz", old_ctx)
            # the connection opened before keeps working, with its certificate
            assert await http_on(reader, writer, "/v1/whoami") == 200
            assert writer.get_extra_info("peercert") == old_cert
        finally:
            writer.close()
    assert await reload_all() == 0  # a stopped server is no longer reloaded


async def test_reload_also_reloads_the_client_ca(tls_files: TlsFiles, tmp_path: Path) -> None:
    sec = security(tls_files, client_ca=True, client_cert="required")
    async with running(sec) as server:
        url = f"{server.url}/v1/whoami"
        assert (await get(url, client_ctx(tls_files, cert=True)))[0] == 200
        server_ca = tmp_path / "server-ca.pem"  # what clients trust: unchanged
        server_ca.write_bytes(tls_files.ca.read_bytes())
        tls_files.ca.write_bytes(tls_files.other_ca.read_bytes())  # the client CA changes
        assert await server.reload_tls()
        # the client certificate is not from the new client CA any more: refused
        with pytest.raises(aiohttp.ClientError):
            await get(url, client_ctx(tls_files, ca=server_ca, cert=True))


async def test_a_connection_from_before_a_client_ca_reload_is_not_trusted(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    """Dropping a client CA with a reload (revoking what it signed) left kept-alive
    connections, and sessions resumed from tickets, authenticating with certificates the
    old CA had checked (review). Such a connection gets a retriable 503 and is closed;
    no session tickets are issued when client certificates are checked."""
    sec = security(tls_files, client_ca=True, client_cert="required")
    async with running(sec) as server:
        assert server.tls is not None and server.tls.context.num_tickets == 0
        url = f"{server.url}/v1/whoami"
        server_ca = tmp_path / "server-ca.pem"
        server_ca.write_bytes(tls_files.ca.read_bytes())
        ctx = client_ctx(tls_files, ca=server_ca, cert=True)
        async with aiohttp.ClientSession() as http:
            async with http.get(url, ssl=ctx) as resp:
                assert resp.status == 200
            tls_files.ca.write_bytes(tls_files.other_ca.read_bytes())  # the client CA changes
            assert await server.reload_tls()
            async with http.get(url, ssl=ctx) as resp:  # (the same kept-alive connection)
                body = await resp.json()
                assert resp.status == 503 and body["retriable"] is True, body
                assert resp.headers.get("Connection", "").lower() == "close"
            with pytest.raises(aiohttp.ClientError):  # a new connection: the new CA decides
                async with http.get(url, ssl=ctx) as resp:
                    await resp.read()


def test_non_loopback_bind_refused_without_security(tls_files: TlsFiles) -> None:
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="non-loopback"):
            make_server(SecurityConfig(), host)
        make_server(SecurityConfig(allow_insecure=True), host)
        make_server(security(tls_files), host)
    with pytest.raises(ConfigError, match="TLS"):
        make_server(security(None), "0.0.0.0")


async def test_bad_tls_files_are_config_errors(tls_files: TlsFiles, tmp_path: Path) -> None:
    missing = TlsConfig(tmp_path / "none.pem", tls_files.server_key)
    server = make_server(SecurityConfig(tls=missing))
    with pytest.raises(ConfigError, match=r"none\.pem"):
        await server.start()
    wrong_key = TlsConfig(tls_files.server_cert, tls_files.client_key)
    with pytest.raises(ConfigError, match="cannot load") as info:
        await make_server(SecurityConfig(tls=wrong_key)).start()
    assert "PRIVATE KEY" not in info.value.message
    # nothing was left listening
    assert server.tls is None


async def test_logs_name_the_principal_never_the_token(
    tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "w" * 43
    with caplog.at_level(logging.DEBUG, logger="changebus"):
        async with running(security(tls_files)) as server, aiohttp.ClientSession() as http:
            ctx = client_ctx(tls_files)
            await get(f"{server.url}/v1/whoami", ctx, bearer(wrong))
            await get(f"{server.url}/v1/whoami?partition=p9", ctx, bearer(READER_TOKEN))
            async with http.post(
                f"{server.url}/v1/mutate", ssl=ctx, headers=bearer(READER_TOKEN)
            ) as resp:
                assert resp.status == 403
            await get(f"{server.url}/v1/whoami", ctx, bearer(ADMIN_TOKEN))
    text = caplog.text
    assert "unknown bearer token" in text
    assert "principal reader" in text and "p9" in text
    assert "by principal admin" in text
    for token in (wrong, READER_TOKEN, ADMIN_TOKEN):
        assert token not in text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(r.name == "changebus.server.auth" for r in warnings)


async def test_refusals_are_logged_rate_limited(
    tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    async with running(security(tls_files)) as server:
        ctx = client_ctx(tls_files)
        with caplog.at_level(logging.WARNING, logger="changebus.server.auth"):
            for _ in range(20):
                assert (await get(f"{server.url}/v1/whoami", ctx))[0] == 401
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


async def test_without_principals_the_server_is_open(tls_files: TlsFiles) -> None:
    sec = SecurityConfig(tls=TlsConfig(tls_files.server_cert, tls_files.server_key))
    async with running(sec) as server:
        status, body, _ = await get(f"{server.url}/v1/whoami", client_ctx(tls_files))
        assert (status, body) == (200, {"principal": "anonymous"})
    async with running(None) as server:
        assert server.url.startswith("http://")
        status, body, _ = await get(f"{server.url}/v1/whoami")
        assert (status, body) == (200, {"principal": "anonymous"})


async def test_a_token_that_is_not_utf8_is_a_401_not_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aiohttp hands header bytes that are not UTF-8 over as surrogates: hashing the
    token raised, a 500 (retriable) with a traceback logged for each such request."""
    with caplog.at_level(logging.INFO, logger="changebus"):
        async with running(security(None)) as server:
            for token in (b"\xff" * 43, "\u00e9".encode() * 43):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(
                    b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    + token
                    + b"\r\nConnection: close\r\n\r\n"
                )
                answer = await reader.read()
                writer.close()
                assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_unauthenticated_clients_keep_no_connection_open() -> None:
    """A 401 (or an open endpoint's answer to a client without credentials) left the
    connection kept alive for 75 s: a few hundred such sockets from one address held all
    of its connection slots without ever authenticating (review). They are closed."""
    async with running(security(None)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for path in ("/v1/whoami", "/healthz"):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                await writer.drain()
                async with asyncio.timeout(5):
                    answer = await reader.read(-1)  # (to EOF: the server closes)
            finally:
                writer.close()
            head = answer.split(b"\r\n\r\n", 1)[0].lower()
            assert head.startswith(b"http/1.1 401" if "whoami" in path else b"http/1.1 200")
            assert b"connection: close" in head
        # an authenticated client keeps its connection
        status, _, h = await get(f"{server.url}/v1/whoami", None, bearer(READER_TOKEN))
        assert status == 200 and h.get("Connection", "").lower() != "close"


def _whoami_over(
    port: int, ctx: ssl.SSLContext, session: ssl.SSLSession | None
) -> tuple[int, ssl.SSLSession | None, bool]:
    """GET /v1/whoami on a new TLS connection (resuming ``session`` when given): the status,
    the connection's session and whether it was resumed."""
    import socket

    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost", session=session) as tls,
    ):
        tls.sendall(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
        return int(data.split(b" ", 2)[1]), tls.session, bool(tls.session_reused)


async def test_a_tls12_session_resumed_past_a_client_ca_reload_is_not_trusted(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    """TLS 1.2 resumes sessions from the listening context's cache (no tickets needed): a
    resumed handshake skips the chain check and restores the certificate the old CA had
    checked, and the SNI callback put it on the new context, so the retired-context
    check never fired; a CA dropped by a reload kept working for 300 s (review)."""
    sec = security(tls_files, client_ca=True, client_cert="required")
    async with running(sec) as server:
        port = int(server.url.rsplit(":", 1)[1])
        server_ca = tmp_path / "server-ca.pem"
        server_ca.write_bytes(tls_files.ca.read_bytes())
        ctx = client_ctx(tls_files, ca=server_ca, cert=True)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        status, session, _ = await asyncio.to_thread(_whoami_over, port, ctx, None)
        assert status == 200 and session is not None
        # (resumption works before a reload: the check below is not vacuous)
        status, _, resumed = await asyncio.to_thread(_whoami_over, port, ctx, session)
        assert status == 200 and resumed
        tls_files.ca.write_bytes(tls_files.other_ca.read_bytes())  # the client CA changes
        await asyncio.sleep(1.1)  # (sessions are stamped in whole seconds)
        assert await server.reload_tls()
        try:
            status, _, resumed = await asyncio.to_thread(_whoami_over, port, ctx, session)
        except (ssl.SSLError, ConnectionError):
            return  # refused at the handshake: as good
        assert status == 503, (status, resumed)
        # and the session is gone from the server's cache: not resumed (and so refused at
        # the handshake by the new client CA) rather than a 503 again and again
        try:
            status, _, resumed = await asyncio.to_thread(_whoami_over, port, ctx, session)
        except (ssl.SSLError, ConnectionError):
            return
        assert not resumed and status != 200, (status, resumed)
