"""The island's event log: one JSON object per line (steps, rounds, evals, joins), timestamped with the
island's own wall clock, so runs can be analysed afterwards (loss curves, stalls, goodput)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Optional


class EventLog:
    """Append-only JSONL writer, safe to call from any thread; a no-op without a path.

    Every event gets ``t`` (seconds since the epoch) unless it has one, and ``island``.
    """

    def __init__(self, path: str, island: str):
        self.island = island
        self._lock = threading.Lock()
        self._file: Optional[object] = None
        if path:
            file = Path(path).expanduser()
            file.parent.mkdir(parents=True, exist_ok=True)
            self._file = file.open("a", buffering=1, encoding="utf-8")

    def __call__(self, event: dict) -> None:
        if self._file is None:
            return
        record = {"t": time.time(), "island": self.island} | event
        line = json.dumps(record, separators=(",", ":"), default=float)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict]:
    """All events of a JSONL log (a torn last line, from a killed island, is skipped)."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events
