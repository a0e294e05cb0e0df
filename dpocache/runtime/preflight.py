"""Checks that run before any model loads: the model directories, the data path and the
directories a command writes to. Each failure is a ``UsageError`` whose message is one line
naming the flag and the path, so a typo costs a second, not a model load (or a minute of
retries against the Hugging Face Hub for a path that does not exist).

dpocache reads models from local directories only (the cache fingerprints their weight files),
so a path that is not a directory is an error here, never a Hub repo id to download.
"""

from __future__ import annotations

import contextlib
import errno
import json
import tempfile
from pathlib import Path
from typing import Iterator

from dpocache.models.hub_ids import local_base_dir

# The weight files dpocache.cache.fingerprint hashes (its WEIGHT_SUFFIXES; a test keeps the two
# equal). Not imported from there: the cache package imports torch, which these checks precede.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Any one of these holds a vocabulary; without one, transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

# Errors of a full, read-only or forbidden destination: the user's to fix, not a bug.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class UsageError(ValueError):
    """A mistake on the command line or in the files it names; the message is one line."""


def _has_weights(path: Path) -> bool:
    return any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir())


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _adapter_base(path: Path, flag: str) -> Path | None:
    """The base model directory of a PEFT adapter directory; None for a plain model directory."""
    adapter_config = path / "adapter_config.json"
    if not adapter_config.is_file():
        return None
    try:
        fields = json.loads(adapter_config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: adapter_config.json is not valid JSON ({e})") from None
    base = local_base_dir(fields.get("base_model_name_or_path"), fields.get("revision"))
    if base is None:
        raise UsageError(f"{flag} {path}: adapter_config.json names base_model_name_or_path "
                         f"'{fields.get('base_model_name_or_path')}', which is neither a local directory nor a Hub "
                         "id in the local Hugging Face cache")
    return base


def check_model_dir(path: str | Path, flag: str = "--model", tokenizer: bool = True) -> Path:
    """A local Hugging Face model (or PEFT adapter) directory with weights, a config and, if
    ``tokenizer``, tokenizer files (in it or, for an adapter, in its base)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such directory (a local Hugging Face model directory is expected)")
    if not path.is_dir():
        raise UsageError(f"{flag} {path}: not a directory (a Hugging Face model directory is expected)")
    base = _adapter_base(path, flag)
    weights_dir = base if base is not None else path
    if not (weights_dir / "config.json").is_file():
        raise UsageError(f"{flag} {weights_dir}: no config.json; not a Hugging Face model directory")
    if not _has_weights(weights_dir):
        raise UsageError(f"{flag} {weights_dir}: no model weights (files ending {', '.join(WEIGHT_SUFFIXES)})")
    if tokenizer and not (_has_tokenizer(path) or (base is not None and _has_tokenizer(base))):
        raise UsageError(f"{flag} {path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
                         "save the tokenizer into the model directory (tokenizer.save_pretrained)")
    return path


def check_data_path(path: str | Path | None, flag: str = "--data") -> None:
    if path is not None and not Path(path).exists():
        raise UsageError(f"{flag} {path}: no such file or directory")


def check_output(out: str | Path, flag: str, inputs: dict[str, str | Path | None], directory: bool = False) -> None:
    """Refuse an output path that would overwrite an input (``inputs``: flag -> path), the
    input file itself or a file inside an input directory (the model's weights), or that is a
    directory where a file is written (``directory``: the output is a directory)."""
    target = Path(out).resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        source = Path(path).resolve()
        if target == source or (source.is_dir() and source in target.parents):
            raise UsageError(f"{flag} {out}: that would overwrite {name} {path}; write somewhere else")
    if not directory and target.is_dir():
        raise UsageError(f"{flag} {out}: a directory; name a file to write")


def check_writable_dir(path: str | Path, flag: str) -> None:
    """Create ``path`` if needed and create (and remove) a file in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".dpocache-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def model_context(path: str | Path) -> int | None:
    """The model's context length (``max_position_embeddings`` in config.json), if it says."""
    return _config_int(path, "max_position_embeddings")


def model_vocab_size(path: str | Path) -> int | None:
    """The rows of the model's input embedding (``vocab_size`` in config.json), if it says."""
    return _config_int(path, "vocab_size")


def _config_int(path: str | Path, key: str) -> int | None:
    """A positive integer of the model's config.json (a multimodal model's text config's), read
    without transformers; None if the file or the key is not there."""
    path = Path(path)
    base = _adapter_base(path, "--model")
    try:
        config = json.loads(((base or path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    value = config.get(key, text.get(key) if isinstance(text, dict) else None)
    return value if isinstance(value, int) and value > 0 else None


@contextlib.contextmanager
def disk_errors(**dirs: str | Path | None) -> Iterator[None]:
    """Turn a full, read-only or forbidden destination met mid-run into one ``UsageError``
    naming the file (or, when the OS does not say, the directories written to). What was
    written before (flushed cache shards, checkpoints) stays."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        where = e.filename or " or ".join(f"{name.replace('_', ' ')} {d}" for name, d in dirs.items() if d)
        raise UsageError(f"cannot write to {where}: {e.strerror}; what was saved before this is kept") from None
