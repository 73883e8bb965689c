"""TLS and bearer tokens on the client side: ClientAuth, the consumer, ``tail``, relay chaining.

The servers are real relays served over HTTPS by the frame's ``Server`` (its
``ssl_context``) with trustme certificates (``tls_files``), and a tiny
test-local middleware that wants ``Authorization: Bearer <token>`` (the
product's authentication middleware is tested on the server side).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
import yarl
from aiohttp import web

from changebus.client import (
    ClientAuth,
    Consumer,
    ConsumerConfig,
    RelayUnavailableError,
    SyncConsumer,
    open_session,
)
from changebus.client.spark._options import SourceOptions
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay.chain import ChainConfig
from changebus.schemas import ConfigError, ForbiddenError, TransportError, UnauthorizedError
from changebus.schemas.config import load_config, redacted
from changebus.schemas.security import PrincipalConfig, SecurityConfig, TlsConfig, hash_token
from stub_http import serve_routes

#: fix_tls.TlsFiles (fix_tls is not on mypy's path: the fixture is typed loosely here)
TlsFiles = Any

pytestmark = pytest.mark.usefixtures("no_blocking")

TOKEN = "t0ken-" + "x" * 40
LIMITED = "limited-" + "w" * 40  # a known principal without the partition: 403
PART = "syn"
SYNTHETIC: dict[str, Any] = {
    "windows_per_s": 0,
    "max_windows": 30,
    "events_per_window": 3,
    "row_bytes": 60,
    "tables": 2,
    "keys": 1000,
}
ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("tests.tls")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def recorder(seen: list[str]) -> Any:
    """Records the Authorization header of every request that passed authentication."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        return await handler(request)

    return record


def server_tls(cert: Path, key: Path, client_ca: Path | None = None) -> TlsConfig:
    """The relay's ``[security.tls]``: client certificates required when ``client_ca`` is given."""
    return TlsConfig(
        cert_file=cert,
        key_file=key,
        client_ca_file=client_ca,
        client_cert="required" if client_ca is not None else "optional",
    )


def security(tls: TlsConfig, token: str) -> SecurityConfig:
    """TLS, and with ``token``: principal ``reader`` (it) and ``limited`` (another partition)."""
    principals: tuple[PrincipalConfig, ...] = ()
    if token:
        principals = (
            PrincipalConfig("reader", tokens=(hash_token(token),)),
            PrincipalConfig("limited", tokens=(hash_token(LIMITED),), partitions=("other",)),
        )
    return SecurityConfig(tls=tls, principals=principals)


def relay_config(data_dir: Path, fetcher: FetcherConfig, **kw: Any) -> RelayConfig:
    return RelayConfig(
        data_dir=data_dir,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(PART, 1, capacity_bytes=4 << 20, fetcher=fetcher),),
        flush_interval_s=0,
        **kw,
    )


@asynccontextmanager
async def https_relay(
    cfg: RelayConfig,
    tls: TlsConfig,
    *,
    token: str = "",
    seen: list[str] | None = None,
    windows: int = 0,
) -> AsyncIterator[Relay]:
    """``cfg``'s relay served over HTTPS (the real ``[security]``: TLS, and principals with ``token``)."""
    relay = Relay(dataclasses.replace(cfg, security=security(tls, token)))
    if seen is not None:
        relay.server.app.middlewares.append(recorder(seen))
    async with relay:
        while relay.hosts[PART].buffer.meta.windows < windows:
            await asyncio.sleep(0.01)
        yield relay


def synthetic(data_dir: Path) -> RelayConfig:
    return relay_config(data_dir, FetcherConfig("synthetic", SYNTHETIC))


async def read_windows(config: ConsumerConfig, n: int, session: Any = None) -> list[int]:
    scns = []
    async with Consumer(config, session=session) as consumer:
        async for window in consumer:
            scns.append(window.scn)
            if len(scns) == n:
                break
    return scns


def consumer_config(url: str, auth: ClientAuth, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(url,), partition=PART, start="earliest", wait_s=1.0, auth=auth, **kw
    )


# ---- ClientAuth itself ------------------------------------------------------------------------


def test_client_auth_keeps_the_token_secret(
    tls_files: TlsFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = ClientAuth(ca_file=tls_files.ca, token=TOKEN)
    assert TOKEN not in repr(auth) and TOKEN not in str(redacted(auth))
    assert redacted(auth)["token"] == "***"
    assert auth.headers() == {"Authorization": f"Bearer {TOKEN}"}
    ctx = auth.ssl_context()
    assert ctx is not None and ctx is auth.ssl_context()  # built once
    copy = pickle.loads(pickle.dumps(auth))  # the context is not pickled; built again
    assert copy == auth and copy.ssl_context() is not ctx
    assert ClientAuth().ssl_context() is None and ClientAuth().headers() == {}
    assert not ClientAuth().enabled and auth.enabled
    loose = ClientAuth(ca_file=tls_files.ca, check_hostname=False).ssl_context()
    assert loose is not None and not loose.check_hostname
    assert loose.verify_mode == ssl.CERT_REQUIRED  # the chain is still verified

    secret_file = tmp_path / "token"
    secret_file.write_text(f"  {TOKEN}\n")
    assert ClientAuth(token_file=secret_file).headers() == {"Authorization": f"Bearer {TOKEN}"}
    bad = tmp_path / "bad-token"
    bad.write_text("two words\n")
    for auth_file in (tmp_path / "missing", bad):
        with pytest.raises(ConfigError) as err:
            ClientAuth(token_file=auth_file).headers()
        assert str(auth_file) in err.value.message and "two" not in err.value.message
    with pytest.raises(ConfigError, match="ca_file"):
        ClientAuth(ca_file=tmp_path / "missing").ssl_context()
    with pytest.raises(ConfigError, match="cert_file"):
        ClientAuth(cert_file=tls_files.ca, key_file=tls_files.server_key).ssl_context()
    with pytest.raises(ConfigError, match="key_file needs cert_file"):
        ClientAuth(key_file=tls_files.client_key)
    with pytest.raises(ConfigError, match="not both"):
        ClientAuth(token=TOKEN, token_file=secret_file)
    with pytest.raises(ConfigError) as err:
        ClientAuth(token="has space")
    assert "has space" not in err.value.message
    # servers refuse tokens under 32 characters: one passed --check silently, then got
    # 401s (a warning: a server without principals, or a proxy, may take it)
    with caplog.at_level(logging.WARNING, logger="changebus.security"):
        ClientAuth(token="shortsecretXYZ")
    assert "shorter than 32" in caplog.text and "shortsecretXYZ" not in caplog.text


def test_upstream_tables_and_option_overrides(tls_files: TlsFiles, tmp_path: Path) -> None:
    toml = tmp_path / "relay.toml"
    toml.write_text(f'[upstream]\nca_file = "{tls_files.ca}"\ncheck_hostname = false\n')
    cfg = load_config(
        RelayConfig,
        toml,
        env={"CHANGEBUS_RELAY_UPSTREAM__TOKEN": TOKEN},
        env_prefix="CHANGEBUS_RELAY_",
    )
    assert cfg.upstream == ClientAuth(ca_file=tls_files.ca, check_hostname=False, token=TOKEN)
    assert TOKEN not in str(redacted(cfg))
    # the relay fetcher's own options refine the [upstream] default
    token_file = tmp_path / "token"
    chain = ChainConfig(upstream=("https://x:1",), token_file=token_file, check_hostname=True)
    auth = chain.client_auth(cfg.upstream)
    assert auth == ClientAuth(ca_file=tls_files.ca, token_file=token_file)
    assert ChainConfig(upstream=("https://x:1",)).client_auth(cfg.upstream) is cfg.upstream
    # the relay hands its [upstream] to its relay fetchers (in process), to no other kind
    from changebus.relay._daemon import with_upstream

    chained = PartitionConfig(PART, 1, fetcher=FetcherConfig("relay", {"upstream": ["https://x"]}))
    assert with_upstream(chained, cfg.upstream).fetcher.options["auth"] is cfg.upstream
    assert with_upstream(chained, ClientAuth()) is chained
    other = PartitionConfig(PART, 1, fetcher=FetcherConfig("synthetic", {}))
    assert with_upstream(other, cfg.upstream) is other


def test_spark_options_carry_the_auth_to_the_executors(tls_files: TlsFiles) -> None:
    opts = SourceOptions.parse(
        {
            "relays": "https://127.0.0.1:1",
            "tls.caFile": str(tls_files.ca),
            "tls.certFile": str(tls_files.client_cert),
            "tls.keyFile": str(tls_files.client_key),
            "tls.checkHostname": "false",
            "tokenFile": "/run/secrets/changebus-token",
        }
    )
    assert opts.auth == ClientAuth(
        ca_file=tls_files.ca,
        cert_file=tls_files.client_cert,
        key_file=tls_files.client_key,
        check_hostname=False,
        token_file=Path("/run/secrets/changebus-token"),
    )
    with_token = SourceOptions.parse({"relays": "https://h:1", "token": TOKEN})
    assert TOKEN not in repr(with_token)
    shipped = pickle.loads(pickle.dumps(with_token))  # as in a Spark task
    assert shipped.auth.headers() == {"Authorization": f"Bearer {TOKEN}"}
    assert SourceOptions.parse({"relays": "http://h:1"}).auth == ClientAuth()
    with pytest.raises(ConfigError, match="not both"):
        SourceOptions.parse({"relays": "https://h:1", "token": TOKEN, "tokenFile": "/x"})
    with pytest.raises(ConfigError, match="key_file needs cert_file"):
        SourceOptions.parse({"relays": "https://h:1", "tls.keyFile": "/x"})


# ---- a consumer over HTTPS --------------------------------------------------------------------


async def test_consumer_with_ca_client_cert_and_token(tls_files: TlsFiles, tmp_path: Path) -> None:
    """mTLS server (client certificate required) + bearer token: every request carries both."""
    ctx = server_tls(tls_files.server_cert, tls_files.server_key, client_ca=tls_files.ca)
    seen: list[str] = []
    async with https_relay(synthetic(tmp_path / "r"), ctx, token=TOKEN, seen=seen, windows=5) as r:
        assert r.url.startswith("https://127.0.0.1:")
        auth = ClientAuth(
            ca_file=tls_files.ca,
            cert_file=tls_files.client_cert,
            key_file=tls_files.client_key,
            token=TOKEN,
        )
        scns = await read_windows(consumer_config(r.url, auth), 5)
        assert len(scns) == 5 and scns == sorted(scns)
        assert seen and all(h == f"Bearer {TOKEN}" for h in seen)
        # the same through the name localhost (the certificate lists it)
        local = r.url.replace("127.0.0.1", "localhost")
        assert len(await read_windows(consumer_config(local, auth), 2)) == 2

        # without a token: 401 stops the consumer at once, naming the server, not a token
        no_token = dataclasses.replace(auth, token="")
        with pytest.raises(UnauthorizedError) as err:
            await asyncio.wait_for(read_windows(consumer_config(r.url, no_token), 1), 20)
        assert r.url in err.value.message and TOKEN not in err.value.message
        wrong = dataclasses.replace(auth, token="y" * 40)
        with pytest.raises(UnauthorizedError):
            await asyncio.wait_for(read_windows(consumer_config(r.url, wrong), 1), 20)
        limited = dataclasses.replace(auth, token=LIMITED)
        with pytest.raises(ForbiddenError) as ferr:
            await asyncio.wait_for(read_windows(consumer_config(r.url, limited), 1), 20)
        assert r.url in ferr.value.message and LIMITED not in ferr.value.message

        # without the client certificate the server ends the connection; TLS 1.3 tells the
        # client no more than "disconnected", so it counts as a failed attempt
        no_cert = dataclasses.replace(auth, cert_file=None, key_file=None)
        config = consumer_config(r.url, no_cert, max_attempts=2, backoff_max_s=0.1)
        with pytest.raises(RelayUnavailableError):
            await asyncio.wait_for(read_windows(config, 1), 20)


async def test_wrong_ca_and_wrong_name_fail_clearly(
    tls_files: TlsFiles, tls_ca: trustme.CA, tmp_path: Path
) -> None:
    """Verification failures stop the consumer with a non-retriable, explicit error."""
    other_name = tls_ca.issue_cert("relay.example.invalid")
    cert, key = tmp_path / "other.pem", tmp_path / "other.key"
    other_name.cert_chain_pems[0].write_to_path(str(cert))
    other_name.private_key_pem.write_to_path(str(key))
    async with https_relay(synthetic(tmp_path / "r"), server_tls(cert, key), windows=3) as r:
        wrong_ca = ClientAuth(ca_file=tls_files.other_ca)
        with pytest.raises(TransportError) as err:
            await asyncio.wait_for(read_windows(consumer_config(r.url, wrong_ca), 1), 20)
        assert not err.value.retriable
        assert r.url in err.value.message and "certificate" in err.value.message
        # signed by the right CA, but for another name
        right_ca = ClientAuth(ca_file=tls_files.ca)
        with pytest.raises(TransportError) as err:
            await asyncio.wait_for(read_windows(consumer_config(r.url, right_ca), 1), 20)
        assert not err.value.retriable and "certificate" in err.value.message
        # ... accepted when the name check is off (the chain is still verified)
        no_name = ClientAuth(ca_file=tls_files.ca, check_hostname=False)
        assert len(await read_windows(consumer_config(r.url, no_name), 2)) == 2
        loose_wrong = ClientAuth(ca_file=tls_files.other_ca, check_hostname=False)
        with pytest.raises(TransportError):
            await asyncio.wait_for(read_windows(consumer_config(r.url, loose_wrong), 1), 20)
        # a plain session (system store) does not know the test CA either
        async with await open_session(None) as plain:
            config = consumer_config(r.url, ClientAuth())
            with pytest.raises(TransportError):
                await asyncio.wait_for(read_windows(config, 1, plain), 20)


def test_sync_consumer_and_tail_over_https(tls_files: TlsFiles, tmp_path: Path) -> None:
    """SyncConsumer, then ``changebus tail --ca-file --token-file`` (a subprocess)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    ctx = server_tls(tls_files.server_cert, tls_files.server_key)

    async def main() -> None:
        async with https_relay(synthetic(tmp_path / "r"), ctx, token=TOKEN, windows=10) as r:
            auth = ClientAuth(ca_file=tls_files.ca, token_file=token_file)
            got = await asyncio.to_thread(_sync_read, consumer_config(r.url, auth), 3)
            assert len(got) == 3
            base: tuple[str, ...] = ("-m", "changebus.schemas", "tail", "--relay", r.url)
            base = (
                *base,
                "--partition",
                PART,
                "--from",
                "earliest",
                "--limit",
                "5",
                "--ca-file",
                str(tls_files.ca),
            )
            env = {**os.environ, "PYTHONPATH": _pythonpath()}
            env.pop("CHANGEBUS_TOKEN", None)
            out, err, code = await _run(*base, "--token-file", str(token_file), env=env)
            assert code == 0, err
            assert len(out.splitlines()) == 5
            # the token from the environment works too; none at all: 401, status 3
            out, err, code = await _run(*base, env={**env, "CHANGEBUS_TOKEN": TOKEN})
            assert code == 0 and len(out.splitlines()) == 5, err
            out, err, code = await _run(*base, env=env)
            assert code == 3, err
            assert "credentials" in err, err
            assert r.url in err and TOKEN not in err

    asyncio.run(main())


def _sync_read(config: ConsumerConfig, n: int) -> list[int]:
    scns = []
    with SyncConsumer(config) as consumer:
        for window in consumer:
            scns.append(window.scn)
            if len(scns) == n:
                break
    return scns


def _pythonpath() -> str:
    roots = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
    return os.pathsep.join(str(ROOT / s) for s in roots)


async def _run(*args: str, env: dict[str, str]) -> tuple[str, str, int | None]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return out.decode(), err.decode(), proc.returncode


# ---- relay chaining over HTTPS ----------------------------------------------------------------


async def test_relay_follows_an_https_upstream_with_its_upstream_table(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    ctx = server_tls(tls_files.server_cert, tls_files.server_key, client_ca=tls_files.ca)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    async with https_relay(synthetic(tmp_path / "up"), ctx, token=TOKEN, windows=30) as up:
        upstream = ClientAuth(
            ca_file=tls_files.ca,
            cert_file=tls_files.client_cert,
            key_file=tls_files.client_key,
            token_file=token_file,
        )
        options = {"upstream": [up.url], "wait_s": 1.0, "backoff_max_s": 0.2}
        follower_cfg = relay_config(
            tmp_path / "down", FetcherConfig("relay", options), upstream=upstream
        )
        async with Relay(follower_cfg) as down:
            deadline = asyncio.get_running_loop().time() + 20
            while down.hosts[PART].buffer.meta.last_scn < up.hosts[PART].buffer.meta.last_scn:
                assert asyncio.get_running_loop().time() < deadline, down.hosts[PART].last_error
                await asyncio.sleep(0.02)
        # a partition's own options override the table: a wrong token fails the chain,
        # not retried (the partition says why, without the token)
        bad = {**options, "token": "z" * 40}
        cfg = relay_config(tmp_path / "bad", FetcherConfig("relay", bad), upstream=upstream)
        async with Relay(cfg) as failed:
            host = failed.hosts[PART]
            deadline = asyncio.get_running_loop().time() + 20
            while host.state != "failed":
                assert asyncio.get_running_loop().time() < deadline, host.state
                await asyncio.sleep(0.02)
            assert up.url in host.last_error and "unknown bearer token" in host.last_error
            assert "z" * 40 not in host.last_error


# ---- a bootstrap server reading an HTTPS relay ---------------------------------------------------


async def test_bootstrap_server_reads_its_relay_over_https(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    from changebus.bootstrap import (
        BootstrapConfig,
        BootstrapServer,
        HttpConfig as BootHttp,
        StoreConfig,
    )

    toml = tmp_path / "bootstrap.toml"
    toml.write_text(f'[upstream]\nca_file = "{tls_files.ca}"\n')
    ctx = server_tls(tls_files.server_cert, tls_files.server_key)
    async with https_relay(synthetic(tmp_path / "r"), ctx, token=TOKEN, windows=30) as r:
        cfg = load_config(
            BootstrapConfig,
            toml,
            env={"CHANGEBUS_BOOTSTRAP_UPSTREAM__TOKEN": TOKEN},
            env_prefix="CHANGEBUS_BOOTSTRAP_",
            overrides=[f'relays=["{r.url}"]', f'partitions=["{PART}"]'],
        )
        assert cfg.upstream == ClientAuth(ca_file=tls_files.ca, token=TOKEN)
        cfg = dataclasses.replace(
            cfg,
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootHttp(port=0),
        )
        last = r.hosts[PART].buffer.meta.last_scn
        async with BootstrapServer(cfg) as boot:
            worker = boot.service.workers[PART]
            deadline = asyncio.get_running_loop().time() + 30
            while worker.producer_scn < last:
                assert asyncio.get_running_loop().time() < deadline, worker.last_error
                await asyncio.sleep(0.05)


# ---- the Spark source over HTTPS --------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_spark_batch_read_over_https_with_a_token_file(
    spark: Any, tls_files: TlsFiles, tmp_path: Path
) -> None:
    """Driver and executors (other processes) both connect with tls.caFile and tokenFile."""
    import threading

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-https-relay", daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    ctx = server_tls(tls_files.server_cert, tls_files.server_key)
    cm = https_relay(synthetic(tmp_path / "r"), ctx, token=TOKEN, windows=30)
    relay = call(cm.__aenter__())
    try:
        while relay.hosts[PART].state != "finished":
            call(asyncio.sleep(0.05))
        auth = ClientAuth(ca_file=tls_files.ca, token_file=token_file)
        events = 0
        with SyncConsumer(consumer_config(relay.url, auth, follow=False)) as consumer:
            for window in consumer:
                events += len(window.events)
                if window.scn >= relay.hosts[PART].buffer.meta.last_scn:
                    break

        def read(**options: str) -> Any:
            reader = spark.read.format("changebus").option("relays", relay.url)
            reader = reader.option("partitions", PART).option("numPartitions", "2")
            for key, value in options.items():
                reader = reader.option(key, value)
            return reader.load()

        df = read(**{"tls.caFile": str(tls_files.ca), "tokenFile": str(token_file)})
        assert df.count() == events > 0
        with pytest.raises(Exception, match=r"UnauthorizedError: .*credentials required"):
            read(**{"tls.caFile": str(tls_files.ca)}).count()
    finally:
        call(cm.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def test_the_token_never_goes_in_clear_to_another_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member URL read from ZooKeeper (anyone who may write there chooses it) or a
    misconfigured relays list with plain http:// got the bearer token in clear (found by
    review). The token goes over https or to a loopback address only."""
    import functools
    import socket

    from aiohttp.abc import AbstractResolver, ResolveResult

    from changebus.client._http import _may_carry_token

    seen: list[str | None] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({})

    class ToLoopback(AbstractResolver):  # "relay.test" and any name: this host
        async def resolve(
            self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
        ) -> list[ResolveResult]:
            return [
                ResolveResult(
                    hostname=host,
                    host="127.0.0.1",
                    port=port,
                    family=socket.AF_INET,
                    proto=0,
                    flags=0,
                )
            ]

        async def close(self) -> None:
            return None

    monkeypatch.setattr(
        aiohttp, "TCPConnector", functools.partial(aiohttp.TCPConnector, resolver=ToLoopback())
    )
    async with serve_routes({"/v1/status": echo}) as base:
        port = yarl.URL(base).port
        async with await open_session(ClientAuth(token=TOKEN)) as session:
            for url in (f"http://127.0.0.1:{port}", f"http://relay.test:{port}"):
                async with session.get(f"{url}/v1/status") as resp:
                    assert resp.status == 200
    assert seen == [f"Bearer {TOKEN}", None]
    assert _may_carry_token(yarl.URL("https://relay.example:8470"))
    assert _may_carry_token(yarl.URL("http://[::1]:8470"))
    assert not _may_carry_token(yarl.URL("http://10.0.0.5:8470"))
