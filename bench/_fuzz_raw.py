"""Raw malformed HTTP for fuzzing: what no HTTP client library would send.

:func:`raw` draws one case of: random garbage, bad request lines and
versions, a bad header line (no colon, a space before the colon, obs-fold,
NUL, bare LF line endings, duplicate ``Content-Length``), a truncated request
(then a half-close, or an abrupt close), slowloris pauses (then the rest, or
an abrupt close), pipelined requests (one maybe malformed), an abrupt close
of a long-poll, follow stream or large response, an HTTP/2 preface, a TLS
ClientHello or an SSH banner on the plain port, an over-long request line,
or nothing at all. A case that owes an answer owes one answer or a closed
connection, within the hang deadline.
"""

from __future__ import annotations

from urllib.parse import quote

from _fuzz_values import Request, Values

__all__ = ["raw", "simple"]


def simple(v: Values, daemon: str, *, keep_alive: bool) -> bytes:
    """A plain, well-formed request (for pipelining and slowloris)."""
    r = v.rnd
    part = r.choice(v.t.partitions)
    if daemon == "relay":
        path, params = r.choice(
            (
                ("/healthz", []),
                ("/v1/status", []),
                ("/v1/stream", [("partition", part), ("from", "earliest")]),
                ("/v1/stream", [("partition", part), ("scn", "x")]),
                ("/v1/sources", []),
            )
        )
    else:
        path, params = r.choice(
            (
                ("/healthz", []),
                ("/v1/bootstrap/status", [("partition", part)]),
                ("/v1/bootstrap/start", [("partition", part)]),
                ("/v1/sources", []),
            )
        )
    lines = [f"GET {path}".encode(), b"Host: 127.0.0.1"]
    if params:
        lines[0] += b"?" + b"&".join(f"{k}={quote(v)}".encode() for k, v in params)
    lines[0] += b" HTTP/1.1"
    if not keep_alive:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def raw(v: Values, daemon: str) -> Request:
    r = v.rnd
    kind = r.choice(
        (
            "garbage",
            "request_line",
            "version",
            "header",
            "truncated",
            "truncated_abort",
            "slowloris",
            "slowloris_abort",
            "pipelined",
            "pipelined",
            "abrupt_close",
            "abrupt_close",
            "preface",
            "long_line",
            "empty",
        )
    )
    good = simple(v, daemon, keep_alive=False)
    endpoint = f"raw:{kind}"
    if kind == "garbage":
        data = r.randbytes(r.randint(0, 2000)) + r.choice((b"", b"\r\n\r\n"))
        return Request(daemon, endpoint, data, methods=(), half_close=True)
    if kind == "request_line":
        line = r.choice(
            (
                b"GET /healthz",
                b"GET  /healthz  HTTP/1.1",
                b"GET /healthz HTTP/1.1 extra",
                b"HTTP/1.1 200 OK",
                b"",
                b"GE T /healthz HTTP/1.1",
                b"G\x00ET /healthz HTTP/1.1",
                b"GET \xff\xfe HTTP/1.1",
                b"GET /he alth HTTP/1.1",
                b"/healthz HTTP/1.1",
                b"GET",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + r.randbytes(40),
                b"GET healthz HTTP/1.1",
                b"GET /healthz?x=\r HTTP/1.1",
                b"OPTIONS * HTTP/1.1",
                b"CONNECT 127.0.0.1:1 HTTP/1.1",
                b"TRACE /healthz HTTP/1.1",
                ("GET /v1/schemas/" + "é" * 50 + " HTTP/1.1").encode(),
                b"X" * 300 + b" /healthz HTTP/1.1",
            )
        )
        data = line + b"\r\nHost: x\r\nConnection: close\r\n\r\n"
        return Request(daemon, endpoint, data, methods=(), half_close=r.random() < 0.5)
    if kind == "version":
        version = r.choice(
            (
                b"HTTP/1.2",
                b"HTTP/2.0",
                b"HTTP/0.9",
                b"HTTP/1",
                b"HTTP/1.1.1",
                b"http/1.1",
                b"HTTP/11",
                b"HTTP/9999999999999999999.1",
                b"HTTP/1.0",
                b"HTTPS/1.1",
                b"HTTP/-1.1",
                b"HTTP/\xff",
            )
        )
        data = b"GET /healthz " + version + b"\r\nHost: x\r\nConnection: close\r\n\r\n"
        return Request(daemon, endpoint, data, methods=(), half_close=r.random() < 0.5)
    if kind == "header":
        head, _sep, rest = good.partition(b"\r\n")
        bad = r.choice(
            (
                b"NoColonHere",
                b"X-Space : y",
                b" folded continuation",
                b"X-Nul: a\x00b",
                b": empty-name",
                b"X Y: z",
                b"X\x01: z",
                b"X-Lf: a\nb",
                b"Content-Length: 1\r\nContent-Length: 2",
                b"Transfer-Encoding: chunked\r\nContent-Length: 3",
                b"X-Utf8: " + "é🙂".encode(),
                b"X-Latin: \xe9\xff",
            )
        )
        data = head + b"\r\n" + bad + b"\r\n" + rest
        if r.random() < 0.3:  # bare LF line endings
            data = data.replace(b"\r\n", b"\n")
        return Request(daemon, endpoint, data, methods=(), half_close=True)
    if kind in ("truncated", "truncated_abort"):
        cut = r.randint(1, len(good) - 2)
        if kind == "truncated":
            return Request(daemon, endpoint, good[:cut], methods=(), half_close=True)
        return Request(
            daemon,
            endpoint,
            good[:cut],
            expect_answer=False,
            abort_after_s=r.uniform(0, 0.5),
        )
    if kind in ("slowloris", "slowloris_abort"):
        cuts = sorted(r.sample(range(1, len(good)), min(len(good) - 1, r.randint(2, 5))))
        pauses = tuple((c, r.uniform(0.05, 0.6)) for c in cuts)
        if kind == "slowloris":
            return Request(daemon, endpoint, good, pauses=pauses)
        cut = cuts[-1]
        return Request(
            daemon,
            endpoint,
            good[:cut],
            pauses=pauses[:-1],
            expect_answer=False,
            abort_after_s=r.uniform(0, 1.0),
        )
    if kind == "pipelined":
        n = r.randint(2, 6)
        reqs = [simple(v, daemon, keep_alive=True) for _ in range(n - 1)]
        reqs.append(simple(v, daemon, keep_alive=False))
        if r.random() < 0.3:  # a malformed one in the middle: answers stop there
            reqs.insert(r.randint(0, n - 1), b"GET /x HTTP/1.1\r\nNoColon\r\n\r\n")
        return Request(daemon, endpoint, b"".join(reqs), methods=("GET",) * n)
    if kind == "abrupt_close":
        part = r.choice(v.t.partitions)
        path = r.choice(
            (
                f"/v1/stream?partition={part}&from=latest&wait=30",
                f"/v1/stream?partition={part}&from=earliest&follow=1&wait=5",
                f"/v1/stream?partition={part}&from=earliest&max_bytes=67108864",
                f"/v1/stream?partition={part}&from=earliest&format=ndjson&max_bytes=4194304",
                f"/v1/bootstrap/snapshot?partition={part}&start=0&max_bytes=16777216",
                "/metrics",
                "/v1/status",
            )
        )
        data = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        return Request(daemon, endpoint, data, expect_answer=False, abort_after_s=r.uniform(0, 0.3))
    if kind == "preface":
        data = r.choice(
            (
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + r.randbytes(160),
                b"SSH-2.0-OpenSSH_9.6\r\n",
            )
        )
        return Request(daemon, endpoint, data, methods=(), half_close=True)
    if kind == "long_line":
        n = r.choice((8190, 8191, 9000, 100_000))
        data = b"GET /" + b"a" * n + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        return Request(daemon, endpoint, data, methods=())
    # empty: connect, maybe send blank lines, go
    data = r.choice((b"", b"\r\n", b"\r\n\r\n\r\n", b"\n"))
    return Request(daemon, endpoint, data, methods=(), half_close=True)
