"""Deterministic first-fit packing of finetuning examples into padded rows.

An example goes into the oldest open row with room, else a new one (past ``window`` open rows
the oldest is written). Examples are never split; rows depend only on the input order.
"""

from __future__ import annotations

import numpy as np

from foundrymix.format.schema import encode_row


class Packer:
    """Deterministic first-fit packing into a bounded window of open rows (module docstring)."""

    def __init__(self, max_seq_len: int, window: int) -> None:
        self.max_seq_len = max_seq_len
        self.window = window
        self.open: list[list[tuple[np.ndarray, np.ndarray]]] = []
        self.used: list[int] = []

    def add(self, ids: np.ndarray, spans: np.ndarray) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Place one example; return the rows that are finished now."""
        n = len(ids)
        for r, used in enumerate(self.used):
            if used + n <= self.max_seq_len:
                self.open[r].append((ids, spans))
                self.used[r] += n
                return [self._close(r)] if self.used[r] == self.max_seq_len else []
        self.open.append([(ids, spans)])
        self.used.append(n)
        if n == self.max_seq_len:
            return [self._close(len(self.open) - 1)]
        return [self._close(0)] if len(self.open) > self.window else []

    def _close(self, r: int) -> list[tuple[np.ndarray, np.ndarray]]:
        self.used.pop(r)
        return self.open.pop(r)

    def flush(self) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        rows, self.open, self.used = self.open, [], []
        return rows


def build_row(examples: list[tuple[np.ndarray, np.ndarray]], max_seq_len: int, pad_id: int,
              token_dtype: str) -> dict[str, np.ndarray]:
    """One padded MDS row from packed examples (spans shifted to row positions)."""
    ids = np.full(max_seq_len, pad_id, dtype=token_dtype)
    spans, lens, pos = [], [], 0
    for ex_ids, ex_spans in examples:
        ids[pos:pos + len(ex_ids)] = ex_ids
        spans.append(ex_spans + pos)
        lens.append(len(ex_ids))
        pos += len(ex_ids)
    return encode_row(ids, np.concatenate(spans), lens, token_dtype)
