"""changebus.schemas.security without a server: the [security] config, principals, tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from changebus.schemas import ConfigError, ForbiddenError, UnauthorizedError
from changebus.schemas._cli import main
from changebus.schemas.config import load_config
from changebus.schemas.security import (
    ANONYMOUS,
    PUBLIC,
    Principal,
    PrincipalConfig,
    SecurityConfig,
    TlsConfig,
    check_bind,
    hash_token,
    new_token,
    parse_subject,
)

TOKEN = "t" * 40
HASH = hash_token(TOKEN)


def test_security_table_loads_from_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text(
        f"""
allow_insecure = false
open_endpoints = ["/healthz"]
[tls]
cert_file = "/etc/cb/relay.pem"
key_file = "/etc/cb/relay.key"
client_ca_file = "/etc/cb/ca.pem"
client_cert = "required"
[[principals]]
name = "orders-indexer"
tokens = ["{HASH}"]
partitions = ["pgmain"]
sources = ["public.orders", "public.lines"]
[[principals]]
name = "ops"
cert_subjects = ["CN=ops,O=Acme"]
scopes = ["admin"]
"""
    )
    sec = load_config(SecurityConfig, cfg)
    assert sec.tls == TlsConfig(
        Path("/etc/cb/relay.pem"), Path("/etc/cb/relay.key"), Path("/etc/cb/ca.pem"), "required"
    )
    assert sec.open_endpoints == ("/healthz",)
    assert [p.name for p in sec.principals] == ["orders-indexer", "ops"]
    assert sec.principals[0].tokens == (HASH,)
    assert sec.principals[0].sources == ("public.orders", "public.lines")
    assert sec.principals[1].partitions == ("*",)
    assert sec.principals[1].scopes == ("admin",)
    assert sec.authenticates
    assert not SecurityConfig().authenticates
    # an empty client_ca_file (TOML has no null) means no mTLS
    assert TlsConfig(Path("a"), Path("b"), Path("")).client_ca_file is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "x"}, "give tokens"),
        ({"name": "x", "tokens": (TOKEN,)}, "sha256:"),
        ({"name": "x", "tokens": ("sha256:abc",)}, "sha256:"),
        ({"name": "x", "tokens": (HASH,), "scopes": ("write",)}, "unknown scope"),
        ({"name": "x", "cert_subjects": ("FOO=bar",)}, "unknown attribute"),
        ({"name": "x", "cert_subjects": ("CN",)}, "TYPE=value"),
        ({"name": " ", "tokens": (HASH,)}, "needs a name"),
    ],
)
def test_bad_principals_are_refused_without_echoing_tokens(
    kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        PrincipalConfig(**kwargs)  # type: ignore[arg-type]
    assert TOKEN not in info.value.message


def test_security_config_consistency() -> None:
    with pytest.raises(ConfigError, match="client_ca_file"):
        TlsConfig(Path("c"), Path("k"), client_cert="required")
    with pytest.raises(ConfigError, match="cert_file and key_file"):
        TlsConfig()
    with pytest.raises(ConfigError, match="client_ca_file"):
        SecurityConfig(principals=(PrincipalConfig("a", cert_subjects=("CN=a",)),))
    with pytest.raises(ConfigError, match="unique"):
        SecurityConfig(principals=(PrincipalConfig("a", (HASH,)), PrincipalConfig("a", (HASH,))))
    with pytest.raises(ConfigError, match="share a token"):
        SecurityConfig(principals=(PrincipalConfig("a", (HASH,)), PrincipalConfig("b", (HASH,))))
    with pytest.raises(ConfigError, match="must start with /"):
        SecurityConfig(open_endpoints=("healthz",))


def test_non_loopback_bind_needs_tls_and_principals_or_allow_insecure() -> None:
    open_ = SecurityConfig()
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        check_bind(host, open_)
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "relay.example.com"):
        with pytest.raises(ConfigError) as info:
            check_bind(host, open_)
        msg = info.value.message
        assert "non-loopback" in msg and "allow_insecure" in msg
        assert "TLS" in msg and "authentication" in msg
        check_bind(host, SecurityConfig(allow_insecure=True))
    tls = TlsConfig(Path("c"), Path("k"))
    principals = (PrincipalConfig("a", (HASH,)),)
    with pytest.raises(ConfigError, match="without TLS") as info:
        check_bind("0.0.0.0", SecurityConfig(principals=principals))
    assert "authentication" not in info.value.message
    with pytest.raises(ConfigError, match="without authentication"):
        check_bind("0.0.0.0", SecurityConfig(tls=tls))
    check_bind("0.0.0.0", SecurityConfig(tls=tls, principals=principals))


def test_principal_grants() -> None:
    p = Principal.from_grant("r", ["a"], ["s.x", "s.y"], ["read"])
    assert p.allows_partition("a") and not p.allows_partition("b")
    p.check_partition("a")
    with pytest.raises(ForbiddenError, match="'r' may not read partition 'b'"):
        p.check_partition("b")
    p.check_scope("read")
    with pytest.raises(ForbiddenError, match="scope 'admin'"):
        p.check_scope("admin")
    assert p.allows_source("s.x") and not p.allows_source("s.z")
    # nothing asked: the granted ones among those available
    assert p.restrict_sources(None, ["s.x", "s.z"]) == frozenset({"s.x"})
    assert p.restrict_sources(None, ["s.z"]) == frozenset()
    # or a test of a name: asked of the granted names only (not of every source there is)
    asked: list[str] = []

    def known(name: str) -> bool:
        asked.append(name)
        return name in {"s.x", "s.z"}

    assert p.restrict_sources(None, known) == frozenset({"s.x"})
    assert sorted(asked) == sorted(p.sources or ())
    # asked within the grant: the request stands
    assert p.restrict_sources(["s.y"], ["s.x", "s.y"]) is None
    assert p.restrict_sources([], ["s.x"]) is None
    with pytest.raises(ForbiddenError, match=r"s\.z"):
        p.restrict_sources(["s.x", "s.z"], ["s.x", "s.z"])
    # "*" grants everything; admin implies read
    every = Principal.from_grant("adm", ["*"], ["*"], ["admin"])
    assert every.partitions is None and every.sources is None
    assert every.restrict_sources(None, ["q"]) is None
    assert every.restrict_sources(["q"], []) is None
    every.check_scope("read")
    every.check_scope("admin")
    assert ANONYMOUS.has_scope("admin") and ANONYMOUS.restrict_sources(None, ["x"]) is None
    assert PUBLIC.has_scope("read") and not PUBLIC.has_scope("admin")


def test_subjects_parse_as_attribute_sets() -> None:
    assert parse_subject("CN=reader, O=changebus tests") == {
        ("commonName", "reader"),
        ("organizationName", "changebus tests"),
    }
    assert parse_subject(r"CN=a\,b+OU=x,emailAddress=a@b") == {
        ("commonName", "a,b"),
        ("organizationalUnitName", "x"),
        ("emailAddress", "a@b"),
    }
    assert parse_subject(r"cn=\41b") == {("commonName", "Ab")}


def test_tokens() -> None:
    token = new_token()
    assert len(token) >= 43 and token != new_token()
    assert hash_token(token).startswith("sha256:") and len(hash_token(token)) == 71
    with pytest.raises(ConfigError, match="at least 32"):
        hash_token("short")


def test_token_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    assert main(["token", "new", "--name", "orders"]) == 0
    lines = capsys.readouterr().out.splitlines()
    token = lines[0]
    assert f'tokens = ["{hash_token(token)}"]' in lines
    assert 'name = "orders"' in lines
    # the printed config lines load
    PrincipalConfig("orders", (hash_token(token),))
    monkeypatch.setattr("sys.stdin", io.StringIO(token + "\n"))
    assert main(["token", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_token(token)
    monkeypatch.setattr("sys.stdin", io.StringIO("guessable\n"))
    assert main(["token", "hash"]) == 2
    assert "at least 32" in capsys.readouterr().err


def test_a_certificate_subject_is_matched_once_and_remembered() -> None:
    """The subject walk is linear in the principals; a client sends the same certificate
    with every request: its principal (or its having none) is remembered."""
    from types import SimpleNamespace

    from changebus.schemas._auth import _Authenticator

    principals = [Principal.from_grant(f"p{i}", ["*"], ["*"], ["read"]) for i in range(300)]
    walked = 0

    class Subject(frozenset):  # type: ignore[type-arg]
        def __le__(self, other: object) -> bool:
            nonlocal walked
            walked += 1
            return frozenset.__le__(self, other)  # type: ignore[operator]

    auth = _Authenticator.__new__(_Authenticator)
    auth.by_token = {}
    auth.subjects = tuple((Subject({("commonName", f"c{i}")}), p) for i, p in enumerate(principals))
    auth._matched = {}

    def request(cn: str) -> object:
        cert = {"subject": ((("commonName", cn),), (("organizationName", "o"),))}
        return SimpleNamespace(
            headers={}, transport=SimpleNamespace(get_extra_info=lambda _name: cert)
        )

    assert auth.authenticate(request("c299")) is principals[299]  # type: ignore[arg-type]
    first = walked
    assert first == 300
    for _ in range(5):
        assert auth.authenticate(request("c299")) is principals[299]  # type: ignore[arg-type]
        with pytest.raises(UnauthorizedError):
            auth.authenticate(request("nobody"))  # type: ignore[arg-type]
    assert walked == first + 300  # (the unknown one walked once, then remembered)
