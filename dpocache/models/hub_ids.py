"""``--model org/name[@revision]``: a Hugging Face Hub model id resolved from the local Hugging
Face cache, with no network call.

The cache layout (``huggingface_hub``'s): ``$HF_HUB_CACHE`` (default ``$HF_HOME/hub``, default
``~/.cache/huggingface/hub``) holds ``models--org--name/`` with ``refs/<branch or tag>`` (a file
holding a commit hash), ``snapshots/<commit>/`` (the files, as links into ``blobs/``) and
``blobs/<digest>``. A revision is a branch or tag name (looked up in ``refs/``, default
``main``) or a commit hash. A model not in the cache fails at once, in one line that names the
id and the directory looked in; downloading is left to ``hf download``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# org/name, optionally @revision; Hub names are letters, digits, '-', '_', '.'.
_MODEL_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelNotCachedError(FileNotFoundError):
    """A Hub model id whose files are not in the local Hugging Face cache (one-line message)."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the snapshot directory: a model directory as from_pretrained reads it
    repo_id: str  # org/name
    revision: str  # as asked for (default main)
    commit: str  # the snapshot's commit hash


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (``HF_HUB_CACHE``,
    then ``HF_HOME``/hub, then ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def parse_model_id(spec: str) -> tuple[str, str] | None:
    """``"org/name@rev"`` -> ``("org/name", "rev")`` (revision default ``main``); None when
    ``spec`` is an existing path or does not look like a Hub id."""
    if Path(spec).expanduser().exists():
        return None
    m = _MODEL_ID.match(spec)
    if m is None:
        return None
    return m.group("repo"), m.group("revision") or "main"


def resolve(spec: str, name: str = "--model") -> ResolvedModel:
    """Resolve a Hub id from the local cache; raises ``ModelNotCachedError``, one line naming
    ``name``: the flag or argument that gave the id."""
    parsed = parse_model_id(spec)
    if parsed is None:
        raise ValueError(f"{spec!r} is not a Hub model id (org/name[@revision])")
    repo_id, revision = parsed
    repo_dir = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.match(revision):
        commit = revision
    else:
        raise ModelNotCachedError(f"{name} {spec}: no such directory, and revision '{revision}' of {repo_id} is "
                                  f"not in the local Hugging Face cache ({repo_dir}); download it with "
                                  f"`hf download {repo_id} --revision {revision}`")
    snapshot = repo_dir / "snapshots" / commit
    if not (snapshot / "config.json").is_file():
        raise ModelNotCachedError(f"{name} {spec}: no such directory, and {repo_id} at {commit[:12]} is not in the "
                                  f"local Hugging Face cache "
                                  f"({snapshot} has no config.json); download it with `hf download "
                                  f"{repo_id} --revision {revision}`")
    return ResolvedModel(snapshot, repo_id, revision, commit)


def resolve_model_path(spec: str | None, name: str = "--model") -> str | None:
    """``spec`` unchanged when it is None, a local path or not a Hub id; else the local snapshot
    directory of the Hub id (the one call the commands make where the model path is read).
    ``name``: the flag or argument that gave it, named where the id is not in the cache."""
    if spec is None or parse_model_id(spec) is None:
        return spec
    return str(resolve(spec, name).path)


def snapshot_repo(path: str | Path) -> tuple[str, str] | None:
    """``(repo_id, commit)`` when ``path`` is a snapshot directory of the Hugging Face cache
    layout (``.../models--org--name/snapshots/<commit>``), else None. What a saved adapter names
    as its base: the snapshot's path exists on this machine only, the Hub id on every one."""
    path = Path(path)
    repo_dir = path.parent.parent
    if path.parent.name != "snapshots" or not repo_dir.name.startswith("models--") or not _COMMIT.match(path.name):
        return None
    org_name = repo_dir.name[len("models--"):]
    if "--" not in org_name:  # models--name: a repo without an organisation
        return org_name, path.name
    org, name = org_name.split("--", 1)
    return f"{org}/{name}", path.name


def local_base_dir(base: str | None, revision: str | None = None) -> Path | None:
    """The local directory of an adapter's ``base_model_name_or_path``: the directory itself, or
    a Hub id's snapshot in the local cache (at the adapter's ``revision``, a commit for the
    adapters dpocache saves); None when it is neither."""
    if not base:
        return None
    if Path(base).is_dir():
        return Path(base)
    parsed = parse_model_id(base)
    if parsed is None:
        return None
    try:
        return resolve(f"{parsed[0]}@{revision}" if revision else base).path
    except ModelNotCachedError:
        return None
