"""Seeded generators of randomised and malformed HTTP requests for the changebus daemons.

Generation is a plain :class:`random.Random` seeded once (not hypothesis: the
requests are bytes on a socket, and a seeded generator modelled per endpoint
gives a reproducible sequence without driving hypothesis outside a test).
The same seed and the same :class:`Target` give the same requests, byte for
byte.

Every request is a :class:`Request`: the bytes to write (one or more HTTP
requests; they may be anything at all), how to write them (pauses, a
half-close, an abrupt close) and what to expect (how many answers, whether
one is owed at all). :class:`Generator` builds them in two families:

* **structured** -- a request to one endpoint of a daemon (relay:
  ``/v1/stream``, ``/v1/sources``, ``/v1/schemas/{source}``, ``/v1/status``,
  ``/v1/splits``, ``/healthz``, ``/readyz``, ``/metrics``; bootstrap server:
  ``/v1/bootstrap/start|status|snapshot|catchup``, ``POST /v1/seed``,
  ``/v1/sources``, ``/v1/schemas/{source}``, ``/v1/status``), every query
  parameter drawn from valid, boundary, huge (5,000-digit numbers, 100 KB
  strings), negative, unicode, repeated and unknown values, checkpoint tokens
  (valid, truncated, base64 garbage, zlib bombs, JSON with wrong types),
  partition filters (``mod:``, ``range:``, ``slice:``, big bucket counts), then
  random headers (Authorization junk, huge or many headers, bad
  ``Content-Length``, chunked bodies, ``Expect``) and bodies;
* **raw** -- malformed HTTP: garbage, bad request lines and versions, headers
  without a colon, bare LF, truncated requests, slowloris pauses, pipelined
  requests, abrupt closes, an HTTP/2 preface, a TLS ClientHello.
"""

from __future__ import annotations

import base64
import json
import random
from urllib.parse import quote

from _fuzz_raw import raw
from _fuzz_values import Request, Target, Values

__all__ = ["Generator", "Request", "Target"]


class Generator(Values):
    """Requests for the daemons in ``target``, drawn from ``random.Random(seed)``."""

    def __init__(self, seed: int, target: Target, daemons: tuple[str, ...]) -> None:
        super().__init__(random.Random(seed), target)
        self.daemons = daemons

    # ---- query strings, targets, headers --------------------------------

    def encode(self, text: str) -> bytes:
        """A query value or path segment on the wire (mostly percent-encoded)."""
        r = self.rnd
        raw = text.encode("utf-8", "surrogatepass")
        p = r.random()
        if p < 0.85 or self.clean:
            return quote(raw, safe="").encode()
        if p < 0.92:
            return quote(raw, safe=":,/-").encode()
        if p < 0.96:
            return raw.replace(b"\r", b"").replace(b"\n", b"")  # raw bytes (maybe invalid)
        enc = quote(raw, safe="").encode()
        cut = r.randint(0, len(enc))
        return enc[:cut] + r.choice((b"%", b"%z", b"%zz", b"%ff", b"%c3", b"%00")) + enc[cut:]

    def query(self, params: list[tuple[str, str | None]]) -> bytes:
        """Encode ``params`` (None values are left out), adding unknown and repeated ones."""
        r = self.rnd
        items = [(k, v) for k, v in params if v is not None]
        if self.clean:
            return b"&".join(self.encode(k) + b"=" + self.encode(v) for k, v in items)
        if r.random() < 0.08:
            unknown = r.choice(("foo", "SCN", "scn ", "", "a" * 300, "é", "_", "wait[]", "x"))
            items.insert(r.randint(0, len(items)), (unknown, self.junk()[:50]))
        if items and r.random() < 0.08:
            k, _v = r.choice(items)
            items.append((k, r.choice(("", "1", "-1", "latest", self.junk()[:30]))))
        if r.random() < 0.05:
            r.shuffle(items)
        parts = []
        for k, v in items:
            if r.random() < 0.02:
                parts.append(self.encode(k))
            else:
                parts.append(self.encode(k) + b"=" + self.encode(v))
        q = b"&".join(parts)
        if r.random() < 0.03:
            q = r.choice((b"&&", b"&", b"=&", b"?")) + q + r.choice((b"", b"&", b"#frag"))
        return q

    def path(self, path: str) -> bytes:
        """The path, sometimes bent (trailing slash, doubled slashes, case, absolute form)."""
        r = self.rnd
        p = r.random()
        if p < 0.9 or self.clean:
            return path.encode()
        return r.choice(
            (
                path + "/",
                "/" + path,
                path.upper(),
                path.replace("/", "//"),
                "http://127.0.0.1" + path,
                path + "/..",
                path.replace("/v1/", "/v1/%2e%2e/v1/"),
                "*",
                path + ";x=1",
            )
        ).encode()

    def headers(self, daemon: str) -> tuple[list[bytes], bytes, bool, bool]:
        """Extra header lines, a body, whether the body is short of its length, keep-alive."""
        r = self.rnd
        lines: list[bytes] = []
        body = b""
        short = False
        if r.random() > 0.3 or self.clean:
            return lines, body, short, r.random() < 0.2
        for _ in range(r.randint(1, 3)):
            kind = r.randrange(12)
            if kind == 0:
                value = r.choice(
                    (
                        "Bearer " + self.junk()[:200],
                        "Basic " + base64.b64encode(r.randbytes(20)).decode(),
                        "Bearer",
                        "",
                        "Bearer " + "x" * r.choice((100, 8000, 100_000)),
                        "Negotiate é",
                    )
                )
                lines.append(b"Authorization: " + value.encode("utf-8", "surrogatepass"))
            elif kind == 1:
                lines.append(b"X-Junk: " + b"a" * r.choice((4000, 8189, 8200, 20_000, 100_000)))
            elif kind == 2:
                lines += [b"X-H%d: %d" % (i, i) for i in range(r.choice((50, 99, 100, 101, 500)))]
            elif kind == 3:
                body = r.randbytes(r.randint(0, 200))
                cl = r.choice(
                    (
                        str(len(body) + r.randint(1, 50)),
                        str(len(body)),
                        "-1",
                        "abc",
                        "99999999999999999999999",
                        f"{len(body)}, {len(body)}",
                        f"{len(body)}, 7",
                        "0x10",
                        " " + str(len(body)),
                    )
                )
                lines.append(b"Content-Length: " + cl.encode())
                short = cl.isdigit() and int(cl) > len(body)
            elif kind == 4:
                chunks = [r.randbytes(r.randint(1, 100)) for _ in range(r.randint(0, 4))]
                body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
                if r.random() < 0.4:
                    body = r.choice(
                        (
                            b"zz\r\nabc\r\n0\r\n\r\n",
                            b"ffffffffffffffffffff\r\nabc\r\n",
                            b"5\r\nab\r\n0\r\n\r\n",
                            b"-1\r\n\r\n",
                            b"3;ext=" + b"e" * 9000 + b"\r\nabc\r\n0\r\n\r\n",
                            b"3\r\nabc",
                        )
                    )
                    short = True
                te = r.choice((b"chunked", b"chunked", b"gzip, chunked", b"chunked, identity"))
                lines.append(b"Transfer-Encoding: " + te)
                if r.random() < 0.3:
                    lines.append(b"Content-Length: %d" % len(body))
            elif kind == 5:
                lines.append(b"Expect: 100-continue")
            elif kind == 6:
                lines.append(b"Accept-Encoding: " + r.choice((b"gzip, deflate, br", b"*", b"x")))
            elif kind == 7:
                lines.append(b"Content-Type: " + r.choice((b"application/json", b"x/\xff", b";")))
            elif kind == 8:
                lines.append(b"Range: bytes=" + r.choice((b"0-10", b"-5", b"999999999999999-")))
            elif kind == 9:
                lines.append(b"X-Forwarded-For: " + self.junk()[:100].encode("utf-8", "replace"))
            elif kind == 10:
                lines += [b"Connection: Upgrade", b"Upgrade: " + r.choice((b"websocket", b"h2c"))]
            else:
                lines.append(b"Host: " + r.choice((b"", b"evil.example", b"\xff\xfe", b"a" * 300)))
        return lines, body, short, r.random() < 0.2

    def http(
        self,
        daemon: str,
        method: str,
        path: str,
        params: list[tuple[str, str | None]],
        *,
        plain: bool = False,
        keep_alive: bool = False,
    ) -> tuple[bytes, bool, bool]:
        """One request's bytes; (data, body short of its length, keep-alive)."""
        r = self.rnd
        target = self.path(path) if not plain else path.encode()
        q = self.query(params)
        if q:
            target += b"?" + q
        lines = [f"{method} ".encode() + target + b" HTTP/1.1"]
        if r.random() > 0.02:
            lines.append(b"Host: 127.0.0.1:%d" % self.t.ports[daemon])
        lines.append(b"User-Agent: changebus-fuzz")
        extra, body, short, ka = ([], b"", False, False) if plain else self.headers(daemon)
        keep = keep_alive or ka
        if method == "POST" and not body and not plain and r.random() < 0.5:
            body = r.choice(
                (
                    b'{"tables": ["public.users"]}',
                    json.dumps({"x": self.junk()[:500]}).encode(),
                    r.randbytes(r.randint(0, 70_000)),
                    b"[" * 5000,
                )
            )
            extra.append(b"Content-Length: %d" % len(body))
        lines += extra
        if not keep:
            lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + body, short, keep

    # ---- structured requests per endpoint -------------------------------

    def relay_stream(self) -> tuple[list[tuple[str, str | None]], float, bool]:
        """``/v1/stream`` parameters; (params, wait seconds, follow)."""
        r = self.rnd
        part = self.partition()
        params: list[tuple[str, str | None]] = [("partition", part)]
        pos = r.random()
        if pos < 0.3:
            params.append(("checkpoint", self.checkpoint(part)))
        elif pos < 0.55:
            params.append(("scn", self.scn(part)))
            if r.random() < 0.3:
                params.append(("offset", self.int_text(-1, 2**31, [-1, 0, 1, 3, 2**31])))
        elif pos < 0.65:
            params.append(("from", r.choice(("earliest", "latest", "latest", "EARLIEST", ""))))
        elif pos < 0.7 and not self.clean:  # several positions at once
            params += [("scn", self.scn(part)), ("from", "earliest")]
        mb = 64 << 20
        if r.random() < 0.5:
            params.append(("max_bytes", self.max_bytes(mb)))
        wait = 0.0
        if r.random() < 0.4:
            text = self.float_text([0, 0, 0.05, 0.2, 0.5, 1, 2, round(r.uniform(0, 3), 3)])
            try:
                wait = min(max(float(text), 0.0), 60.0)
            except ValueError:
                wait = 0.0
            if wait != wait:  # nan
                wait = 0.0
            params.append(("wait", text))
        if r.random() < 0.2:
            fmt = r.choice(("binary", "ndjson", "ndjson") + (() if self.clean else ("json", "")))
            params.append(("format", fmt))
        if r.random() < 0.3:
            params.append(("filter", self.filter()))
        if r.random() < 0.25:
            params.append(("sources", self.sources()))
        if r.random() < 0.2:
            client = self.junk() if not self.clean and r.random() < 0.3 else "fuzz"
            params.append(("client", client + str(r.randrange(10**6))))
        follow = False
        if r.random() < 0.12:
            value = r.choice(("1", "1", "0") + (() if self.clean else ("true", "2", "")))
            follow = value == "1"
            params.append(("follow", value))
            if r.random() < 0.5:
                params.append(
                    ("follow_bytes", self.int_text(1, 1 << 40, [1, 1000, 1 << 20, 1 << 40]))
                )
        return params, wait, follow

    def relay_splits(self) -> list[tuple[str, str | None]]:
        """``/v1/splits`` parameters: a partition, a range and a number of parts."""
        r = self.rnd
        part = self.partition()
        params: list[tuple[str, str | None]] = [("partition", part)]
        if r.random() < 0.95 or self.clean:
            params.append(("since", self.scn(part)))
        if r.random() < 0.95 or self.clean:
            params.append(("until", self.scn(part)))
        if r.random() < 0.95 or self.clean:
            params.append(("parts", self.int_text(0, 1 << 40, [0, 1, 2, 4, 4096, 4097, 1 << 40])))
        return params

    def relay(self) -> Request:
        r = self.rnd
        p = r.random()
        other = ("HEAD", "POST", "PUT", "DELETE", "get")
        method = "GET" if r.random() < 0.93 or self.clean else r.choice(other)
        wait, follow = 0.0, False
        if p < 0.6:
            path = "/v1/stream"
            params, wait, follow = self.relay_stream()
        elif p < 0.68:
            path, params = "/v1/sources", []
        elif p < 0.8:
            name = r.choice((*self.t.sources, *self.t.sources, "synthetic.nope", self.junk()))
            path = "/v1/schemas/" + self.encode(name).decode("latin-1")
            params = [("partition", self.partition())] if r.random() < 0.4 else []
        elif p < 0.84:
            path, params = "/v1/status", []
        elif p < 0.88:
            path, params = "/v1/splits", self.relay_splits()
        else:
            path, params = r.choice(("/healthz", "/readyz", "/metrics")), []
        if not params and r.random() < 0.15 and not self.clean:
            params = [(self.junk()[:20], self.junk()[:100])]
        return self._request("relay", method, path, params, wait, follow)

    def bootstrap(self) -> Request:
        r = self.rnd
        p = r.random()
        other = ("HEAD", "POST", "PUT", "DELETE")
        method = "GET" if r.random() < 0.93 or self.clean else r.choice(other)
        part = self.partition()
        lmin, applier, producer = self.t.boot.get(part or "", (-1, -1, -1))
        extra = (lmin, applier, producer, applier + 1, producer + 1)
        params: list[tuple[str, str | None]] = []
        if p < 0.12:
            path = "/v1/bootstrap/start"
            params = [("partition", part), ("since", self.scn(part, extra))]
        elif p < 0.2:
            path = "/v1/bootstrap/status"
            params = [("partition", part)]
        elif p < 0.42:
            path = "/v1/bootstrap/snapshot"
            params = [
                ("partition", part),
                ("since", self.scn(part, extra) if r.random() < 0.7 else None),
                ("start", self.scn(part, extra) if r.random() < 0.9 else None),
                ("position", self.position() if r.random() < 0.5 else None),
                ("max_bytes", self.max_bytes(16 << 20) if r.random() < 0.5 else None),
                ("sources", self.sources() if r.random() < 0.25 else None),
                ("filter", self.filter() if r.random() < 0.3 else None),
            ]
        elif p < 0.64:
            path = "/v1/bootstrap/catchup"
            params = [
                ("partition", part),
                ("after", self.scn(part, extra) if r.random() < 0.9 else None),
                ("target", self.scn(part, extra) if r.random() < 0.9 else None),
                ("max_bytes", self.max_bytes(16 << 20) if r.random() < 0.5 else None),
                ("sources", self.sources() if r.random() < 0.25 else None),
                ("filter", self.filter() if r.random() < 0.3 else None),
            ]
        elif p < 0.7:
            path, method = "/v1/seed", "POST" if r.random() < 0.9 else "GET"
            tables = r.choice(
                (
                    ",".join(self.t.sources),
                    "*gap*",
                    "",
                    "synthetic.nope",
                    "public.users",
                    self.junk(),
                    ",".join(["a.b"] * 500),
                )
            )
            params = [("partition", part), ("tables", tables if r.random() < 0.8 else None)]
        elif p < 0.76:
            path = "/v1/sources"
        elif p < 0.86:
            name = r.choice((*self.t.sources, *self.t.sources, "synthetic.nope", self.junk()))
            path = "/v1/schemas/" + self.encode(name).decode("latin-1")
            params = [("partition", self.partition())] if r.random() < 0.4 else []
        elif p < 0.92:
            path = "/v1/status"
        else:
            path = r.choice(("/healthz", "/readyz", "/metrics", "/v1/stream", "/nope"))
        if r.random() < 0.1 and not self.clean:
            params.append((r.choice(("foo", "since", "partition", "wait")), self.junk()[:50]))
        return self._request("bootstrap", method, path, params, 0.0, False)

    def _request(
        self,
        daemon: str,
        method: str,
        path: str,
        params: list[tuple[str, str | None]],
        wait: float,
        follow: bool,
    ) -> Request:
        data, short, _keep = self.http(daemon, method, path, params)
        label = f"{method.upper() if method.upper() in ('GET', 'HEAD') else method} {path}"
        label = label if len(label) < 60 and "%" not in label else f"{method} {path[:14]}..."
        if path.startswith("/v1/schemas/"):
            label = f"{method} /v1/schemas/{{source}}"
        return Request(
            daemon,
            label,
            data,
            methods=(method.upper() if method.upper() == "HEAD" else method,),
            half_close=short,
            read_for_s=self.rnd.uniform(0.05, 1.0) if follow else None,
            wait_s=wait,
        )

    def next(self) -> Request:
        """The next case (about 80 % structured, 20 % raw malformed HTTP)."""
        r = self.rnd
        daemon = r.choice(self.daemons)
        self.clean = r.random() < 0.35
        if r.random() < 0.2:
            return raw(self, daemon)
        return self.relay() if daemon == "relay" else self.bootstrap()
