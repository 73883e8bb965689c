"""Seeded values for HTTP fuzzing: numbers, strings, filters, checkpoints, positions.

:class:`Values` draws every parameter value the request generators use from
one :class:`random.Random`: valid ones (from what :class:`Target` says the
daemons hold), boundaries, huge ones (5,000-digit numbers, 100 KB strings),
negative, unicode (also lone surrogates: invalid UTF-8 once encoded) and
malformed ones; checkpoints valid, truncated, base64 garbage, zlib bombs and
JSON with wrong types; partition filters ``mod:``, ``range:`` and ``slice:``
with big bucket counts and huge numbers. With ``clean`` set, only valid values
are drawn (a case made of them reaches the deep paths of a handler).

Not thread-safe (one generator per run, used by one event loop).
"""

from __future__ import annotations

import base64
import random
import string
import zlib
from dataclasses import dataclass, field

import _common  # noqa: F401  (puts the checkout on sys.path)
from changebus.schemas import BootstrapProgress, Checkpoint, Mode, PartitionCheckpoint

__all__ = ["Request", "Target", "Values"]

MAX_SCN = 2**63 - 1
HASH_SPACE = 1 << 64
#: U+1D7D7, a digit Python's int() accepts
BOLD_NINE = "\U0001d7d7"
_DIGITS = string.digits.encode()
_PRINTABLE = string.printable.encode()
_BOUNDARIES = (0, -1, -2, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**20)


@dataclass(frozen=True)
class Target:
    """What the generators know of the daemons under test (read once, before fuzzing).

    ``scns`` maps each partition to the relay's ``(min_scn, max_scn)``;
    ``boot`` each partition to the bootstrap server's
    ``(log_min_scn, applier_scn, producer_scn)``; ``ports`` each daemon
    (``relay``, ``bootstrap``) to its port.
    """

    partitions: tuple[str, ...]
    sources: tuple[str, ...]
    scns: dict[str, tuple[int, int]]
    boot: dict[str, tuple[int, int, int]]
    ports: dict[str, int]


@dataclass(frozen=True)
class Request:
    """One case: bytes to write to a fresh connection and what to expect back.

    ``methods`` holds the method of every request in ``data`` whose answer is
    awaited, in order (``HEAD`` answers have no body); an empty tuple with
    ``expect_answer`` means "an answer or a close". ``pauses`` are
    ``(offset, seconds)``: write ``data[:offset]``, sleep, go on.
    ``half_close`` shuts the sending side after the data; ``abort_after_s``
    (with ``expect_answer=False``) closes the connection abruptly (RST) that
    long after writing; ``read_for_s`` (a follow stream) reads the body that
    long at most, then closes. ``wait_s`` is the request's own long-poll wait
    (added to the hang deadline).
    """

    daemon: str
    endpoint: str
    data: bytes
    methods: tuple[str, ...] = ("GET",)
    expect_answer: bool = True
    pauses: tuple[tuple[int, float], ...] = ()
    half_close: bool = False
    abort_after_s: float = 0.0
    read_for_s: float | None = None
    wait_s: float = 0.0
    note: str = field(default="", compare=False)


_UNICODE = (
    "é",
    "ß",
    "Ω",
    "中文",
    "🙂",
    "\u202e",
    "\u0301",
    "\ufeff",
    "\uffff",
    "\x00",
    "\r\n",
    "\t",
    "\x7f",
    "\ud800",
    "٣",
    "١٢٣",
    "½",
    BOLD_NINE,
)
_WORDS = ("a", "fz", "fill", "x", "synthetic", "t0", "public", "orders", "null", "true")
_TRICKY = (
    "",
    " ",
    "../../etc/passwd",
    "..",
    ".",
    "%00",
    "%s%s%n{0}{}",
    "{",
    "[",
    "'; DROP TABLE log; --",
    "*gap*",
    "\\",
    "/",
    "?",
    "#",
    "&",
    "=",
    "+",
)


class Values:
    """Parameter values drawn from ``rnd`` for the daemons in ``target`` (module docstring)."""

    def __init__(self, rnd: random.Random, target: Target) -> None:
        self.rnd = rnd
        self.t = target
        #: this case draws only valid values (so that deep paths are reached too)
        self.clean = False

    # ---- values -------------------------------------------------------

    def pick(self, n: int, alphabet: bytes) -> str:
        """``n`` random characters of ``alphabet`` (at C speed: 100 KB strings are common)."""
        table = bytes(alphabet[i % len(alphabet)] for i in range(256))
        return self.rnd.randbytes(n).translate(table).decode("latin-1")

    def digits(self, n: int) -> str:
        return str(self.rnd.randint(1, 9)) + self.pick(n - 1, _DIGITS)

    def huge(self) -> str:
        """A 100 KB string (several shapes)."""
        r = self.rnd
        n = r.choice((8000, 20_000, 100_000))
        kind = r.randrange(4)
        if kind == 0:
            return "a" * n
        if kind == 1:
            return self.digits(n)
        if kind == 2:
            return (r.choice(_UNICODE) * n)[:n]
        return self.pick(n, _PRINTABLE)

    def junk(self) -> str:
        """A string that no parameter accepts (mostly)."""
        r = self.rnd
        p = r.random()
        if p < 0.25:
            return r.choice(_TRICKY)
        if p < 0.5:
            return "".join(r.choice(_UNICODE) for _ in range(r.randint(1, 6)))
        if p < 0.7:
            return "".join(r.choices(string.printable, k=r.randint(1, 40)))
        if p < 0.8:
            return "".join(chr(r.randint(1, 0x2FFFF)) for _ in range(r.randint(1, 20)))
        if p < 0.9:
            return r.choice(_WORDS) + r.choice(_TRICKY)
        return self.huge()

    def int_text(self, lo: int, hi: int, typical: list[int]) -> str:
        """An integer parameter: valid, boundary, huge, negative or malformed."""
        r = self.rnd
        p = r.random()
        if (p < 0.35 or self.clean) and typical:
            valid = [v for v in typical if lo <= v <= hi] or [lo]
            return str(r.choice(valid) if p < 0.8 or not self.clean else r.randint(lo, hi))
        if p < 0.45:
            return str(r.randint(lo, hi))
        if p < 0.62:
            return str(r.choice((lo, hi, lo - 1, hi + 1, *_BOUNDARIES)))
        if p < 0.75:
            n = r.choice((5000, 5000, 4301, 4299, 25, 21, 100_000))
            sign = r.choice(("", "-", "+"))
            return sign + (("0" * n + "1") if r.random() < 0.2 else self.digits(n))
        q = r.choice(
            (
                "",
                " 1",
                "1 ",
                "+1",
                "1.0",
                "1e3",
                "0x10",
                "1_000",
                "٣",
                "١٢٣",
                BOLD_NINE,
                "NaN",
                "inf",
                "-",
                "--1",
                "1-",
                "0b1",
                "007",
                "-0",
            )
        )
        return q if r.random() < 0.8 else self.junk()

    def float_text(self, typical: list[float]) -> str:
        """A decimal parameter (``wait``)."""
        r = self.rnd
        p = r.random()
        if p < 0.6 or self.clean:
            return str(r.choice(typical))
        if p < 0.75:
            return r.choice(
                (
                    "60",
                    "60.0",
                    "60.000001",
                    "61",
                    "1e1",
                    "1E-3",
                    "-0",
                    "-0.0",
                    "1e308",
                    "1e309",
                    "1e-400",
                    ".5",
                    "5.",
                    "-1",
                    "0x1p3",
                    "nan",
                    "inf",
                    "-inf",
                    "0.0000000000000000000001",
                )
            )
        if p < 0.85:
            return self.digits(r.choice((25, 5000))) + r.choice(("", ".5", "e-5000"))
        return self.junk()

    def partition(self) -> str | None:
        r = self.rnd
        p = r.random()
        if p < 0.75 or self.clean:
            return r.choice(self.t.partitions)
        if p < 0.85:
            return None
        return (
            r.choice((".", "..", "FZ", "fz ", "a" * 129, "x", *_TRICKY[:6]))
            if p < 0.93
            else (self.junk())
        )

    def scn(self, part: str | None, typical_extra: tuple[int, ...] = ()) -> str:
        lo, hi = self.t.scns.get(part or "", (1000, 2000))
        typical = [-1, lo, hi, lo - 1, hi + 1, (lo + hi) // 2, *typical_extra]
        return self.int_text(-1, MAX_SCN, typical)

    def max_bytes(self, hi: int) -> str:
        return self.int_text(1, hi, [1, 17, 512, 4096, 65536, 1 << 20, hi, 16 << 20, 64 << 20])

    def sources(self) -> str:
        r = self.rnd
        p = r.random()
        names = list(self.t.sources)
        if p < 0.5 or self.clean:
            return ",".join(r.sample(names, r.randint(1, len(names))))
        if p < 0.6:
            return ",".join(names * r.randint(2, 200))  # repeated, long
        if p < 0.7:
            return ",,, ," if r.random() < 0.5 else ""
        if p < 0.85:
            return ",".join([*r.sample(names, 1), "synthetic.nope", r.choice(_TRICKY)])
        return self.junk()

    def filter(self) -> str:
        """A partition filter: valid, huge bucket lists, huge numbers, junk."""
        r = self.rnd
        p = r.random() * (0.58 if self.clean else 1.0)
        if p < 0.3:
            n = r.choice((1, 2, 3, 16, 1024, 65536))
            picks = sorted(r.sample(range(n), min(n, r.randint(1, 4))))
            return f"mod:{n}:{','.join(map(str, picks))}"
        if p < 0.4:
            n = r.choice((65536, 100_000, 999_999))
            items = ",".join(["0-65535"] * r.randint(1, 500))
            return f"mod:{n}:{items}"[: r.choice((80, 4096, 4200, 8100))]
        if p < 0.5:
            lo = r.randrange(HASH_SPACE)
            hi = r.choice(("max", str(HASH_SPACE), hex(r.randrange(lo, HASH_SPACE + 1))))
            return f"range:{r.choice((str(lo), hex(lo)))}:{hi}"
        if p < 0.58:
            count = r.choice((1, 2, 4, 65536, 999_999, 0))
            return f"slice:{r.randint(0, max(count, 1))}/{count}"
        if p < 0.8:
            n = r.choice((19, 20, 21, 25, 300, 4190, 4300, 5000))
            big = self.digits(n)
            hexbig = "0x" + "f" * r.choice((17, 100, 4000))
            return r.choice(
                (
                    f"mod:{big}:1",
                    f"mod:7:{big}",
                    f"mod:7:1-{big}",
                    f"range:{big}:max",
                    f"range:0:{big}",
                    f"range:{hexbig}:max",
                    f"range:0:{hexbig}",
                    f"slice:{big}/1",
                    f"slice:0/{big}",
                    f"mod:{r.choice(('٣', BOLD_NINE, '-1', '0'))}:0",
                )
            )
        return r.choice(("mod:", "mod:a:b", "range::", "slice:/", "mod:7:3-1", "mod:7:-", "")) + (
            self.junk() if r.random() < 0.5 else ""
        )

    def checkpoint(self, part: str | None) -> str:
        """A checkpoint: valid tokens and JSON, truncated, garbage, bombs, wrong types."""
        r = self.rnd
        name = part if part and part in self.t.partitions else r.choice(self.t.partitions)
        lo, hi = self.t.scns.get(name, (1000, 2000))
        scn = r.choice((-1, lo, hi, r.randint(lo, max(lo, hi)), hi + 1000, MAX_SCN, lo - 10))
        p = r.random() * (0.35 if self.clean else 1.0)
        if p < 0.35:
            offset = r.choice((-1, -1, 0, 1, 2**31))
            pc = PartitionCheckpoint(
                window_scn=max(scn, -1),
                window_offset=offset if scn >= 0 else -1,
                prev_scn=max(scn - 1, -1) if offset >= 0 else max(scn, -1),
            )
            cp = Checkpoint({name: pc})
            if r.random() < 0.2:
                cp = cp.with_partition(r.choice(("other", "fz", "fill")), PartitionCheckpoint())
            if r.random() < 0.1:
                prog = BootstrapProgress(since_scn=-1, start_scn=max(lo, 0), target_scn=hi)
                cp = Checkpoint({name: PartitionCheckpoint(mode=Mode.CATCHUP, bootstrap=prog)})
            return cp.to_json() if r.random() < 0.25 else cp.to_token()
        if p < 0.45:
            token = Checkpoint({name: PartitionCheckpoint(window_scn=lo, prev_scn=lo)}).to_token()
            cut = r.randint(0, len(token) - 1)
            return token[:cut] if r.random() < 0.6 else token[:cut] + "~" + token[cut + 1 :]
        if p < 0.55:
            garbage = r.randbytes(r.randint(0, 3000))
            text = base64.urlsafe_b64encode(garbage).decode().rstrip("=")
            return r.choice(("cb1.", "cb1z.", "cb2.", "")) + text
        if p < 0.6:
            bomb = zlib.compress(b"{" + b" " * r.choice((70_000, 1 << 20, 4 << 20)), 9)
            return "cb1z." + base64.urlsafe_b64encode(bomb).decode().rstrip("=")
        if p < 0.9:
            bad = r.choice(
                (
                    '"x"',
                    "1e400",
                    self.digits(r.choice((25, 4000, 5000))),
                    "-" + self.digits(30),
                    "true",
                    "null",
                    "[]",
                    "{}",
                    "1.5",
                    '{"a":1}',
                    "[" * 3000,
                )
            )
            field_name = r.choice(
                ("window_scn", "window_offset", "prev_scn", "timestamp_ns", "mode", "bootstrap")
            )
            body = r.choice(
                (
                    f'{{"v":1,"partitions":{{"{name}":{{"{field_name}":{bad}}}}}}}',
                    f'{{"v":{bad},"partitions":{{}}}}',
                    f'{{"v":1,"partitions":{bad}}}',
                    f'{{"v":1,"partitions":{{"{name}":{bad}}}}}',
                    f'{{"v":1,"partitions":{{"{name}":{{"mode":"bootstrap-catchup",'
                    f'"bootstrap":{{"start_scn":{bad}}}}}}}}}',
                    f'{{"v":1,"x":{bad}}}',
                    f'{{"v":1,"partitions":{{"{self.junk()[:200]}":{{}}}}}}',
                )
            )
            if r.random() < 0.4:
                raw = body.encode("utf-8", "surrogatepass")
                if r.random() < 0.5:
                    return "cb1z." + base64.urlsafe_b64encode(zlib.compress(raw)).decode()
                return "cb1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")
            return body
        return r.choice(("{", "[", "null", "", "   ", "cb1.", "cb1z.", "cb1", ".")) + (
            self.junk() if r.random() < 0.3 else ""
        )

    def position(self) -> str:
        r = self.rnd
        sid = r.randint(0, 4)
        return r.choice(
            (
                "0:0",
                f"{sid}:{r.randint(0, 10_000)}",
                f"{MAX_SCN}:{MAX_SCN}",
                f"{MAX_SCN + 1}:0",
                "9" * 20 + ":1",
                ":",
                "1:",
                ":1",
                "-1:0",
                "a:b",
                f"{self.digits(5000)}:1",
                "1:2:3",
                self.junk(),
            )
        )
