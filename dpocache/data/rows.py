"""Rows in: a preference data set's rows read from their source, unchecked, with where each came
from, and their columns mapped to the standard names.

Sources: ``.jsonl``, ``.json`` (a list of objects, or ``{"data": [...]}``), ``.parquet``,
``.csv`` files, a directory written by ``datasets.Dataset.save_to_disk`` (or a one-split
``DatasetDict``'s), several files read as one (``dpocache.data.sources``), a ``datasets.Dataset``
or a list of dicts. Each row is a ``RawRow`` named by its file and line (or row); a line that
cannot be read (not UTF-8, malformed or too deeply nested JSON) is a row with an ``error``, which
checking raises or, with ``skip_invalid``, skips like any bad row.

Other column names are mapped with ``columns`` (``--data.prompt_field question``); a row without
the prompt column is read as an implicit-prompt row only when it has no other text column (a
``question`` column is more likely a prompt under another name than a column to ignore), or when
the prompt column is ``none``. A row that lacks columns gets one error naming every missing
field, the row's columns and every flag to pass.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from dpocache.data import sources

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


def is_messages(value: Any) -> bool:
    """A list of objects: a conversation, whose messages ``dpocache.data.render`` checks."""
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


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


def parse_json(location: str, text: str, one_line: bool = False) -> Any:
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
                rows.append(RawRow(len(rows), location, parse_json(location, line.rstrip("\r\n"), one_line=True)))
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
                                                                 (is_messages(v) and v))]


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
    return is_messages(values.get(columns[1])) and is_messages(values.get(columns[2]))


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
