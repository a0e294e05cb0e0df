"""Preference data: load rows, validate them, render chat templates, tokenize, truncate, key.

Accepted row formats (those TRL documents):

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``
- conversational: ``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
  messages, rendered with the tokenizer's chat template
- implicit prompt: only ``chosen`` and ``rejected``, as full strings or conversations; their
  longest common prefix is the prompt

A conversational row may also carry, as TRL 1.16 reads them, a ``tools`` column (a list of
JSON-schema function descriptions, or that list as a JSON string) and a ``chat_template_kwargs``
column (an object, e.g. ``{"enable_thinking": false}``); both are passed to the tokenizer's
``apply_chat_template`` for that row only. Plain-text rows have no template to pass them to.

Sources: ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``), ``.parquet``,
``.csv`` files, a directory written by ``datasets.Dataset.save_to_disk`` (or a one-split ``DatasetDict``'s), a
``datasets.Dataset`` or a list of dicts. Other column names are mapped with ``columns``
(``--data.prompt_field question``); a row without the prompt column is read as an implicit-prompt
row only when it has no other text column (a ``question`` column is more likely a prompt under
another name than a column to ignore), or when the prompt column is ``none``. A row that lacks
columns gets one error naming every missing field, the row's columns and every flag to pass.

Every bad row, whatever is wrong with it (not UTF-8, malformed or too deeply nested JSON, a
lone surrogate, a missing field, longer than the model's context), is a ``DataError`` naming the
file, the line or row and the field; ``skip_invalid`` skips and lists such rows instead.

Truncation rule (``max_length`` L, ``max_prompt_length`` P): a sequence is prompt + one
completion, and both sequences of a pair must fit in L tokens.

1. If the prompt plus the longer completion fits, nothing is cut.
2. Otherwise the prompt keeps its *last* ``max(P, L - longest completion, 1)`` tokens (its end
   is what the completion answers), never fewer than it has to, and never none: the first
   completion token is scored from the prompt's last position.
3. Each completion then keeps its *first* ``L - kept prompt`` tokens.

A pair whose kept prompt leaves no room for a completion is a bad row.

Each pair's example key is a hash of its final token ids (after template and truncation), so
any change to the tokenizer, template or length limits that changes the ids changes the key.

The pairs are held as columns of integers (``dpocache.data.columns``); given a cache directory,
``load_preference_data`` keeps them in a token store there, tokenized once and memory-mapped by
every later call (``dpocache.data.token_store``).
"""

from __future__ import annotations

import ast
import bisect
import csv
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from dpocache.data import sources, token_store
from dpocache.data.columns import PairsView, TokenColumns
from dpocache.data.keys import KEY_BYTES, example_key  # noqa: F401 (public names here)
from dpocache.data.tokenize import continuation_ids, tokenize_continuations  # noqa: F401 (a public name here)
from dpocache.runtime.signals import NOTHING_LOST, Interrupted

STANDARD_COLUMNS = ("prompt", "chosen", "rejected")
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")  # per-row chat-template inputs, kept by map_columns


class DataError(ValueError):
    """A bad row: the message names the source, the line or row, and the field."""

    def __init__(self, location: str, field_name: str | None, reason: str):
        self.location = location
        self.field = field_name
        self.reason = reason
        where = f"{location}: field '{field_name}'" if field_name else location
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class RawRow:
    """One row as read from the source, with where it came from (for error messages)."""

    index: int  # position among the source's rows, 0-based
    location: str  # "data.jsonl:17" (line) or "data.parquet:row 16"
    values: Any  # the parsed object; validated later
    error: DataError | None = None  # a row that could not be read: raised (or skipped) at validation


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


# --------------------------------------------------------------------------------------------
# Reading rows


def source_name(source: Any) -> str:
    """How rows and errors name ``source``: its path as given, ``<rows>`` or ``<dataset>``."""
    if isinstance(source, (list, tuple)):
        return "<rows>"
    return "<dataset>" if _is_hf_dataset(source) else str(source)


def read_rows(source: Any) -> tuple[str, list[RawRow]]:
    """Read every row of ``source`` without validating it. Returns (name, rows)."""
    name = source_name(source)
    if isinstance(source, (list, tuple)) or _is_hf_dataset(source):
        return name, [RawRow(i, f"{name}:row {i}", r) for i, r in enumerate(source)]
    files = sources.data_files(source)  # several: a pattern, or a folder of data files
    if files is not None:
        rows = []
        for file in files:  # each row named by its own file and line (or row)
            rows += [replace(row, index=len(rows) + i) for i, row in enumerate(_read_file(file))]
        return name, rows
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{name}: no such file or directory")
    if path.is_dir():
        return name, _read_hf_dir(path)
    return name, _read_file(path)


def _read_file(path: Path) -> list[RawRow]:
    suffix = path.suffix.lower()
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
    if suffix not in readers:
        raise DataError(str(path), None, f"unknown file type '{suffix}'; expected one of {sorted(readers)} "
                        "or a directory written by datasets.save_to_disk")
    return readers[suffix](path)


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")


def _decode_error(location: str, e: UnicodeDecodeError) -> DataError:
    return DataError(location, None, f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})")


def json_problem(e: json.JSONDecodeError, one_line: bool = False) -> str:
    """What ``json`` found and where, in words: its "Invalid control character at" (a tab, or a
    line cut in two inside a string) said "at at column N" and not what to do; where the text
    stops before its JSON does, it named what it expected next, not that the text was cut short
    (``one_line``: a JSON Lines line, where a record spread over lines is cut the same way)."""
    msg = e.msg.removesuffix(" at")
    if msg == "Invalid control character":
        return f"a raw tab or line break inside a string at column {e.colno}: write it as \\t or \\n"
    if msg == "Unterminated string starting" or 0 < len(e.doc.rstrip()) <= e.pos:
        where = f"inside a string opened at column {e.colno}" if msg.startswith("Unterminated") else (
            f"at column {e.colno}")
        if one_line:
            return (f"the line ends {where} before its JSON does: cut short, or a record written over several "
                    "lines; JSON Lines holds one record a line")
        return f"the text ends {where} before its JSON does: cut short"
    return f"{msg} at column {e.colno}"


def _parse_json(location: str, text: str, one_line: bool = False) -> Any:
    """``json.loads``, its failures as a ``DataError`` naming ``location`` (``one_line``: a JSON
    Lines line, without its line break)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(location, None, f"malformed JSON ({json_problem(e, one_line)})") from None
    except RecursionError:
        raise DataError(location, None, "JSON nested too deeply to read") from None


def _read_jsonl(path: Path) -> list[RawRow]:
    """One row per non-blank line. A line that is not UTF-8 or not JSON is a row with an
    ``error``: the whole file is read, and ``skip_invalid`` can skip it like any bad row."""
    rows = []
    with open(path, "rb") as f:  # bytes: a bad byte is one line's error, not the file's
        for line_no, raw in enumerate(f, start=1):
            location = f"{path}:{line_no}"
            try:
                # utf-8-sig on the first line: a byte-order mark (Windows editors write one) is no text
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                rows.append(RawRow(len(rows), location, None, _decode_error(location, e)))
                continue
            if not line.strip():
                continue
            try:
                # without its line break: a line cut short reads as such, wherever it is in the file
                rows.append(RawRow(len(rows), location, _parse_json(location, line.rstrip("\r\n"), one_line=True)))
            except DataError as e:
                rows.append(RawRow(len(rows), location, None, e))
    return rows


def _read_json(path: Path) -> list[RawRow]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as Windows editors write, is no text
    except UnicodeDecodeError as e:
        data = e.object  # the bytes after a byte-order mark: e.start counts from there
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1)
        raise DataError(f"{path}:{line}", None,
                        f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}", None, f"malformed JSON ({json_problem(e)})") from None
    except RecursionError:
        raise DataError(str(path), None, "JSON nested too deeply to read") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(str(path), None, "expected a JSON list of rows (or {\"data\": [...]})")
    return [RawRow(i, f"{path}:row {i}", r) for i, r in enumerate(obj)]


def _read_csv(path: Path) -> list[RawRow]:
    rows = []
    # A long row is read whole, as from .jsonl (truncation is max_length's job), not refused by
    # the csv module's 128 KiB field limit with a traceback.
    limit = csv.field_size_limit(2**31 - 1)
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate (U+DC80..U+DCFF), which
    # no UTF-8 text can hold, so the row that holds it is found and named below.
    try:
        # utf-8-sig: a byte-order mark (spreadsheets write one) would be part of the first column's name
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(f)
            for values in reader:
                # line_num is the line the record ended on; with multi-line fields that is the
                # most useful line to name.
                location = f"{path}:{reader.line_num}"
                rows.append(RawRow(len(rows), location, dict(values), _csv_bad_bytes(location, values)))
    except csv.Error as e:  # e.g. a NUL byte: the reader cannot go on, so the file is the error
        raise DataError(f"{path}:{reader.line_num + 1}", None, f"unreadable CSV ({e})") from None
    finally:
        csv.field_size_limit(limit)
    return rows


def _csv_bad_bytes(location: str, values: dict) -> DataError | None:
    for name, value in values.items():
        for text in (name, value):
            bad = next((c for c in text if "\udc80" <= c <= "\udcff"), None) if isinstance(text, str) else None
            if bad is not None:
                return DataError(location, name if text is value else None,
                                 f"not valid UTF-8 (byte 0x{ord(bad) - 0xdc00:02x})")
    return None


def _read_parquet(path: Path) -> list[RawRow]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pyarrow.ArrowException as e:  # not a parquet file, or a truncated one
        raise DataError(str(path), None, f"not a readable parquet file ({e})") from None
    return [RawRow(i, f"{path}:row {i}", r) for i, r in enumerate(table.to_pylist())]


def _read_hf_dir(path: Path) -> list[RawRow]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        # Several splits: which one is meant depends on the flag (--data or --eval-data), which
        # this reader does not know; reading "train" for both evaluated on the training pairs.
        if len(ds) != 1:
            raise DataError(str(path), None, f"a DatasetDict with splits {list(ds)}; pass one split's directory "
                            f"({path / next(iter(ds))})")
        ds = next(iter(ds.values()))
    return [RawRow(i, f"{path}:row {i}", r) for i, r in enumerate(ds)]


# --------------------------------------------------------------------------------------------
# Validation and rendering to text


@dataclass(frozen=True)
class _RenderedRow:
    """A valid row as text: the prompt, and each completion as it continues the prompt."""

    prompt: str
    chosen: str
    rejected: str
    templated: bool  # rendered by the chat template (which adds its own special tokens)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _check_messages(location: str, field_name: str, messages: list) -> None:
    if not messages:
        raise DataError(location, field_name, "empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(location, f"{field_name}[{i}]", "each message needs string 'role' and 'content'")
        _check_encodable(location, f"{field_name}[{i}]", m["role"] + m["content"])


def _check_encodable(location: str, field_name: str, value: str) -> None:
    """A lone surrogate (a JSON ``\\ud800`` escape without its pair) is a valid Python string
    but no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(location, field_name, f"a lone surrogate U+{ord(value[e.start]):04X} at character "
                        f"{e.start + 1} (an unpaired \\u escape) is not text") from None


def check_text(location: str, field_name: str, value: Any) -> str:
    """A plain-text field as a string, or a ``DataError`` saying why it is not one."""
    if value is None:
        raise DataError(location, field_name, "missing")
    if not isinstance(value, str):
        raise DataError(location, field_name, f"expected a string or a list of messages, got {type(value).__name__}")
    if not value.strip():
        raise DataError(location, field_name, "empty string" if not value else f"only whitespace ({value!r})")
    _check_encodable(location, field_name, value)
    if _written_messages(value):
        raise DataError(location, field_name, "a list of chat messages written as text (as datasets' to_csv writes "
                        "them); give the rows as .jsonl, .parquet or a datasets directory, which keep them as lists")
    return value


def _written_messages(text: str) -> bool:
    """Whether the whole text is a list of {"role", "content"} messages as JSON or a Python repr
    (what a CSV cell holds when a conversational set is written to CSV): as plain text the pair
    would be trained on the brackets and quotes."""
    text = text.strip()
    if not (text.startswith("[{") and text.endswith("}]")):
        return False
    try:
        value = ast.literal_eval(text)  # a Python literal; JSON's null/true/false aside, JSON is one too
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _common_prefix_len(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_divergence(location: str, chosen: list, rejected: list, n: int) -> None:
    """Conversations that first differ at message ``n`` in a user's or the system's turn: the
    prompt would end on an answer and the completions start with the user's words, which the
    chat template then refused as "not a prefix", naming neither. Said as it is."""
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        role = messages[n].get("role") if n < len(messages) else None
        if role in ("user", "system"):
            raise DataError(location, name, f"chosen and rejected differ first at message {n}, a {role} turn: a "
                            "pair's conversations may differ in the assistant's answer only (the turns before it "
                            "are the prompt)")


def _split_implicit(location: str, chosen: Any, rejected: Any, text_prompt: bool = False) -> tuple[Any, Any, Any]:
    """Implicit prompt: the longest common prefix of chosen and rejected is the prompt.
    ``text_prompt``: the row's prompt is text beside these conversations, and not used."""
    if _is_messages(chosen) and _is_messages(rejected):
        for name, messages in (("chosen", chosen), ("rejected", rejected)):
            _check_messages(location, name, messages)  # indices as in the row, before the split
        n = _common_prefix_len(chosen, rejected)
        if n and n == min(len(chosen), len(rejected)):
            # One is the start of the other, or both the same (an answer given twice): as TRL's
            # extract_prompt, the last message they share is an answer in each.
            n -= 1
            if n == 0:
                shorter = "chosen" if len(chosen) <= len(rejected) else "rejected"
                raise DataError(location, shorter, "one message, which the other completion starts with: no prompt "
                                "before the answers")
        if n == 0 and text_prompt:
            raise DataError(location, "prompt", "text, where chosen and rejected are conversations; such rows are "
                            "read as their messages both start with, but these share no first message: give the "
                            "prompt as messages too")
        if n == 0:
            raise DataError(location, "chosen", "implicit prompt: chosen and rejected share no first message")
        _check_divergence(location, chosen, rejected, n)
        return chosen[:n], chosen[n:], rejected[n:]
    chosen = check_text(location, "chosen", chosen)
    rejected = check_text(location, "rejected", rejected)
    n = _common_prefix_len(chosen, rejected)
    # Cut at a word boundary, so that the completion starts with its own word rather than the
    # tail of a shared one (TRL 1.16's extract_prompt cuts where the texts differ: "The answer
    # is 4" + "2"; see docs/data.md).
    while n > 0 and not chosen[n - 1].isspace() and n < len(chosen) and not chosen[n].isspace():
        n -= 1
    # Leave the space to the completion (" blue", not "blue"): BPE vocabularies hold words
    # with their leading space.
    if n > 0 and chosen[n - 1] == " ":
        n -= 1
    if n == 0:
        raise DataError(location, "chosen", "implicit prompt: chosen and rejected share no prefix")
    return chosen[:n], chosen[n:], rejected[n:]


# Arguments dpocache itself gives apply_chat_template: a row cannot override them.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                             "return_dict", "return_tensors")


def _parse_json_field(loc: str, field_name: str, text: str) -> Any:
    try:
        return _parse_json(loc, text)
    except DataError as e:
        raise DataError(loc, field_name, e.reason) from None


def template_inputs(loc: str, values: dict) -> dict:
    """The row's extra ``apply_chat_template`` arguments: its ``tools`` and ``chat_template_kwargs``."""
    kwargs = values.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif isinstance(kwargs, str):  # a CSV cell, or a column stored as text
        kwargs = _parse_json_field(loc, "chat_template_kwargs", kwargs)
    if not isinstance(kwargs, dict):
        raise DataError(loc, "chat_template_kwargs", f"expected an object, got {type(kwargs).__name__}")
    reserved = [k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise DataError(loc, "chat_template_kwargs", f"'{reserved[0]}' is set by dpocache, not per row")
    kwargs = dict(kwargs)
    tools = values.get("tools")
    if isinstance(tools, str):
        tools = _parse_json_field(loc, "tools", tools) if tools.strip() else None
    if tools is not None:
        if not isinstance(tools, list):
            raise DataError(loc, "tools", f"expected a list of tool descriptions, got {type(tools).__name__}")
        kwargs["tools"] = tools
    return kwargs


def _render(row: RawRow, tokenizer) -> _RenderedRow:
    if row.error is not None:
        raise row.error
    values = row.values
    loc = row.location
    if not isinstance(values, dict):
        raise DataError(loc, None, f"expected an object with prompt/chosen/rejected, got {type(values).__name__}")
    for name in ("chosen", "rejected"):
        if values.get(name) is None:
            raise DataError(loc, name, "missing")
    prompt, chosen, rejected = values.get("prompt"), values["chosen"], values["rejected"]
    if prompt is None:
        prompt, chosen, rejected = _split_implicit(loc, chosen, rejected)
    elif isinstance(prompt, str) and _is_messages(chosen) and _is_messages(rejected):
        # A text prompt beside conversations that hold it (Tulu 3's preference mixtures: the user's
        # turn in chosen and rejected, and again as text): the prompt is the messages both start
        # with, as TRL 1.16's maybe_extract_prompt reads such rows and open-instruct trains them.
        prompt, chosen, rejected = _split_implicit(loc, chosen, rejected, text_prompt=True)
    kinds = {name: _is_messages(v) for name, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
    if all(kinds.values()):
        prompt_text, (chosen_text, rejected_text) = render_conversation(
            loc, prompt, [("chosen", chosen), ("rejected", rejected)], tokenizer, template_inputs(loc, values))
        return _RenderedRow(prompt_text, chosen_text, rejected_text, templated=True)
    if any(kinds.values()):
        odd = [n for n, is_msgs in kinds.items() if not is_msgs]
        raise DataError(loc, odd[0], "mixes messages and plain text: give all fields as messages or all as strings")
    return _RenderedRow(
        check_text(loc, "prompt", prompt), check_text(loc, "chosen", chosen),
        check_text(loc, "rejected", rejected), templated=False,
    )


def render_conversation(loc: str, prompt: list, completions: Sequence[tuple[str, list]], tokenizer,
                        template_kwargs: dict | None = None) -> tuple[str, list[str]]:
    """The prompt's text (with the generation prompt) and each completion's text as it continues
    it, after checking every message. ``completions``: (field name, messages) for each;
    ``template_kwargs``: the row's ``tools`` and ``chat_template_kwargs`` (see ``template_inputs``).
    The one renderer of messages, for pairs and for ``dpocache score``'s rows alike."""
    template_kwargs = template_kwargs or {}
    for name, msgs in (("prompt", prompt), *completions):
        _check_messages(loc, name, msgs)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(loc, "prompt", "conversational row but the tokenizer has no chat template")
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    texts = []
    for name, msgs in completions:
        full = tokenizer.apply_chat_template(prompt + msgs, tokenize=False, **template_kwargs)
        if not full.startswith(prompt_text):
            raise DataError(loc, name, "the chat template does not render the prompt as a prefix of the conversation")
        texts.append(full[len(prompt_text):])
    return prompt_text, texts


# --------------------------------------------------------------------------------------------
# Tokenization and truncation


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
                 show_progress: bool = False) -> tuple[list[tuple[RawRow, _RenderedRow]], list[SkippedRow]]:
    """Every row checked and rendered to text before any is tokenized: a bad row is reported in
    a moment, not after the whole set's tokenization. A bar where it takes a while (a chat
    template renders about 2,500 conversation rows a second on one core: minutes for Tulu 3)."""
    skipped: list[SkippedRow] = []
    rendered: list[tuple[RawRow, _RenderedRow]] = []
    with tqdm(total=len(rows), desc="checking rows", unit="rows", mininterval=1.0,
              disable=not show_progress or len(rows) < ROWS_PER_CHUNK) as bar:
        for i, row in enumerate(rows):
            try:
                rendered.append((row, _render(row, tokenizer)))
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


def _refuse_unfit(columns: TokenColumns, chunk: list[tuple[RawRow, _RenderedRow]],
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


def _tokenize_chunk(chunk: list[tuple[RawRow, _RenderedRow]], tokenizer, prefix: list[int], eos: int | None,
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


# --------------------------------------------------------------------------------------------
# Column names


def map_columns(rows: list[RawRow], columns: tuple[str | None, str, str] = STANDARD_COLUMNS) -> list[RawRow]:
    """Rows with their (prompt, chosen, rejected) columns under the standard names; a row whose
    columns do not fit gets an ``error`` naming every missing field and the flags that map them,
    or, where other rows have those columns, a ``LacksValues`` (the row lacks its values)."""
    out, missing, mapped = [], [], False
    for row in rows:
        if row.error is not None or not isinstance(row.values, dict):
            out.append(row)  # reported as it is by validation
            continue
        try:
            out.append(replace(row, values=_mapped(row, columns)))
            mapped = True
        except MissingFields as e:
            missing.append(len(out))
            out.append(replace(row, error=e))
        except DataError as e:
            out.append(replace(row, error=e))
    for i in missing if mapped else ():  # other rows have the columns: this row lacks its values
        e = out[i].error
        what = f"{_missing_names(e.missing, columns)} missing, where other rows have them" if len(e.missing) > 1 \
            else "missing, where other rows have it"
        out[i] = replace(out[i], error=LacksValues(e.location, e.field, what))
    return out


def _text_columns(values: dict, exclude: tuple) -> list[str]:
    exclude = tuple(exclude) + TEMPLATE_COLUMNS
    return [k for k, v in values.items() if k not in exclude and ((isinstance(v, str) and v.strip()) or
                                                                 (_is_messages(v) and v))]


def _mapped(row: RawRow, columns: tuple[str | None, str, str]) -> dict:
    prompt_field, chosen_field, rejected_field = columns
    values = row.values
    nulls = [name for name in (chosen_field, rejected_field) if name in values and values[name] is None]
    if nulls:  # the column is there without a value: "missing" sent users to map a column the row has
        what = "null, not a completion" if len(nulls) == 1 else \
            f"fields {', '.join(map(repr, nulls))} null, not completions"
        raise LacksValues(row.location, nulls[0] if len(nulls) == 1 else None, what)
    missing = _missing_fields(values, columns)
    if missing:
        raise _missing_error(row, columns, missing)
    mapped = {"chosen": values[chosen_field], "rejected": values[rejected_field]}
    mapped.update({k: values[k] for k in TEMPLATE_COLUMNS if values.get(k) is not None})
    if prompt_field is not None and values.get(prompt_field) is not None:
        mapped["prompt"] = values[prompt_field]
    elif prompt_field in values and not _conversations(values, columns):
        # The column is there without a value (a parquet null, "prompt": null): this row lost
        # its prompt, and its chosen and rejected are answers, not prompt + answer.
        raise DataError(row.location, prompt_field, "null (--data.prompt_field none reads every row's prompt "
                        "from the common start of chosen and rejected)")
    return mapped  # or implicit prompt: the row holds only chosen and rejected


def _missing_fields(values: dict, columns: tuple[str | None, str, str]) -> list[str]:
    """The standard fields (``prompt``, ``chosen``, ``rejected``) whose column the row lacks."""
    prompt_field, chosen_field, rejected_field = columns
    missing = [std for std, name in (("chosen", chosen_field), ("rejected", rejected_field))
               if values.get(name) is None]
    # Without its prompt column, a row is read as implicit-prompt only when no text column is left
    # over for the prompt once chosen and rejected have theirs: a question column is more likely
    # the prompt under another name than a column to ignore, and reading the row as implicit-prompt
    # would drop that prompt without a word.
    if prompt_field is not None and prompt_field not in values and not _conversations(values, columns) and (
            prompt_field != "prompt" or len(_text_columns(values, columns)) > len(missing)):
        missing.insert(0, "prompt")
    return missing


def _conversations(values: dict, columns: tuple[str | None, str, str]) -> bool:
    """Chosen and rejected are both messages: a text prompt beside them is not used (their common
    first messages are the prompt), so a row without one (a shard of a mixture that lacks the
    column, a null) reads the same, not as a row that lost its prompt."""
    return _is_messages(values.get(columns[1])) and _is_messages(values.get(columns[2]))


class LacksValues(DataError):
    """A row without values of its columns (null), or of columns other rows have: the row's
    problem, not the mapping's."""


class MissingFields(DataError):
    """A row without the columns of ``missing`` (standard names: prompt, chosen, rejected)."""

    def __init__(self, location: str, field_name: str | None, reason: str, missing: list[str]):
        super().__init__(location, field_name, reason)
        self.missing = missing


def _missing_names(missing: list[str], columns: tuple[str | None, str, str]) -> str:
    """``fields 'chosen', 'rejected'``: the missing columns by their names in the file."""
    names = dict(zip(STANDARD_COLUMNS, columns))
    return "fields " + ", ".join(repr(names[m]) for m in missing)


def _missing_error(row: RawRow, columns: tuple[str | None, str, str], missing: list[str]) -> DataError:
    """Every missing field in one error, with the row's columns and every mapping flag to pass:
    a data set of question/good/bad columns took three runs to map, one field at a time."""
    names = dict(zip(STANDARD_COLUMNS, columns))
    others = _text_columns(row.values, columns)
    # As many unmapped text columns as missing fields: map them in the file's order (TRL's and
    # the usual one: prompt, chosen, rejected). Otherwise the user picks.
    guess = dict(zip(missing, others)) if len(others) == len(missing) else {}
    flags = " ".join(f"--data.{std}_field {guess.get(std, 'COLUMN')}" for std in missing)
    has = f"columns {', '.join(map(repr, row.values))}" if row.values else "no columns"
    reason = f"the row has {has}: pass {flags}"
    if len(guess) > 1:  # an order is a guess, and a swapped chosen and rejected trains the opposite preference
        preferred = f", above all that '{guess['chosen']}' is the preferred completion" if "chosen" in guess else ""
        reason += f" (guessed from the file's column order: check it{preferred})"
    if missing == ["prompt"]:
        reason += " (or --data.prompt_field none: chosen and rejected hold the prompt)"
    if len(missing) == 1:
        return MissingFields(row.location, names[missing[0]], f"missing; {reason}", missing)
    return MissingFields(row.location, None, f"{_missing_names(missing, columns)} missing; {reason}", missing)


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON lines (a helper for the demo, tests and benchmarks)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
