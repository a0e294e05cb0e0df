"""``dpocache cache export --format``: the cached reference values in the files other trainers read.

- ``jsonl``, ``parquet``, ``datasets`` (a ``save_to_disk`` directory): the input's rows, in input
  order, with the columns ``ref_chosen_logps`` and ``ref_rejected_logps`` added beside them
  (named as TRL's precomputed-reference columns). Stock TRL 1.16 ``DPOTrainer`` does not read
  them from a file: with ``precompute_ref_log_probs`` off, ``_compute_loss`` ignores them and runs
  its own reference; with it on, ``_precompute_ref_logps`` recomputes every value and then fails
  on the duplicated columns. They are for code that reads them itself (the user's own loop, or a
  ``DPOTrainer`` subclass whose ``_precompute_ref_logps`` keeps them); dpocache's
  ``CachedDPOTrainer`` overrides that hook and fills the columns from the cache directly.
- ``keys``: the cache's own table, one JSON line per row in data order (``index``, ``key``, the
  sums and token counts; with ``--with-ids`` the token ids too).
- ``safetensors``: ``chosen_logps`` / ``rejected_logps`` ``(N,)`` float32 tensors, an entry a pair read
  (what open-instruct caches with ``torch.save``, without pickle), plus ``index``, the source row
  of each entry, so rows skipped as invalid cannot shift the alignment unnoticed.

Values are the summed completion log-probs of the cache, exactly as stored (float32). Files are
written through a temp file (or, for ``datasets``, a temp directory), fsynced and renamed
(``atomic.atomic_output``, ``atomic_output_dir``): a failed export
leaves the old ``--out`` or none, never an empty or partial one. In ``jsonl``, dates and times of
the source (parquet, datasets) are ISO 8601 strings; a value JSON cannot hold (bytes) is refused
in one line naming its column.

Rows longer than ``max_length`` were scored as dpocache truncates them (``data.truncate_pair``:
the prompt keeps its end, at least ``max_length // 2`` tokens of it, the completions their
start), not as TRL 1.16's collator does (the start of prompt + completion, dropping rows whose
prompt fills ``max_length``): for those rows the values belong to other token sequences than TRL
would train on. Each export marks them: ``dpocache_truncated`` (bool) beside the reference
columns, ``truncated`` ``(N,)`` bool in ``safetensors``; ``cache export`` also warns with the count.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dpocache.cache.atomic import as_umask_allows, atomic_output, atomic_output_dir
from dpocache.cache.build import export_rows
from dpocache.cache.store import CacheStore
from dpocache.config import EXPORT_FORMATS as FORMATS
from dpocache.data.pairs import TokenizedPair
from dpocache.data.rows import read_rows
from dpocache.runtime.preflight import UsageError, check_replaceable_dir

# The column names of TRL 1.x DPOTrainer's precomputed reference (which it fills itself, see above).
REF_CHOSEN, REF_REJECTED = "ref_chosen_logps", "ref_rejected_logps"
# True where dpocache truncated the pair (see above); prefixed so it cannot be taken for a column of TRL's.
TRUNCATED = "dpocache_truncated"
BAR_FROM_ROWS = 8192  # an export of fewer rows takes a second or two: no bar


def _rows_bar(rows: Iterable, total: int, show_progress: bool, desc: str) -> Iterator:
    """``rows`` (``total`` of them) with a bar where there are many (an export of Tulu's 270k rows
    takes tens of seconds)."""
    return iter(tqdm(rows, total=total, desc=desc, unit="rows", mininterval=1.0,
                     disable=not show_progress or total < BAR_FROM_ROWS))


def rows_with_reference(source: Any, store: CacheStore, pairs: Sequence[TokenizedPair],
                        show_progress: bool = False) -> list[dict]:
    """The source rows of ``pairs`` (in input order) with the two reference columns and
    ``dpocache_truncated`` added.

    Raises ``MissingReferenceError`` (a ``CacheError``) when a pair has no cached value.
    """
    values = store.lookup([p.key for p in pairs])
    _, raw = read_rows(source)
    out = []
    for i, p in enumerate(_rows_bar(pairs, len(pairs), show_progress, "reading rows")):
        row = raw[p.index].values
        row = dict(row) if isinstance(row, Mapping) else {"row": row}
        row[REF_CHOSEN] = float(values.chosen_logps[i])
        row[REF_REJECTED] = float(values.rejected_logps[i])
        row[TRUNCATED] = bool(p.truncated)
        out.append(row)
    return out


def _json_value(value: Any) -> Any:
    """``json.dumps``'s ``default``: dates and times (parquet and datasets sources hold them) as
    ISO 8601 strings; anything else JSON cannot hold raises ``TypeError``."""
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return value.isoformat()
    raise TypeError(type(value).__name__)


def _json_line(row: dict) -> str:
    try:
        return json.dumps(row, ensure_ascii=False, default=_json_value)
    except TypeError:
        for column, value in row.items():  # name the column, which json's message does not
            try:
                json.dumps(value, default=_json_value)
            except TypeError as e:
                raise UsageError(f"--format jsonl: column '{column}' holds {e} values, which JSON cannot hold; "
                                 "export with --format parquet or datasets") from None
        raise


def _write_jsonl(rows: list[dict], out: Path, show_progress: bool) -> None:
    with atomic_output(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in _rows_bar(rows, len(rows), show_progress, "writing"):
            f.write(_json_line(row) + "\n")


def _write_dataset(rows: list[dict], out: Path, fmt: str) -> None:
    from datasets import Dataset

    dataset = Dataset.from_list(rows)
    if fmt == "parquet":
        with atomic_output(out) as tmp:
            dataset.to_parquet(str(tmp))
    else:
        check_replaceable_dir(out, "out")  # the old directory is removed: only an earlier export's
        with atomic_output_dir(out) as tmp:  # a directory, written by datasets (it may be one that exists)
            dataset.save_to_disk(str(tmp))


def _write_safetensors(store: CacheStore, pairs: Sequence[TokenizedPair], out: Path) -> None:
    values = store.lookup([p.key for p in pairs])
    tensors = {
        "chosen_logps": values.chosen_logps.float().contiguous(),  # (N,)
        "rejected_logps": values.rejected_logps.float().contiguous(),  # (N,)
        "index": torch.tensor([p.index for p in pairs], dtype=torch.int64),  # (N,) source row of entry i
        "truncated": torch.tensor([p.truncated for p in pairs], dtype=torch.bool),  # (N,) cut by dpocache's rule
    }
    with atomic_output(out) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "dpocache-reference", "namespace": store.namespace.id})
        as_umask_allows(tmp)


def _write_keys(store: CacheStore, pairs: Sequence[TokenizedPair], out: Path, with_ids: bool,
                show_progress: bool) -> None:
    with atomic_output(out) as tmp, open(tmp, "w", encoding="utf-8") as f:  # no torn file if stopped
        for row in _rows_bar(export_rows(store, pairs, with_ids), len(pairs), show_progress, "writing"):
            f.write(json.dumps(row) + "\n")


def export(fmt: str, out: str | Path, source: Any, store: CacheStore, pairs: Sequence[TokenizedPair],
           with_ids: bool = False, show_progress: bool = False) -> int:
    """Write the export of ``pairs`` (from ``source``) in ``fmt`` to ``out``; returns the rows
    written. ``with_ids``: the ``keys`` table also holds the token ids. ``show_progress``: bars
    where there are many rows (``datasets`` draws its own while it writes)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "keys":
        _write_keys(store, pairs, out, with_ids, show_progress)
        return len(pairs)
    if fmt == "safetensors":
        _write_safetensors(store, pairs, out)
        return len(pairs)
    rows = rows_with_reference(source, store, pairs, show_progress)
    if fmt == "jsonl":
        _write_jsonl(rows, out, show_progress)
    else:
        _write_dataset(rows, out, fmt)
    return len(rows)
