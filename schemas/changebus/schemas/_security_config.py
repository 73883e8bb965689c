"""The ``[security]`` table of a server's config: TLS, principals, open endpoints.

The relay and the bootstrap server carry the same table (a field
``security: SecurityConfig`` of their configs), loaded by
:func:`changebus.schemas.config.load_config` like any other section::

    [security]
    allow_insecure = false
    open_endpoints = ["/healthz", "/readyz", "/metrics"]

    [security.tls]
    cert_file = "/etc/changebus/relay.pem"
    key_file = "/etc/changebus/relay.key"
    client_ca_file = ""          # set: client certificates checked against it (mTLS)
    client_cert = "optional"     # or "required"

    [[security.principals]]
    name = "orders-indexer"
    tokens = ["sha256:<64 hex>"]
    cert_subjects = ["CN=orders-indexer,O=Acme"]
    partitions = ["*"]
    sources = ["*"]
    scopes = ["read"]

Everything is validated here, at load time, so that a server never starts
with a grant it cannot enforce: token entries must be ``sha256:`` hashes
(a plain token in a config file is refused, with the command that makes the
hash), certificate subjects must parse, and ``client_cert = "required"``
needs a ``client_ca_file``. :func:`check_bind` is the rule for listening on
a non-loopback address.

The dataclasses are frozen and hold only paths, names and hashes (no secret
ever sits in them: the tokens themselves are never configured).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from .errors import ConfigError

__all__ = [
    "SCOPES",
    "PrincipalConfig",
    "SecurityConfig",
    "TlsConfig",
    "check_bind",
    "is_loopback",
    "parse_subject",
]

#: the scopes a principal may hold: ``read`` (stream, snapshot, sources,
#: schemas, status) and ``admin`` (mutating endpoints; implies ``read``)
SCOPES: Final = ("read", "admin")

_HASH = re.compile(r"sha256:[0-9a-f]{64}")

#: RFC 4514 short names -> the attribute names ``SSLSocket.getpeercert()`` uses
_ATTRIBUTES: Final = {
    "cn": "commonName",
    "o": "organizationName",
    "ou": "organizationalUnitName",
    "c": "countryName",
    "st": "stateOrProvinceName",
    "l": "localityName",
    "street": "streetAddress",
    "dc": "domainComponent",
    "uid": "userId",
    "e": "emailAddress",
    "emailaddress": "emailAddress",
    "serialnumber": "serialNumber",
    "sn": "surname",
    "gn": "givenName",
    "title": "title",
}
_LONG_NAMES: Final = {v.lower(): v for v in _ATTRIBUTES.values()}

Subject = frozenset[tuple[str, str]]


def parse_subject(text: str) -> Subject:
    """The attributes of an RFC 4514 distinguished name, as ``{(getpeercert name, value)}``.

    ``"CN=reader,O=changebus tests"`` -> ``{("commonName", "reader"),
    ("organizationName", "changebus tests")}``. Order does not matter (the
    attributes are what a certificate is matched against: see
    :meth:`PrincipalConfig.matches_subject`); ``,`` and ``+`` separate
    attributes; a backslash escapes the next character (or two hex digits).
    Raises :class:`ConfigError` for an unknown attribute type or a part
    without ``=``.
    """
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            pair = text[i + 1 : i + 3]
            if len(pair) == 2 and all(c in "0123456789abcdefABCDEF" for c in pair):
                current.append("\x00" + chr(int(pair, 16)))  # escaped: never a separator
                i += 3
                continue
            current.append("\x00" + text[i + 1])
            i += 2
            continue
        if ch in ",+":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    attributes: set[tuple[str, str]] = set()
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.replace("\x00", "").strip()
        if not sep or not key:
            raise ConfigError(f"certificate subject {text!r}: {part!r} is not TYPE=value")
        name = _ATTRIBUTES.get(key.lower()) or _LONG_NAMES.get(key.lower())
        if name is None:
            raise ConfigError(
                f"certificate subject {text!r}: unknown attribute type {key!r} "
                f"(known: {', '.join(sorted({k.upper() for k in _ATTRIBUTES}))})"
            )
        attributes.add((name, value.strip().replace("\x00", "")))
    if not attributes:
        raise ConfigError("certificate subject must not be empty")
    return frozenset(attributes)


@dataclass(frozen=True)
class TlsConfig:
    """The server's certificate, and optionally the CA its clients' certificates come from.

    ``cert_file`` (the chain, PEM) and ``key_file`` are read at start-up and
    again on SIGHUP. With ``client_ca_file`` the server asks clients for a
    certificate and checks it against that CA (mTLS): ``client_cert =
    "optional"`` lets clients without one in (they then need a token),
    ``"required"`` refuses them in the handshake.
    """

    cert_file: Path = Path()
    key_file: Path = Path()
    client_ca_file: Path | None = None
    client_cert: Literal["optional", "required"] = "optional"

    def __post_init__(self) -> None:
        if self.cert_file == Path() or self.key_file == Path():
            raise ConfigError("security.tls needs cert_file and key_file (PEM files)")
        if self.client_ca_file == Path():
            object.__setattr__(self, "client_ca_file", None)  # "" in TOML: no mTLS
        if self.client_cert == "required" and self.client_ca_file is None:
            raise ConfigError(
                'security.tls.client_cert = "required" needs client_ca_file '
                "(the CA that issued the client certificates)"
            )


@dataclass(frozen=True)
class PrincipalConfig:
    """One principal: who it is (tokens, certificate subjects) and what it may do.

    ``tokens`` are ``sha256:<64 hex>`` hashes of bearer tokens (``changebus
    token new`` makes one); several allow rotation. ``cert_subjects`` are
    RFC 4514 names matched against client certificates (every attribute
    named must be in the certificate's subject; attributes not named are
    not checked). ``partitions`` and ``sources`` are names, or ``"*"`` for
    all; ``scopes`` are from :data:`SCOPES`.
    """

    name: str
    tokens: tuple[str, ...] = ()
    cert_subjects: tuple[str, ...] = ()
    partitions: tuple[str, ...] = ("*",)
    sources: tuple[str, ...] = ("*",)
    scopes: tuple[str, ...] = ("read",)

    def __post_init__(self) -> None:
        where = f"security.principals {self.name!r}"
        if not self.name.strip():
            raise ConfigError("security.principals: every principal needs a name")
        if not self.tokens and not self.cert_subjects:
            raise ConfigError(f"{where}: give tokens (sha256: hashes) or cert_subjects")
        for token in self.tokens:
            if not _HASH.fullmatch(token):
                # never echo the value: it may be a plain token pasted by mistake
                raise ConfigError(
                    f"{where}: tokens must be 'sha256:<64 lowercase hex>' hashes; make one with "
                    "`changebus token new` (or `changebus token hash` < token-file)"
                )
        for subject in self.cert_subjects:
            parse_subject(subject)
        unknown = sorted(set(self.scopes) - set(SCOPES))
        if unknown:
            raise ConfigError(f"{where}: unknown scope(s) {unknown}; known: {list(SCOPES)}")

    @property
    def subjects(self) -> tuple[Subject, ...]:
        """``cert_subjects`` parsed (:func:`parse_subject`)."""
        return tuple(parse_subject(s) for s in self.cert_subjects)


@dataclass(frozen=True)
class SecurityConfig:
    """TLS, authentication and authorization of one server (module docstring).

    The default (no TLS, no principals) is an open server, which may only
    listen on loopback unless ``allow_insecure`` (:func:`check_bind`).
    """

    allow_insecure: bool = False
    open_endpoints: tuple[str, ...] = ("/healthz", "/readyz", "/metrics")
    tls: TlsConfig | None = None
    principals: tuple[PrincipalConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.principals]
        if len(set(names)) != len(names):
            raise ConfigError("security.principals: names must be unique")
        owners: dict[str, str] = {}
        for p in self.principals:
            for token in p.tokens:
                if owners.setdefault(token, p.name) != p.name:
                    raise ConfigError(
                        f"security.principals: {owners[token]!r} and {p.name!r} share a token hash"
                    )
        if any(p.cert_subjects for p in self.principals) and (
            self.tls is None or self.tls.client_ca_file is None
        ):
            raise ConfigError(
                "security.principals name cert_subjects, but no client certificate is checked: "
                "set security.tls.client_ca_file"
            )
        for path in self.open_endpoints:
            if not path.startswith("/"):
                raise ConfigError(f"security.open_endpoints: {path!r} must start with /")

    @property
    def authenticates(self) -> bool:
        """Whether requests need credentials (principals are configured)."""
        return bool(self.principals)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses (``0.0.0.0``, ``::``, ``""`` do not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: may be any interface


def check_bind(host: str, security: SecurityConfig) -> None:
    """Refuse to listen on a non-loopback ``host`` without TLS and principals.

    Allowed: a loopback host; or TLS configured *and* principals; or
    ``allow_insecure = true``. Raises :class:`ConfigError` naming what is
    missing and how to fix it.
    """
    if is_loopback(host) or security.allow_insecure:
        return
    missing = []
    if security.tls is None:
        missing.append("TLS ([security.tls] cert_file and key_file)")
    if not security.principals:
        missing.append("authentication ([[security.principals]] with tokens or cert_subjects)")
    if missing:
        raise ConfigError(
            f"refusing to listen on {host or 'every interface'!r}, a non-loopback address, "
            f"without {' and '.join(missing)}: configure them, listen on 127.0.0.1, or set "
            "security.allow_insecure = true to accept an open server on the network"
        )
