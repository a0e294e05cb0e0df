"""Tokenized pairs as columns of integers: one array of every pair's ids and a few per-pair
arrays, in memory or memory-mapped from a token store (``dpocache.data.token_store``).

A pair held as tuples of Python ints costs about 100 bytes a token; here a token costs 4 and
the arrays of a store are shared by every process on a machine through the page cache. A pair is
read from the columns when it is asked for (``StoredPair``), and ``PairsView`` is the sequence
of pairs a ``PreferenceData`` holds.

Layout: pair ``i``'s prompt, chosen and rejected ids lie one after another in ``ids``, from
``bounds[i, 0]`` to ``bounds[i, 3]``; ``bounds[i, 1]`` and ``bounds[i, 2]`` are where chosen and
rejected begin.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Iterator, Sequence

import numpy as np

from dpocache.data.keys import KEY_BYTES, example_key


@dataclass(frozen=True)
class TokenColumns:
    """Every pair of a data set as columns. Shapes: ``ids`` [T] int32; ``bounds`` [N, 4] int64;
    ``rows`` [N] int64 (the source row, 0-based); ``where`` [N] int64 (the source line, or the row
    for sources without lines); ``keys`` [N, 16] uint8; ``truncated`` [N] bool."""

    ids: np.ndarray
    bounds: np.ndarray
    rows: np.ndarray
    where: np.ndarray
    keys: np.ndarray
    truncated: np.ndarray

    NAMES = ("ids", "bounds", "rows", "where", "keys", "truncated")

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def empty(cls) -> TokenColumns:
        return cls(np.zeros(0, np.int32), np.zeros((0, 4), np.int64), np.zeros(0, np.int64),
                   np.zeros(0, np.int64), np.zeros((0, KEY_BYTES), np.uint8), np.zeros(0, bool))

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], rows: Sequence[int],
                   where: Sequence[int], truncated: Sequence[bool]) -> TokenColumns:
        """Columns of (prompt, chosen, rejected) id lists; each pair's key is computed here."""
        lengths = np.array([[len(p), len(c), len(r)] for p, c, r in pairs], np.int64).reshape(-1, 3)
        bounds = np.zeros((len(pairs), 4), np.int64)
        bounds[:, 1:] = np.cumsum(lengths, axis=1)
        starts = np.concatenate([[0], np.cumsum(bounds[:, 3])[:-1]]).astype(np.int64)
        bounds += starts[:, None]
        ids = np.fromiter(chain.from_iterable(chain.from_iterable(pairs)), np.int32, count=int(lengths.sum()))
        keys = np.frombuffer(b"".join(example_key(*triple) for triple in pairs), np.uint8).reshape(-1, KEY_BYTES)
        return cls(ids, bounds, np.array(rows, np.int64), np.array(where, np.int64), keys, np.array(truncated, bool))

    @classmethod
    def concatenate(cls, parts: Sequence[TokenColumns]) -> TokenColumns:
        if not parts:
            return cls.empty()
        offsets = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
        return cls(np.concatenate([p.ids for p in parts]),
                   np.concatenate([p.bounds + o for p, o in zip(parts, offsets)]),
                   *(np.concatenate([getattr(p, name) for p in parts]) for name in cls.NAMES[2:]))

    def lengths(self) -> np.ndarray:
        """[N, 3]: tokens of each pair's prompt, chosen and rejected."""
        return np.diff(self.bounds, axis=1)

    def max_ids(self) -> np.ndarray:
        """[N]: each pair's largest token id."""
        if not len(self):
            return np.zeros(0, np.int32)
        return np.maximum.reduceat(self.ids, self.bounds[:, 0])


class StoredPair:
    """One pair read from ``TokenColumns``: ``TokenizedPair``'s fields, its ids as tuples made when
    asked for. Equal to a ``TokenizedPair`` with the same index, ids and key."""

    __slots__ = ("_columns", "_i")

    def __init__(self, columns: TokenColumns, i: int):
        self._columns = columns
        self._i = i

    def _part(self, k: int) -> tuple[int, ...]:
        b = self._columns.bounds[self._i]
        return tuple(self._columns.ids[b[k]:b[k + 1]].tolist())

    @property
    def index(self) -> int:
        return int(self._columns.rows[self._i])

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._part(0)

    @property
    def chosen_ids(self) -> tuple[int, ...]:
        return self._part(1)

    @property
    def rejected_ids(self) -> tuple[int, ...]:
        return self._part(2)

    @property
    def key(self) -> bytes:
        return self._columns.keys[self._i].tobytes()

    @property
    def truncated(self) -> bool:
        return bool(self._columns.truncated[self._i])

    @property
    def num_tokens(self) -> int:
        """Tokens of the two sequences, the prompt counted twice (as a padded layout runs)."""
        p, c, r = (int(n) for n in np.diff(self._columns.bounds[self._i]))
        return 2 * p + c + r

    @property
    def unique_tokens(self) -> int:
        """Tokens with the prompt counted once: the work a shared-prompt layout does."""
        b = self._columns.bounds[self._i]
        return int(b[3] - b[0])

    def _fields(self) -> tuple:
        return self.index, self.prompt_ids, self.chosen_ids, self.rejected_ids, self.key

    def __eq__(self, other: object) -> bool:
        if not hasattr(other, "rejected_ids") or not hasattr(other, "key"):
            return NotImplemented
        return self._fields() == (other.index, other.prompt_ids, other.chosen_ids, other.rejected_ids, other.key)

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        p, c, r = (int(n) for n in np.diff(self._columns.bounds[self._i]))
        return f"StoredPair(index={self.index}, tokens={p}+{c}+{r}, key={self.key.hex()[:12]})"


class PairsView(Sequence):
    """The pairs of ``columns`` picked by ``selection`` (positions in the columns; None: all),
    in order. Indexing gives a ``StoredPair``; a slice gives a list of them."""

    def __init__(self, columns: TokenColumns, selection: np.ndarray | None = None):
        self.columns = columns
        self.selection = selection

    def __len__(self) -> int:
        return len(self.columns) if self.selection is None else len(self.selection)

    def _position(self, i: int) -> int:
        return i if self.selection is None else int(self.selection[i])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"pair {i} of {len(self)}")
        return StoredPair(self.columns, self._position(i))

    def __iter__(self) -> Iterator[StoredPair]:
        positions = range(len(self.columns)) if self.selection is None else self.selection.tolist()
        return (StoredPair(self.columns, p) for p in positions)

    def __add__(self, other: Sequence) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # a sequence that compares by content

    def _picked(self, column: np.ndarray) -> np.ndarray:
        return column if self.selection is None else column[self.selection]

    def truncated_count(self) -> int:
        return int(self._picked(self.columns.truncated).sum())

    def identical_count(self) -> int:
        """Pairs whose chosen and rejected ids are the same."""
        bounds = self._picked(self.columns.bounds)
        same_length = np.flatnonzero(bounds[:, 2] - bounds[:, 1] == bounds[:, 3] - bounds[:, 2])
        ids = self.columns.ids
        return sum(bool(np.array_equal(ids[b[1]:b[2]], ids[b[2]:b[3]])) for b in bounds[same_length])

    def keys(self) -> list[bytes]:
        """Every pair's key, in order."""
        picked = self._picked(self.columns.keys)
        return [row.tobytes() for row in picked]
