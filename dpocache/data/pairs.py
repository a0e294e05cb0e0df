"""Pairs out: rows checked and rendered (``dpocache.data.render``), tokenized, truncated and keyed.

Truncation rule (``max_length`` L, ``max_prompt_length`` P): a sequence is prompt + one
completion, and both sequences of a pair must fit in L tokens.

1. If the prompt plus the longer completion fits, nothing is cut.
2. Otherwise the prompt keeps its *last* ``max(P, L - longest completion, 1)`` tokens (its end
   is what the completion answers), never fewer than it has to, and never none: the first
   completion token is scored from the prompt's last position.
3. Each completion then keeps its *first* ``L - kept prompt`` tokens.

A pair whose kept prompt leaves no room for a completion is a bad row, as is one longer than the
model's context or with a token id past its vocabulary; ``skip_invalid`` skips and lists every
bad row instead of stopping at the first.

Each pair's example key is a hash of its final token ids (after template and truncation), so
any change to the tokenizer, template or length limits that changes the ids changes the key.

The pairs are held as columns of integers (``dpocache.data.columns``); given a cache directory,
``load_preference_data`` keeps them in a token store there, tokenized once and memory-mapped by
every later call (``dpocache.data.token_store``).
"""

from __future__ import annotations

import bisect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from dpocache.data import sources, token_store
from dpocache.data.columns import PairsView, TokenColumns
from dpocache.data.keys import KEY_BYTES, example_key  # noqa: F401 (public names here)
from dpocache.data.render import RenderedRow, render_row
from dpocache.data.rows import STANDARD_COLUMNS, DataError, LacksValues, RawRow, map_columns, read_rows, source_name
from dpocache.data.tokenize import continuation_ids, tokenize_continuations  # noqa: F401 (a public name here)
from dpocache.runtime.signals import NOTHING_LOST, Interrupted

@dataclass(frozen=True)
class TokenizedPair:
    """A preference pair as token ids after chat template and truncation.

    ``chosen_ids`` and ``rejected_ids`` are the completion tokens only; the model sees
    ``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids``.
    """

    index: int
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    key: bytes
    truncated: bool = field(default=False, compare=False)  # cut to max_length (counted in summaries)

    @property
    def num_tokens(self) -> int:
        """Tokens of the two sequences, the prompt counted twice (as a padded layout runs)."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def unique_tokens(self) -> int:
        """Tokens with the prompt counted once: the work a shared-prompt layout does."""
        return len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


@dataclass(frozen=True)
class SkippedRow:
    location: str
    field: str | None
    reason: str

    def __str__(self) -> str:
        return str(DataError(self.location, self.field, self.reason))


@dataclass
class PreferenceData:
    """Tokenized pairs in source order, plus the rows skipped (with ``skip_invalid``)."""

    source: str
    pairs: Sequence[TokenizedPair]  # a PairsView over columns, from load_preference_data
    skipped: list[SkippedRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def truncated(self) -> int:
        """Pairs cut to ``max_length``."""
        if isinstance(self.pairs, PairsView):
            return self.pairs.truncated_count()
        return sum(p.truncated for p in self.pairs)

    @property
    def identical(self) -> int:
        """Pairs whose chosen and rejected completions are the same tokens: they teach nothing."""
        if isinstance(self.pairs, PairsView):
            return self.pairs.identical_count()
        return sum(p.chosen_ids == p.rejected_ids for p in self.pairs)


def truncate_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], max_length: int | None,
    max_prompt_length: int | None,
) -> tuple[list[int], list[int], list[int]]:
    """Apply the module's truncation rule. Returns the kept (prompt, chosen, rejected)."""
    if max_length is None:
        return prompt, chosen, rejected
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest > max_length:
        floor = max_prompt_length if max_prompt_length is not None else max_length // 2
        # At least one prompt token: a completion token at position 0 predicts from nothing
        # and would be counted but never scored.
        keep = min(len(prompt), max(floor, max_length - longest, 1))
        prompt = prompt[len(prompt) - keep:]
        room = max_length - len(prompt)
        chosen, rejected = chosen[:room], rejected[:room]
    return prompt, chosen, rejected


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer itself puts before a text: its BOS for tokenizers that
    add one (Llama, Mistral, Gemma), nothing for those that do not (GPT-2, Qwen), whatever
    ``bos_token`` says. Found by encoding a probe with and without special tokens."""
    probe = "a"
    with_special = list(tokenizer(probe)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start]
    return []


def with_prefix(ids: list[int], prefix: list[int]) -> list[int]:
    # A prompt whose text already starts with the BOS (written out as "<s>") keeps one.
    return ids if not prefix or ids[:len(prefix)] == prefix else prefix + ids


def with_eos(ids: list[int], eos: int | None) -> list[int]:
    # A completion whose text already ends with the EOS keeps one, as TRL does.
    return ids if eos is None or (ids and ids[-1] == eos) else ids + [eos]


ROWS_PER_CHUNK = 8192  # rows tokenized at a time: a chunk's ids are Python lists until they become columns


def _render_rows(rows: list[RawRow], tokenizer, skip_invalid: bool,
                 show_progress: bool = False) -> tuple[list[tuple[RawRow, RenderedRow]], list[SkippedRow]]:
    """Every row checked and rendered to text before any is tokenized: a bad row is reported in
    a moment, not after the whole set's tokenization. A bar where it takes a while (a chat
    template renders about 2,500 conversation rows a second on one core: minutes for Tulu 3)."""
    skipped: list[SkippedRow] = []
    rendered: list[tuple[RawRow, RenderedRow]] = []
    with tqdm(total=len(rows), desc="checking rows", unit="rows", mininterval=1.0,
              disable=not show_progress or len(rows) < ROWS_PER_CHUNK) as bar:
        for i, row in enumerate(rows):
            try:
                rendered.append((row, render_row(row, tokenizer)))
            except DataError as e:
                if not skip_invalid:
                    raise _naming_others(_with_skip_hint(e) if rendered or isinstance(e, LacksValues) else e,
                                         rows[i + 1:]) from None
                skipped.append(SkippedRow(e.location, e.field, e.reason))
            if i % 1024 == 1023:
                bar.update(1024)
        bar.update(len(rows) % 1024)
    return rendered, skipped


SKIP_HINT = "fix or drop the row; --skip-invalid skips such rows"


def _naming_others(e: DataError, rest: list[RawRow]) -> DataError:
    """``e`` (a bad row, which stops the run) also naming the rows after it that a glance finds
    bad (unreadable, or without chosen or rejected), so that one run names every such row to
    fix, not one a run; the rest are found as they are rendered."""
    bad = [row.location for row in rest if row.error is not None or not isinstance(row.values, dict)
           or row.values.get("chosen") is None or row.values.get("rejected") is None]
    if not bad:
        return e
    shown = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
    rows = f"{len(bad)} more rows after it cannot be read or lack" if len(bad) > 1 else \
        "1 more row after it cannot be read or lacks"
    return DataError(e.location, e.field, f"{e.reason}; {rows} chosen or rejected ({shown})")


def _with_skip_hint(e: DataError) -> DataError:
    """A bad row after good ones, or one without values (``LacksValues``), has a problem of its
    own, not the file's: say what to do."""
    return DataError(e.location, e.field, f"{e.reason} ({SKIP_HINT})")


def _where(location: str) -> int:
    """The line (or row) number a row's location ends with: ``data.jsonl:17`` or ``data.json:row 16``."""
    return int(location.rsplit(":", 1)[1].removeprefix("row "))


def tokenize_columns(
    rows: list[RawRow],
    tokenizer,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    skip_invalid: bool = False,
    show_progress: bool = True,
    chunks: token_store.TokenizedChunks | None = None,
    model_limits: tuple[int | None, int | None] = (None, None),
) -> tuple[TokenColumns, list[SkippedRow]]:
    """Validate, render and tokenize rows into columns. Bad rows raise ``DataError`` unless
    ``skip_invalid``, in which case they are returned as ``SkippedRow``s. ``chunks``: where each
    chunk of ``ROWS_PER_CHUNK`` rows is kept as it is tokenized, and taken from where an earlier
    build that stopped kept it (every row is rendered again: the checks come first).
    ``model_limits``: the model's (context, vocab_size); without ``skip_invalid`` the first pair
    past either stops the tokenizing at its chunk (``unfit_pairs``), not after the whole set."""
    if max_length is not None and max_prompt_length is not None and max_prompt_length >= max_length:
        raise ValueError(f"max_prompt_length ({max_prompt_length}) must be below max_length ({max_length})")
    rendered, skipped = _render_rows(rows, tokenizer, skip_invalid, show_progress)
    prefix, eos = special_prefix(tokenizer), tokenizer.eos_token_id
    starts = range(0, len(rendered), ROWS_PER_CHUNK)
    kept = {}  # start -> (columns, unfit) of the chunks a stopped build kept
    for start in starts if chunks is not None else ():
        done = chunks.load(start, min(ROWS_PER_CHUNK, len(rendered) - start))
        if done is not None:
            kept[start] = done
    resumed = sum(len(columns) + len(unfit) for columns, unfit in kept.values())
    if kept and show_progress:
        print(f"tokens: {resumed:,} of {len(rendered):,} rows were tokenized by a build that stopped; "
              "tokenizing the rest", file=sys.stderr)
    parts, unfit = [], []
    with tqdm(total=len(rendered), initial=resumed, desc="tokenizing", unit="rows",
              disable=not show_progress or len(rendered) < ROWS_PER_CHUNK) as bar, \
            _saying_what_is_kept(chunks, len(rendered)):
        for start in starts:
            chunk = rendered[start:start + ROWS_PER_CHUNK]
            if start in kept:
                columns, found = kept[start]
                parts.append(columns)
                unfit.extend(SkippedRow(*row) for row in found)
                _refuse_unfit(columns, chunk, model_limits, max_length, skip_invalid)
                continue
            found = []
            parts.append(_tokenize_chunk(chunk, tokenizer, prefix, eos, max_length, max_prompt_length,
                                         skip_invalid, found))
            _refuse_unfit(parts[-1], chunk, model_limits, max_length, skip_invalid)
            if chunks is not None:
                chunks.save(start, len(chunk), parts[-1], [(r.location, r.field, r.reason) for r in found])
            unfit.extend(found)
            bar.update(len(chunk))
    return TokenColumns.concatenate(parts), skipped + unfit


def _refuse_unfit(columns: TokenColumns, chunk: list[tuple[RawRow, RenderedRow]],
                  model_limits: tuple[int | None, int | None], max_length: int | None, skip_invalid: bool) -> None:
    """The first pair of a chunk the model cannot take (``unfit_pairs``) as a ``DataError``, before
    the next chunk is tokenized (a --max-length past a model's context was refused after the
    whole set: minutes at Tulu's size); with ``skip_invalid`` they are skipped later (``_fitting``)."""
    context, vocab_size = model_limits
    if skip_invalid or (context is None and vocab_size is None):
        return
    for problem in unfit_pairs(columns, vocab_size, context, max_length):
        for i, reason in problem:
            row = int(columns.rows[i])
            raise DataError(next(r.location for r, _ in chunk if r.index == row), None, reason)


@contextmanager
def _saying_what_is_kept(chunks: token_store.TokenizedChunks | None, total: int) -> Iterator[None]:
    """A stop signal while tokenizing stops at once (``Interrupted``): its line then says how many
    of the ``total`` rows are kept for the next build, so a user sees the stop lost little (the
    chunk it stopped in, not "nothing", which the signal's handler says)."""
    try:
        yield
    except Interrupted as stop:
        if chunks is not None and stop.message in ("", NOTHING_LOST):
            stop.message = (f"{chunks.rows_kept:,} of {total:,} rows tokenized are kept in {chunks.directory}; "
                            "the next build tokenizes the rest" if chunks.rows_kept else
                            f"none of the {total:,} rows' tokens were kept yet (they are kept {ROWS_PER_CHUNK:,} "
                            "rows at a time); the next build tokenizes them all")
        raise


def _tokenize_chunk(chunk: list[tuple[RawRow, RenderedRow]], tokenizer, prefix: list[int], eos: int | None,
                    max_length: int | None, max_prompt_length: int | None, skip_invalid: bool,
                    unfit: list[SkippedRow]) -> TokenColumns:
    # Each completion's ids are those after the prompt's in prompt + completion (see
    # dpocache.data.tokenize). Special tokens of plain text follow TRL: the prompt gets what the
    # tokenizer itself adds in front (a BOS only for tokenizers that add one), each completion
    # one EOS unless it already ends with it. A chat template brings its own.
    prompt_ids, completion_ids = continuation_ids(
        tokenizer, [r.prompt for _, r in chunk], [[r.chosen, r.rejected] for _, r in chunk])
    triples, rows, where, cut = [], [], [], []
    for (row, r), prompt, (chosen, rejected) in zip(chunk, prompt_ids, completion_ids):
        if not r.templated:
            prompt = with_prefix(prompt, prefix)
            chosen, rejected = with_eos(chosen, eos), with_eos(rejected, eos)
        try:
            triple, truncated = _finish_pair(row, prompt, chosen, rejected, max_length, max_prompt_length)
        except DataError as e:
            if not skip_invalid:
                raise
            unfit.append(SkippedRow(e.location, e.field, e.reason))
            continue
        triples.append(triple)
        rows.append(row.index)
        where.append(_where(row.location))
        cut.append(truncated)
    return TokenColumns.from_pairs(triples, rows, where, cut)


def tokenize_rows(
    rows: list[RawRow],
    tokenizer,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    skip_invalid: bool = False,
    show_progress: bool = True,
) -> tuple[list[TokenizedPair], list[SkippedRow]]:
    """``tokenize_columns``, its pairs as ``TokenizedPair``s."""
    columns, skipped = tokenize_columns(rows, tokenizer, max_length, max_prompt_length, skip_invalid, show_progress)
    return [TokenizedPair(p.index, p.prompt_ids, p.chosen_ids, p.rejected_ids, p.key, p.truncated)
            for p in PairsView(columns)], skipped


def _finish_pair(row: RawRow, prompt, chosen, rejected, max_length, max_prompt_length) -> tuple[tuple, bool]:
    """The pair's (prompt, chosen, rejected) after truncation, and whether it was cut."""
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if not ids:
            raise DataError(row.location, name, "tokenizes to no tokens")
    cut = max_length is not None and len(prompt) + max(len(chosen), len(rejected)) > max_length
    prompt, chosen, rejected = truncate_pair(prompt, chosen, rejected, max_length, max_prompt_length)
    if not chosen or not rejected:
        raise DataError(row.location, "prompt", f"the prompt ({len(prompt)} tokens after truncation) leaves "
                        f"no room for a completion within max_length={max_length}")
    return (prompt, chosen, rejected), cut


def load_preference_data(
    source: Any,
    tokenizer,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    skip_invalid: bool = False,
    show_progress: bool = True,
    columns: tuple[str | None, str, str] = STANDARD_COLUMNS,
    context: int | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    cache_read_only: bool = False,
) -> PreferenceData:
    """Read, validate, render and tokenize a preference data set. See the module docstring.

    ``columns``: the (prompt, chosen, rejected) column names; a prompt column of None reads every
    row as implicit-prompt. ``context``: the model's context length; a pair longer than it (after
    truncation) is a bad row. ``vocab_size``: the model's embedding rows; a pair with a token id
    beyond them (a tokenizer grown without resizing the model) is a bad row. ``cache_dir``: keep
    the tokenized pairs in a token store there (``dpocache.data.token_store``), tokenized by the
    first call and memory-mapped by every later one; a data file only (rows given in memory, and
    tokenizers without a fast backend, are tokenized in memory). A store that cannot be written
    there raises the ``OSError``, unless ``cache_read_only`` (a command that only reads the
    cache): then the tokens stay in memory, with a line saying so."""
    if not callable(tokenizer) or not hasattr(tokenizer, "eos_token_id"):
        raise TypeError(f"tokenizer: expected a tokenizer, got {type(tokenizer).__name__}; load it first: "
                        "transformers.AutoTokenizer.from_pretrained(model_dir)")
    path = isinstance(source, (str, Path))
    files = sources.data_files(source) if path else None  # several: resolved once, for the key and the names

    def tokenize(chunks: token_store.TokenizedChunks | None = None) -> token_store.StoredTokens:
        return _tokenize_source(source, tokenizer, max_length, max_prompt_length, skip_invalid, show_progress,
                                columns, chunks, files, (context, vocab_size))

    key = None
    if cache_dir is not None and path and (files is not None or Path(source).exists()):
        settings = {"max_length": max_length, "max_prompt_length": max_prompt_length, "columns": list(columns)}
        key = token_store.store_key(Path(source), tokenizer, settings, files)
    # the source's absolute path: ``cache info`` names it from any working directory
    tokens = token_store.open_or_build(Path(cache_dir), key, str(Path(source).absolute()), tokenize, show_progress,
                                       cache_read_only, settings) if key else tokenize()
    name = source_name(source)
    locate = _Locator(str(Path(source)) if path else name, tokens, files)
    skipped = [SkippedRow(locate(where), f, reason) for where, f, reason in tokens.skipped]
    if skipped and not skip_invalid:  # a store tokenized with --skip-invalid, read without it
        raise _with_skip_hint(DataError(skipped[0].location, skipped[0].field, skipped[0].reason))
    return _fitting(name, locate, tokens, skipped, skip_invalid, context, max_length, vocab_size)


class _Locator:
    """Names a row of ``tokens`` by where it is now: ``base`` (the source as given on this run,
    whichever name a store was built under) and its line or row, in a source of several files
    its own file's (the store's files are those the source names now, in order: the key covers
    their names and bytes)."""

    def __init__(self, base: str, tokens: token_store.StoredTokens, files: list[Path] | None) -> None:
        """``files``: those the source names now (``sources.data_files``); None for one file."""
        self.base, self.kind, self.files = base, tokens.location_kind, files
        self.firsts = [first for _, first in tokens.files]

    def __call__(self, where: int | list[int] | str) -> str:
        """``where``: the line or row; in a source of several files ``[file, line or row]`` (or a
        location in words)."""
        base = self.base
        if isinstance(where, str):
            return where
        if isinstance(where, (list, tuple)):
            base, where = str(self.files[where[0]]), where[1]
        return f"{base}:{'row ' if self.kind == 'row' else ''}{where}"

    def pair(self, columns: TokenColumns, i: int) -> str:
        """Where pair ``i`` of ``columns`` was read."""
        where = int(columns.where[i])
        if not self.files:
            return self(where)
        return self([bisect.bisect_right(self.firsts, int(columns.rows[i])) - 1, where])


def _tokenize_source(source: Any, tokenizer, max_length, max_prompt_length, skip_invalid: bool,
                     show_progress: bool, columns: tuple[str | None, str, str],
                     chunks: token_store.TokenizedChunks | None = None, files: list[Path] | None = None,
                     model_limits: tuple[int | None, int | None] = (None, None)):
    """Read and tokenize ``source``: its columns, skipped rows and how its rows are located
    (``files``: the data files it names, where it names several; ``model_limits``:
    ``tokenize_columns``')."""
    name, rows = read_rows(source)
    if not rows:
        raise DataError(name, None, "no rows")
    rows = map_columns(rows, columns)
    token_columns, skipped = tokenize_columns(rows, tokenizer, max_length, max_prompt_length, skip_invalid,
                                              show_progress, chunks, model_limits)
    kind = "row" if rows[0].location.rsplit(":", 1)[1].startswith("row ") else "line"
    firsts = _files_read(files, rows)
    number = {file: k for k, (file, _) in enumerate(firsts)}

    def where(location: str) -> int | list[int] | str:
        # In a source of several files, [the file's number, its line or row]: named by the
        # file's path when read (_Locator), whatever the source was called when stored. A row
        # a stopped build found unfit under another name for the files keeps its location.
        file = location.rpartition(":")[0]
        if not firsts:
            return _where(location)
        return [number[file], _where(location)] if file in number else location

    return token_store.StoredTokens(token_columns, [(where(s.location), s.field, s.reason) for s in skipped], kind,
                                    files=[(Path(name).name, first) for name, first in firsts])


def _files_read(files: list[Path] | None, rows: list[RawRow]) -> list[tuple[str, int]]:
    """A source of several ``files``: each file's path as read and its first row (a file without
    rows: the next one's, so that numbering the files counts it too); [] for one file."""
    if files is None:
        return []
    starts: dict[str, int] = {}
    for row in rows:
        starts.setdefault(row.location.rpartition(":")[0], row.index)
    firsts, first = [], len(rows)
    for file in reversed(files):
        first = starts.get(str(file), first)
        firsts.append(first)
    return [(str(file), first) for file, first in zip(files, reversed(firsts))]


def _fitting(name: str, locate: _Locator, tokens, skipped: list[SkippedRow], skip_invalid: bool,
             context: int | None, max_length: int | None, vocab_size: int | None) -> PreferenceData:
    """The data with pairs the model cannot take (``unfit_pairs``) raised, or skipped with ``skip_invalid``."""
    columns = tokens.columns
    keep = np.ones(len(columns), bool)
    for problem in unfit_pairs(columns, vocab_size, context, max_length):
        for i, reason in problem:
            err = DataError(locate.pair(columns, i), None, reason)
            if not skip_invalid:
                raise err
            skipped.append(SkippedRow(err.location, err.field, err.reason))
            keep[i] = False
    if not keep.any():
        raise DataError(name, None, f"no valid rows ({len(skipped)} skipped; first: {skipped[0] if skipped else '-'})")
    return PreferenceData(name, PairsView(columns, None if keep.all() else np.flatnonzero(keep)), skipped)


def unfit_pairs(columns: TokenColumns, vocab_size: int | None, context: int | None, max_length: int | None,
                max_length_option: str = "--max-length"):
    """For each check, the (pair, reason) of every pair that fails it, the reason naming
    ``max_length_option`` as the fix of a pair past the context. A token id the model's
    embedding has no row for fails on the first forward (an IndexError, or a device assert on a
    GPU); a sequence longer than the model's context has no positions (and a 10 MB row would
    allocate terabytes)."""
    if vocab_size is not None:
        top = columns.max_ids()
        yield ((int(i), f"token id {int(top[i])} is outside the model's vocabulary (vocab_size {vocab_size} in "
                "config.json): the tokenizer has tokens the model's embeddings lack (resize them with "
                "model.resize_token_embeddings and save the model)") for i in np.flatnonzero(top >= vocab_size))
    if context is not None:
        lengths = columns.lengths()
        longest = lengths[:, 0] + lengths[:, 1:].max(axis=1)
        cut = f" after truncation to max_length={max_length}" if max_length is not None else ""
        yield ((int(i), f"{int(longest[i])} tokens{cut}, longer than the model's context ({context} "
                f"positions, from its config.json); set {max_length_option} {context} or less")
               for i in np.flatnonzero(longest > context))
