"""Checks that run before any model loads: the model directories, the data path and the
directories a command writes to. Each failure is a ``UsageError`` whose message is one line
naming the flag and the path, so a typo costs a second, not a model load (or a minute of
retries against the Hugging Face Hub for a path that does not exist).

dpocache reads models from local directories only (the cache fingerprints their weight files),
so a path that is not a directory is an error here, never a Hub repo id to download.

A model directory is also checked for what would make loading it unsafe or a traceback, before
any weight is read: a ``model_type`` transformers does not implement (with an ``auto_map``, the
model's own Python code, which dpocache never runs: no ``trust_remote_code``), a safetensors
file whose header is absurd or cut short, a pickled ``.bin`` that torch's ``weights_only``
loader refuses (dpocache never unpickles anything else). Only the files ``from_pretrained``
would load are checked, not a ``training_args.bin`` lying beside them.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import importlib.util
import json
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from dpocache.data.sources import SourceError, data_files, is_pattern, is_saved_dataset
from dpocache.models.hub_ids import local_base_dir

# The weight files dpocache.cache.fingerprint hashes (its WEIGHT_SUFFIXES; a test keeps the two
# equal). Not imported from there: the cache package imports torch, which these checks precede.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Any one of these holds a vocabulary; without one, transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

# Errors of a full, read-only or forbidden destination: the user's to fix, not a bug.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# The two that more space fixes.
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# safetensors (Rust) reports an I/O error as its own SafetensorError, not an OSError; the errno
# is only in the message: "... I/O error: No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")

# safetensors refuses a header longer than this (its MAX_HEADER_SIZE, "header too large"); a real
# one is about 100 bytes per tensor.
MAX_SAFETENSORS_HEADER = 100_000_000
# What a Git LFS pointer file (a clone without `git lfs pull`) starts with instead of the weights.
LFS_POINTER = b"version https://git-lfs"


class UsageError(ValueError):
    """A mistake on the command line or in the files it names; the message is one line."""


def _has_weights(path: Path) -> bool:
    return any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in path.iterdir())


def _is_model_dir(path: Path) -> bool:
    """A model (or PEFT adapter) directory: a config beside weights or an adapter."""
    return (path / "config.json").is_file() and (_has_weights(path) or (path / "adapter_config.json").is_file())


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


def _relative(path: str | Path) -> str:
    """Where a relative path was looked for: the working directory, not a config file's folder
    (a job script run from elsewhere finds nothing)."""
    return "" if Path(path).expanduser().is_absolute() else f" in the working directory {Path.cwd()}"


def check_model_dir(path: str | Path, flag: str = "--model", tokenizer: bool = True) -> Path:
    """A local Hugging Face model (or PEFT adapter) directory with weights, a config and, if
    ``tokenizer``, tokenizer files (in it or, for an adapter, in its base)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such directory{_relative(path)} (a local Hugging Face model directory "
                         "is expected)")
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
    _check_config(weights_dir, flag)
    loaded = [(path, "adapter_model"), (weights_dir, "model")] if base is not None else [(path, "model")]
    for directory, stem in loaded:
        for file in checkpoint_files(directory, stem, flag):
            _check_weight_file(file, directory, flag)
    return path


def checkpoint_files(directory: Path, stem: str = "model", flag: str | None = None) -> list[Path]:
    """The files a checkpoint in ``directory`` loads from, as transformers (``stem="model"``) or
    PEFT (``"adapter_model"``) finds them: ``{stem}.safetensors``, or the shards its index
    lists, else the same for the pickle format (``pytorch_model.bin`` / ``{stem}.bin``); [] if none.
    An index that cannot be read, or that lists a shard not there, is a ``UsageError`` (naming
    ``flag``, when given)."""
    where = f"{flag} {directory}" if flag else str(directory)
    pickled = "pytorch_model.bin" if stem == "model" else f"{stem}.bin"
    for single in (f"{stem}.safetensors", pickled):
        if (directory / single).is_file():
            return [directory / single]
        index = directory / f"{single}.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise UsageError(f"{where}: {index.name} is not a valid index of weight files "
                                 f"({type(e).__name__}: {e})") from None
            files = [directory / name for name in names]
            for file in files:
                if not file.is_file():
                    raise UsageError(f"{where}: {index.name} lists {file.name}, which is not there "
                                     "(a download cut short?)")
            return files
    return []


def _check_config(directory: Path, flag: str) -> None:
    """config.json names an architecture this transformers implements: never the model's own
    code (``auto_map``), which only ``trust_remote_code=True`` would run."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {directory}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag} {directory}: config.json is not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"{flag} {directory}: config.json has no model_type; transformers cannot tell which "
                         "architecture the weights are for")
    if _known_model_type(model_type):
        return
    version = _transformers_version()
    custom = config.get("auto_map")
    if isinstance(custom, dict) and custom:
        code = custom.get("AutoModelForCausalLM") or custom.get("AutoConfig") or next(iter(custom.values()))
        code = next((c for c in code if c), "?") if isinstance(code, list) else code
        raise UsageError(f"{flag} {directory}: config.json: model_type '{model_type}' is no architecture transformers "
                         f"{version} implements, and its auto_map points at Python code shipped with the model "
                         f"({code}); dpocache never runs a model's own code (no trust_remote_code): use a model of an "
                         "architecture transformers implements")
    raise UsageError(f"{flag} {directory}: config.json: model_type '{model_type}' is no architecture transformers "
                     f"{version} knows (a newer transformers may: pip install -U transformers)")


def _known_model_type(model_type: str) -> bool:
    """Whether transformers' ``CONFIG_MAPPING`` has ``model_type``. Its generated list of names is
    read on its own first (milliseconds; importing ``CONFIG_MAPPING`` imports torch, seconds):
    only a type not in that list, which ``CONFIG_MAPPING`` may still add, pays for the import."""
    if model_type in _generated_model_types():
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


@functools.cache
def _generated_model_types() -> frozenset[str]:
    """``CONFIG_MAPPING_NAMES`` of transformers' ``models/auto/auto_mappings.py`` (generated; it
    imports only ``collections``), loaded from its file without importing transformers; empty
    when this transformers has no such file or it does not load on its own."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return frozenset()
    file = Path(spec.origin).parent / "models" / "auto" / "auto_mappings.py"
    try:
        names = importlib.util.spec_from_file_location("_dpocache_transformers_auto_mappings", file)
        module = importlib.util.module_from_spec(names)
        names.loader.exec_module(module)
        return frozenset(module.CONFIG_MAPPING_NAMES)
    except Exception:  # noqa: BLE001 - any failure only means the slow, exact lookup instead
        return frozenset()


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _check_weight_file(file: Path, directory: Path, flag: str) -> None:
    stat = file.stat()
    problem = _weight_file_problem(file, stat.st_size, stat.st_mtime_ns)
    if problem:
        raise UsageError(f"{flag} {directory}: {file.name}: {problem}")


@functools.lru_cache(maxsize=1024)
def _weight_file_problem(file: Path, size: int, mtime_ns: int) -> str | None:
    """One look per file as it is (``size``, ``mtime_ns``): a command checks its model directory
    more than once (``score``: its weights, its tokenizer, the service it starts), and a pickled
    checkpoint's look unpickles its whole structure."""
    return safetensors_problem(file) if file.suffix == ".safetensors" else _pickle_problem(file)


def safetensors_problem(file: Path) -> str | None:
    """Why safetensors would refuse ``file`` (its header: length, JSON, where the tensors end),
    read without reading a tensor; None when it looks sound."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        start = f.read(len(LFS_POINTER))
        if start == LFS_POINTER:
            return "a Git LFS pointer file, not the weights (fetch them with git lfs pull)"
        if len(start) < 8:
            return f"{size} bytes, too short for a safetensors file"
        length = int.from_bytes(start[:8], "little")
        if length > min(size - 8, MAX_SAFETENSORS_HEADER):
            return (f"its header length field says {length:,} bytes, more than "
                    + (f"safetensors allows ({MAX_SAFETENSORS_HEADER:,})" if length > MAX_SAFETENSORS_HEADER else
                       f"the file holds ({size - 8:,} after the field)")
                    + "; the file is damaged or not safetensors")
        f.seek(8)
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        return f"its header is not valid JSON ({e}); the file is damaged or not safetensors"
    if not isinstance(header, dict):
        return "its header is not a JSON object; the file is damaged or not safetensors"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
            return f"its header gives tensor '{name}' no valid data_offsets; the file is damaged"
        end = max(end, offsets[1])
    held = size - 8 - length
    if end != held:
        # safetensors refuses both: "incomplete metadata, file not fully covered".
        return (f"its header describes {end:,} bytes of tensor data but the file holds {held:,}"
                + ("; it was cut short (an interrupted download or copy?)" if end > held else "; the file is damaged"))
    return None


def _pickle_problem(file: Path) -> str | None:
    """Why torch's ``weights_only`` loader, the only one dpocache (and transformers and PEFT)
    loads a pickled checkpoint with, would refuse ``file``; None when it would not. Loaded onto
    the meta device: the pickle is read, not one tensor's data. Imports torch, which a model
    directory of safetensors never needs here."""
    import torch  # noqa: PLC0415 - only for .bin weights: a directory of safetensors is checked without torch

    try:
        torch.load(file, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        return (f"a pickle that torch's safe loader (weights_only) refuses ({_unpickler_reason(str(e))}); dpocache "
                "never unpickles anything else: load it where you trust it and save it as safetensors "
                "(save_pretrained)")
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"not a loadable torch checkpoint ({first})"
    return None


def _unpickler_reason(message: str) -> str:
    """The cause in torch's many-line ``weights_only`` refusal: "Unsupported global: GLOBAL
    builtins.print was not an allowed global by default"."""
    _, found, rest = message.partition("WeightsUnpickler error:")
    if not found:
        return message.strip().splitlines()[0] if message.strip() else "refused"
    reason = next((line.strip() for line in rest.splitlines() if line.strip()), "refused")
    return reason.split(". Please", 1)[0].rstrip(".")


def check_data_path(path: str | Path | None, flag: str = "--data") -> None:
    """A data path that names data: a file, a ``datasets.save_to_disk`` directory, or several
    data files of one kind and split (a folder of them, or a glob pattern:
    ``dpocache.data.sources``); not a model directory."""
    if path is None:
        return
    if not Path(path).exists() and not is_pattern(path):
        raise UsageError(f"{flag} {path}: no such file or directory{_relative(path)}")
    path = Path(path)
    if path.is_dir() and not is_saved_dataset(path) and _is_model_dir(path):
        raise UsageError(f"{flag} {path}: a model directory (config.json and weights), not preference data; "
                         "pass the data's .jsonl, .json, .parquet or .csv file, or a folder of them")
    try:
        data_files(path)
    except SourceError as e:
        raise UsageError(f"{flag} {e}") from None


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
            # a new file in an input folder (the data's files, read as one data set) is no overwrite
            what = "overwrite" if target == source or target.exists() else "write into"
            raise UsageError(f"{flag} {out}: that would {what} {name} {path}; write somewhere else")
    if not directory and target.is_dir():
        raise UsageError(f"{flag} {out}: a directory; name a file to write")
    if directory:
        check_replaceable_dir(out, flag)


def check_replaceable_dir(out: str | Path, flag: str) -> None:
    """A directory that ``datasets.save_to_disk`` output may replace: none yet, an empty one, or
    one ``save_to_disk`` wrote (an earlier export). Replacing removes everything in it, so a
    directory of anything else (a run, a model, the data) is refused."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {out}: a file, not a directory; name a directory")
    if path.is_dir() and any(path.iterdir()) and not is_saved_dataset(path):
        raise UsageError(f"{flag} {out}: a directory that datasets' save_to_disk did not write, which the export "
                         "would replace with everything in it; name a new or empty directory")


def check_run_dir(out: str | Path, flag: str, inputs: dict[str, str | Path | None]) -> None:
    """A training run's output directory: not an input (``inputs``: flag -> path: the models,
    the data, the cache) nor inside one, and not inside a model directory or another run (its
    ``final/`` or a checkpoint), where the run's files would mix with theirs. A directory that
    holds the inputs (``--output-dir .``) is fine."""
    target = Path(out).expanduser().resolve()
    for name, path in inputs.items():
        if path is None:
            continue
        source = Path(path).expanduser().resolve()
        if source.is_dir() and (target == source or source in target.parents):
            where = "is" if target == source else "is inside"
            raise UsageError(f"{flag} {out}: {where} {name} {path}, where the run's files would mix with it; "
                             "name a directory of its own")
    for folder in [target, *target.parents]:
        if not folder.is_dir():
            continue
        if _is_model_dir(folder):
            where = "a model directory" if folder == target else f"inside the model directory {folder}"
            raise UsageError(f"{flag} {out}: {where}, where the run's files would mix with the model's; name a "
                             "directory of its own")
        if folder != target and (folder / "run.json").is_file() and (folder / "metrics.jsonl").is_file():
            raise UsageError(f"{flag} {out}: inside the run in {folder}; name a directory of its own")


def unwritable(path: str | Path) -> str | None:
    """Why an existing directory cannot be written (a read-only mount, no permission), or None:
    it can, or it does not exist yet (``check_writable_dir`` says whether it can be made)."""
    path = Path(path)
    if not path.is_dir():
        return None
    try:
        _write_probe(path)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return e.strerror or str(e)
    return None


def check_cache_dir(path: str | Path, flag: str = "--cache-dir") -> bool:
    """A cache directory for a command that writes what the cache lacks: whether it is
    read-only. One that exists and cannot be written is read from (a team's cache, shared
    read-only); the pairs it lacks are refused once known (``cache.build``). Any other
    directory must be one that can be made and written."""
    if unwritable(path) is not None:
        return True
    check_writable_dir(path, flag)
    return False


def check_writable_dir(path: str | Path, flag: str) -> None:
    """Create ``path`` if needed and create (and remove) a file in it."""
    path = Path(path)
    if path.exists() and not path.is_dir():  # mkdir's "File exists" did not say it is a file
        raise UsageError(f"{flag} {path}: a file, not a directory; name a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        _write_probe(path)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def _write_probe(path: Path) -> None:
    """Create (and remove) a file in the directory ``path``; the ``OSError`` where it cannot."""
    with tempfile.TemporaryFile(dir=path, prefix=".dpocache-probe-"):
        pass


def model_context(path: str | Path) -> int | None:
    """The model's context length (``context_length`` of its config.json), if it says."""
    config = _text_config(path)
    return context_length(config) if config is not None else None


def context_length(config: dict) -> int | None:
    """The positions a model takes, from its config's fields (a text config's, as a dict):
    ``max_position_embeddings`` (GPT-2's ``n_positions``), or a RoPE scaling's
    ``original_max_position_embeddings x factor`` where that is more. A YaRN-scaled Qwen2.5 keeps
    ``max_position_embeddings`` at its trained 32,768 and runs 4x that with ``factor`` 4; Llama
    3.1 says its scaled 131,072 itself. The RoPE scaling is ``rope_parameters`` in transformers
    5, ``rope_scaling`` in configs saved before."""
    given = [config.get(key) for key in ("max_position_embeddings", "n_positions")]
    context = next((n for n in given if isinstance(n, int) and n > 0), None)
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(rope, dict) and context is not None:
        original, factor = rope.get("original_max_position_embeddings"), rope.get("factor")
        if isinstance(original, int) and isinstance(factor, (int, float)) and factor > 1:
            context = max(context, int(original * factor))
    return context


def model_layers(path: str | Path) -> int | None:
    """The model's decoder layers (``num_hidden_layers`` in config.json), if it says."""
    return _config_int(path, "num_hidden_layers")


def model_vocab_size(path: str | Path) -> int | None:
    """The rows of the model's input embedding (``vocab_size`` in config.json), if it says."""
    return _config_int(path, "vocab_size")


def _config_int(path: str | Path, key: str) -> int | None:
    """A positive integer of the model's config.json (a multimodal model's text config's), read
    without transformers; None if the file or the key is not there."""
    config = _text_config(path)
    value = config.get(key) if config is not None else None
    return value if isinstance(value, int) and value > 0 else None


def _text_config(path: str | Path) -> dict | None:
    """The model's config.json as a dict, a multimodal model's ``text_config`` filling in the
    keys it lacks; None if there is no such file."""
    path = Path(path)
    base = _adapter_base(path, "--model")
    try:
        config = json.loads(((base or path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


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
        unreadable = _unreadable(e)
        if unreadable:  # a colleague's directory or file this user may not read: not a write that failed
            path, owner = unreadable
            raise UsageError(f"cannot read {path}: {e.strerror} ({owner}); ask its owner to let the group read it "
                             "(umask 002, or chmod -R g+rX)") from None
        raise UsageError(f"cannot write to {where}: {e.strerror}; what was saved before this is kept") from None


def _unreadable(e: OSError) -> tuple[str, str] | None:
    """(the path, its owner and mode) where ``e`` is a permission error on a path this user may not
    read, or inside a directory they may not enter (then that directory); None otherwise."""
    if e.errno not in (errno.EACCES, errno.EPERM) or not e.filename:
        return None
    for path in (Path(e.filename), *Path(e.filename).parents):
        try:
            st = os.stat(path)
        except PermissionError:  # inside a directory this user may not enter: that one is named
            continue
        except OSError:
            return None
        kind = os.R_OK | os.X_OK if stat.S_ISDIR(st.st_mode) else os.R_OK
        if os.access(path, kind):
            return None
        return str(path), f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
    return None


def disk_errno(err: BaseException) -> int | None:
    """The errno of ``err`` if it is a full, read-only or forbidden destination (``DISK_ERRNOS``):
    an ``OSError``'s, or the one safetensors' own error gives in its message; else None.
    (``disk_errors`` above takes only ``OSError``: safetensors' error names no file, and the
    directories it would name instead are not always the ones written to.)"""
    if isinstance(err, OSError):
        return err.errno if err.errno in DISK_ERRNOS else None
    if type(err).__name__ == "SafetensorError":  # not imported: this module precedes torch
        match = _RUST_OS_ERROR.search(str(err))
        if match and int(match.group(1)) in DISK_ERRNOS:
            return int(match.group(1))
    return None
