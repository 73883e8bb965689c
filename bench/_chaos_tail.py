"""The chaos harness's check of ``changebus tail`` output (re-exported by :mod:`_chaos_check`).

The tail prints one JSON line per event (``scn``, ``seq``, ``op``,
``before`` ...; :func:`changebus.client._json.event_json`) and keeps its
position in ``--checkpoint FILE`` (a :class:`~changebus.schemas.Checkpoint`,
replaced atomically after the windows it printed: a crash replays at most
what followed the stored checkpoint). The harness runs it under a supervisor
that restarts it; each incarnation's stdout is one file. :class:`TailChecker`
checks those files, :func:`tail_checkpoint_scn` reads the checkpoint a
restarted incarnation starts from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from changebus.schemas import Checkpoint, Mode, PartitionCheckpoint

__all__ = ["TailChecker", "tail_checkpoint_scn"]

#: at most this many problems reported per incarnation
MAX_PROBLEMS = 20
MAX_BAD_LINES = 5


def tail_checkpoint_scn(path: Path, partition: str | None = None) -> int:
    """The SCN a ``changebus tail --checkpoint FILE`` resumes after (-1: no file yet).

    Online: the partition's ``window_scn``. Bootstrapping (snapshot or
    catch-up): the bootstrap's ``since_scn`` -- a resumed catch-up goes on
    after its last window, but one whose log was pruned meanwhile restarts the
    snapshot, which sends the rows changed after ``since`` again.
    ``partition`` None: the lowest position over the checkpoint's partitions.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return -1
    cp = Checkpoint.parse(text)
    if partition is not None:
        return _resume_floor(cp.get(partition))
    return min((_resume_floor(pc) for pc in cp.partitions.values()), default=-1)


def _resume_floor(pc: PartitionCheckpoint) -> int:
    if pc.mode is not Mode.ONLINE and pc.bootstrap is not None:
        return pc.bootstrap.since_scn
    return pc.window_scn


@dataclass
class _Line:
    scn: int
    seq: int
    snapshot_like: bool  # a row state (no before-image) or a delete: may come from a snapshot


class TailChecker:
    """Checks ``changebus tail`` outputs, one file per incarnation of the process, in order.

    Rules, for the events (lines) of each incarnation:

    * ``(scn, seq)`` strictly increases (no window twice, nothing backwards) --
      except inside a bootstrap snapshot, whose rows come at their own SCNs in
      key order. A step back is accepted as a snapshot only when it and the
      lines before it back to where they started look like snapshot rows (no
      ``before`` image, or a delete), and its SCN is above every SCN printed
      before those lines (a snapshot holds only rows changed after the
      consumer's position). Accepted steps are counted in
      ``snapshot_steps``;
    * incarnation ``n`` >= 1 prints only SCNs above the checkpoint its process
      read at start: ``checkpoints_at_restart`` has one entry per restart
      (``len(outputs) - 1``: entry ``i`` for ``outputs[i + 1]``), or one per
      output (the first for the first incarnation; -1: none). Replays of what
      came after the checkpoint are what at-least-once allows.

    A last line without its newline (killed while writing) is ignored.
    ``lines``, ``incarnations``, ``snapshot_steps`` count what the last
    :meth:`check` saw. Not thread-safe.
    """

    def __init__(self) -> None:
        self.lines = 0
        self.incarnations = 0
        self.snapshot_steps = 0

    def check(self, outputs: Sequence[Path], checkpoints_at_restart: Sequence[int]) -> list[str]:
        """The violations (empty: all rules hold)."""
        self.lines = self.incarnations = self.snapshot_steps = 0
        if len(checkpoints_at_restart) == len(outputs):
            floors = list(checkpoints_at_restart)
        elif len(checkpoints_at_restart) == max(len(outputs) - 1, 0):
            floors = [-1, *checkpoints_at_restart]
        else:
            return [
                f"{len(checkpoints_at_restart)} checkpoints for {len(outputs)} outputs:"
                " give one per restart (or one per output)"
            ]
        problems: list[str] = []
        for n, (path, floor) in enumerate(zip(outputs, floors, strict=True)):
            self.incarnations += 1
            lines, bad = _read_tail(Path(path))
            problems += [f"{Path(path).name}: {b}" for b in bad]
            self.lines += len(lines)
            problems += self._incarnation(Path(path).name, n, lines, floor)
        return problems

    def _incarnation(self, name: str, n: int, lines: list[_Line], floor: int) -> list[str]:
        problems: list[str] = []
        below = [i for i, line in enumerate(lines) if line.scn <= floor]
        if floor >= 0 and below:
            i = below[0]
            problems.append(
                f"{name} (incarnation {n}): line {i + 1} has SCN {lines[i].scn}, not after the"
                f" checkpoint {floor} it started from ({len(below)} such lines)"
            )
        run_start = 0  # where the current run of snapshot-like lines began
        high_before_run = floor  # the highest SCN printed before that run
        high = floor
        for i, line in enumerate(lines):
            if not line.snapshot_like:
                run_start = i + 1
                high_before_run = max(high, line.scn)
            elif i == run_start:
                high_before_run = high
            if i > 0:
                prev = lines[i - 1]
                if (line.scn, line.seq) <= (prev.scn, prev.seq):
                    if line.snapshot_like and run_start < i and line.scn > high_before_run:
                        self.snapshot_steps += 1
                    else:
                        problems.append(
                            f"{name} (incarnation {n}): line {i + 1} goes back from"
                            f" (scn {prev.scn}, seq {prev.seq}) to (scn {line.scn}, seq {line.seq})"
                        )
                        if len(problems) >= MAX_PROBLEMS:
                            break
            high = max(high, line.scn)
        return problems


def _read_tail(path: Path) -> tuple[list[_Line], list[str]]:
    """The events of one output file, and problems with its lines."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], []
    text = data.decode("utf-8", errors="replace")
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    elif parts:
        parts.pop()  # torn: killed while writing it
    lines: list[_Line] = []
    bad: list[str] = []
    for number, raw in enumerate(parts, 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
            scn = int(doc["scn"])
            seq = int(doc.get("seq", 0))
        except (ValueError, KeyError, TypeError):
            if len(bad) < MAX_BAD_LINES:
                bad.append(f"line {number} is not an event line")
            continue
        op = doc.get("op")
        lines.append(_Line(scn, seq, doc.get("before") is None or op in ("delete", "truncate")))
    return lines, bad
