"""Which files a data path names: one file, a ``datasets.save_to_disk`` directory, or several
files read in turn as one data set.

Several files are what a data set downloaded from the Hugging Face Hub is (Tulu 3's preference
mixture is four parquet shards, ``data/train-0000k-of-00004.parquet``): a directory holding
them (its data files found in every folder below it, hidden ones aside) or a glob pattern
(``'data/train-*.parquet'``, quoted so that the shell leaves it to dpocache). Their rows are
read file by file in the order of the files' names, as ``datasets.load_dataset`` reads the
shards of a split. A directory is read whole where its files all name one split by Hugging
Face's conventions (``train-*`` files, or a ``train/`` folder) or it holds one file; files of
several splits, or files that name none (a working directory's data, held-out data and runs'
metrics), are refused with a pattern to pass: which files a flag means is the user's to say.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

# What datasets' save_to_disk leaves in a directory: state.json (a Dataset), dataset_dict.json (a DatasetDict).
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# A model directory's JSON files, and a Hub snapshot's own: never data.
NOT_DATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "adapter_config.json", "vocab.json", "added_tokens.json",
                  "model.safetensors.index.json", "preprocessor_config.json", "dataset_infos.json",
                  "dataset_info.json")
# Split names as the Hub names them, in a file's name (train-00000-of-00004.parquet) or a folder's.
SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
_GLOB_CHARS = re.compile(r"[*?\[]")


class SourceError(ValueError):
    """A data path that names no data, or data of more than one kind or split: one line."""


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_MARKERS)


def is_pattern(source: str | Path) -> bool:
    """A glob pattern, not a path that exists under that name."""
    return bool(_GLOB_CHARS.search(str(source))) and not Path(source).exists()


def data_files(source: str | Path) -> list[Path] | None:
    """The files ``source`` names when it names several (a pattern, or a directory of data files),
    in reading order; None for one file or a ``save_to_disk`` directory. ``SourceError`` where it
    names no data file, or files of several kinds or splits."""
    if is_pattern(source):
        files = sorted(Path(p) for p in glob.glob(str(source), recursive=True) if Path(p).is_file())
        if not files:
            raise SourceError(f"{source}: no file matches this pattern")
        _one_kind(str(source), files)
        return files
    path = Path(source)
    if not path.is_dir() or is_saved_dataset(path):
        return None
    files = sorted(p for p in path.rglob("*") if p.is_file() and _is_data_file(p, path))
    if not files:
        raise SourceError(f"{path}: no data file (.jsonl, .json, .parquet or .csv) in this directory, nor a data set "
                          "datasets' save_to_disk wrote")
    _one_kind(str(path), files)
    _one_split(path, files)
    return files


def _is_data_file(file: Path, root: Path) -> bool:
    parts = file.relative_to(root).parts
    return (file.suffix.lower() in DATA_FILE_SUFFIXES and file.name not in NOT_DATA_FILES
            and not any(part.startswith(".") for part in parts))


def _one_kind(source: str, files: list[Path]) -> None:
    suffixes = sorted({f.suffix.lower() for f in files})
    if len(suffixes) > 1:
        most = max(suffixes, key=lambda x: sum(f.suffix.lower() == x for f in files))
        verb = "names" if is_pattern(source) else "holds"
        raise SourceError(f"{source}: {verb} data files of several kinds ({', '.join(suffixes)}): name the ones to "
                          f"read, as '{_pattern(source, files, suffix=most)}'")


def split_of(file: Path, root: Path) -> str | None:
    """The split ``file`` belongs to by Hugging Face's naming (its name's first word, or a folder's
    name); None where neither names one."""
    first = re.split(r"[-_.]", file.name, maxsplit=1)[0].lower()
    if first in SPLITS:
        return first
    return next((part.lower() for part in file.relative_to(root).parts[:-1] if part.lower() in SPLITS), None)


def _one_split(root: Path, files: list[Path]) -> None:
    """A folder is read whole where it holds one data file, or files that all name one split: a
    folder of other files (a working directory: data, held-out data, runs' metrics) would be
    read as one data set by accident."""
    found = {split_of(f, root) for f in files}
    splits = sorted(found - {None}, key=SPLITS.index)
    if len(splits) > 1:
        patterns = ", ".join(f"'{_pattern(str(root), [f for f in files if split_of(f, root) == s])}' ({s})"
                             for s in splits)
        raise SourceError(f"{root}: holds the splits {', '.join(splits)}; name the one to read with its pattern: "
                          f"{patterns}")
    if None in found and len(files) > 1:
        names = [str(f.relative_to(root)) for f in files]
        raise SourceError(f"{root}: holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}, not the files "
                          f"of one split (train-*, test-*, as the Hub names them): pass one, as {root / names[0]}, or "
                          f"a pattern naming the ones to read, as '{_pattern(str(root), files)}'")


def _pattern(source: str, files: list[Path], suffix: str | None = None) -> str:
    """A glob pattern naming ``files`` (those of ``suffix``), for a message."""
    files = [f for f in files if suffix is None or f.suffix.lower() == suffix]
    folders = {f.parent for f in files}
    if len(folders) == 1:
        folder = folders.pop()
        words = {re.split(r"[-_.]", f.name, maxsplit=1)[0] for f in files}
        stem = f"{words.pop()}*" if len(words) == 1 and len(files) > 1 else "*"
        return str(folder / f"{stem}{files[0].suffix}") if len(files) > 1 else str(files[0])
    return str(Path(source) / "**" / f"*{files[0].suffix}")


def pattern_naming(files: list[str | Path]) -> str:
    """A glob pattern naming ``files``, for a message."""
    files = [Path(f) for f in files]
    return _pattern(str(Path(*_common_parts(files))), files)


def _common_parts(files: list[Path]) -> tuple[str, ...]:
    parts = files[0].parent.parts
    for f in files[1:]:
        n = 0
        while n < min(len(parts), len(f.parent.parts)) and parts[n] == f.parent.parts[n]:
            n += 1
        parts = parts[:n]
    return parts or (".",)
