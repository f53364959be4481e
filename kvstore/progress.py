"""Progress of long commands (``plan``, ``replay --bounds``, ``bench``, ``up``, ``demo``), on stderr.

Where stderr is a terminal, a ``tqdm`` bar (count, rate, time left; a note for the step
running now); elsewhere (CI logs, pipes, files) nothing while it runs, so logs stay
readable.  Either way one summary line when it ends.  Never stdout: reports and ``--json``
stay clean.  Owned by the command's main thread (workers report through it).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


class Progress:
    """``with Progress("plan: replays", total=14, unit="replays") as p: ... p.update(note="lru at 5%")``.

    ``total`` may be set later (``p.total = n``) or stay None (an open-ended count)."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        unit: str = "steps",
        stream: IO[str] | None = None,
        tty: bool | None = None,
    ) -> None:
        self.what = what
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self.note = ""
        self._total = total
        self._t0 = time.monotonic()
        self._closed = False
        self._bar: Any = None
        if self.stream.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=" " + unit, file=self.stream, leave=False, dynamic_ncols=True)

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, n: int | None) -> None:
        self._total = n
        if self._bar is not None:
            self._bar.total = n
            self._bar.refresh()

    def update(self, n: int = 1, *, note: str | None = None) -> None:
        """``n`` more done; ``note``: what runs now (shown beside the bar)."""
        self.n += n
        if note is not None:
            self.step(note)
        if self._bar is not None:
            self._bar.update(n)

    def step(self, note: str) -> None:
        """Say what runs now, without counting anything."""
        self.note = note
        if self._bar is not None:
            self._bar.set_postfix_str(note)

    def close(self, summary: str = "") -> None:
        """End the bar and write the one summary line (once)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        done = f"{self.n}/{self._total}" if self._total is not None else str(self.n)
        line = f"{self.what}: {done} {self.unit} in {time.monotonic() - self._t0:.1f} s"
        try:
            print(line + (f"; {summary}" if summary else ""), file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed stderr must not fail the command
            pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close("" if exc_type is None else "stopped")
