"""Training checkpoints: loadable by transformers and PEFT as they are, plus the optimizer,
scheduler and RNG state needed to resume exactly. No pickle: tensors go to safetensors, the
rest to JSON.

Layout of ``OUTPUT/checkpoints/step-000100/``::

    model.safetensors + config.json      (full fine-tuning; save_pretrained)
    adapter_model.safetensors + adapter_config.json   (LoRA; PEFT save_pretrained)
    tokenizer files
    optimizer.safetensors                AdamW moments, ``state.<param index>.<name>``
    trainer_state.json                   step, optimizer param groups, scheduler, RNG, config

A checkpoint is written to ``step-N.tmp`` and renamed when complete, so a crash mid-save
leaves the previous checkpoint the newest complete one (and the next save removes the .tmp).
A save that fails for want of space (or a read-only or forbidden directory) removes its .tmp
at once and raises ``CheckpointWriteError``: one line saying what failed, where, about how much
space a checkpoint needs and which complete checkpoint ``--resume`` continues from.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dpocache.cache.atomic import as_umask_allows, atomic_write_text
from dpocache.models.hub_ids import snapshot_repo
from dpocache.models.loading import safetensors_files
from dpocache.runtime.preflight import FULL_ERRNOS, disk_errno

STATE_FILE = "trainer_state.json"


class CheckpointWriteError(RuntimeError):
    """A checkpoint (or the final model) could not be written: a full, read-only or forbidden
    destination. The message is one line; the last complete checkpoint is left as it was."""


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step-{step:06d}"


def checkpoints(output_dir: Path, complete: bool = True) -> list[Path]:
    """``output_dir``'s checkpoint directories, oldest first: by step number, not by name
    (``step-1000000`` is newer than ``step-999999``). ``complete``: only those with their
    trainer state (a save killed before its rename leaves a ``.tmp`` directory, never listed)."""
    root = output_dir / "checkpoints"
    if not root.exists():
        return []
    found = []
    for p in root.glob("step-*"):
        step = p.name[len("step-"):]
        if step.isdigit() and p.is_dir() and (not complete or (p / STATE_FILE).exists()):
            found.append((int(step), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = checkpoints(output_dir)
    return done[-1] if done else None


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, values in state["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors of the optimizer's state, as ``_optimizer_tensors`` would write them."""
    return sum(_tensor_bytes(v) for values in optimizer.state_dict()["state"].values() for v in values.values()
               if torch.is_tensor(v))


def name_adapter_base(directory: Path) -> None:
    """The base a PEFT adapter saved in ``directory`` names, readable from anywhere: by Hub id and
    commit when the base was loaded from a snapshot of the local Hugging Face cache (``--model
    org/name``: the snapshot's path exists on this machine only, and an adapter pushed with
    ``--train.push_to_hub`` would name it to every reader; PEFT reads ``revision`` as the base's),
    and by its absolute path when it is a local directory named relative to the working directory
    (``--model ./sft``: PEFT records the path as given, and the adapter could not be loaded from
    any other directory)."""
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        return
    fields = json.loads(config_file.read_text())
    base = fields.get("base_model_name_or_path") or ""
    hub = snapshot_repo(base)
    if hub is not None:
        fields["base_model_name_or_path"], fields["revision"] = hub
    elif base and not Path(base).is_absolute() and Path(base).is_dir():
        fields["base_model_name_or_path"] = os.path.abspath(base)  # a link keeps its name
    else:
        return
    atomic_write_text(config_file, json.dumps(fields, indent=2, sort_keys=True) + "\n")


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, optimizer, scheduler, extra: dict,
                    keep: int) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    # A save that failed (a full disk, a kill) left its .tmp directory: never listed or read,
    # but holding the space this one needs.
    for unfinished in final.parent.glob("step-*.tmp"):
        shutil.rmtree(unfinished, ignore_errors=True)
    with writing(tmp, f"checkpoint {final.name}", output_dir, model, _optimizer_bytes(optimizer)):
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        name_adapter_base(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # Copied to the host only once the weights are written (save_pretrained copies a GPU model's
        # tensors to the host too): the host holds one of the two at a time, not both (AdamW's
        # moments are twice the fp32 weights: 13 GB for a 1.1B model at once, 9 GB in turn).
        tensors, opt_meta = _optimizer_tensors(optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {"step": step, "optimizer": opt_meta, "scheduler": scheduler.state_dict(), **extra}
        atomic_write_text(tmp / STATE_FILE, json.dumps(state, indent=1, default=str))
        as_umask_allows(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _prune(output_dir, keep)
    return final


@contextlib.contextmanager
def writing(tmp: Path, what: str, output_dir: Path, model, optimizer_bytes: int | None = None):
    """Write ``what`` into the directory ``tmp`` (renamed by the caller once complete). A disk
    error inside (``preflight.disk_errno``: an ``OSError``, or safetensors' ``SafetensorError``,
    which is not one, so the command line's ``disk_errors`` let it through as a traceback)
    removes ``tmp`` and becomes one ``CheckpointWriteError``. ``optimizer_bytes``: the size of
    the optimizer's state in a checkpoint, for the estimate of the space needed when there is no
    earlier checkpoint to measure."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a disk error
        code = disk_errno(e)
        if code is None:
            raise
        # The partial checkpoint holds space the next attempt needs, and is never read.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(tmp, what, output_dir, code, model, optimizer_bytes)) from None


def _write_failure(tmp: Path, what: str, output_dir: Path, code: int, model, optimizer_bytes: int | None) -> str:
    """The one line of a failed write: what, where, the space it needs, and what is kept."""
    last = latest_checkpoint(output_dir)
    line = f"cannot write {what} to {tmp}: {os.strerror(code)}"
    if code in FULL_ERRNOS:
        if optimizer_bytes is not None and last is not None:  # a checkpoint is as large as the one before it
            need, source = _dir_bytes(last), f"as {last.name} took"
        else:
            need = _model_bytes(model) + (optimizer_bytes or 0)
            source = "its weights" + (" and optimizer state" if optimizer_bytes is not None else "") + ", estimated"
        free = shutil.disk_usage(_existing(tmp)).free
        line += f"; it needs about {_human(need)} ({source}), {_human(free)} is free there"
    if last is not None:
        line += f"; the last complete checkpoint, {last}, is kept: make room and continue with --resume"
    else:
        line += "; no complete checkpoint was written before this one"
    return line


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (``disk_usage`` needs one that exists)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _dir_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _model_bytes(model) -> int:
    """Bytes of the weights ``model.save_pretrained`` writes: a PEFT model's trainable adapter,
    else every tensor of the state, each shared one once (a gathered FSDP model: its ``state``)."""
    policy = getattr(model, "policy", model)  # dpocache.distributed.fsdp.GatheredModel
    if hasattr(policy, "peft_config"):
        return sum(_tensor_bytes(p) for p in policy.parameters() if p.requires_grad)
    state = getattr(model, "state", None)
    state = state if isinstance(state, dict) else model.state_dict()
    seen, total = set(), 0
    for t in state.values():
        if torch.is_tensor(t) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += _tensor_bytes(t)
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _prune(output_dir: Path, keep: int) -> None:
    done = checkpoints(output_dir, complete=False)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load_trainer_state(ckpt: Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG from ``ckpt``; returns the saved state dict."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    tensors = load_file(str(ckpt / "optimizer.safetensors"))
    opt_state: dict = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            opt_state.setdefault(int(idx), {})[name] = value
    for key, value in state["optimizer"]["scalars"].items():
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return state


def load_model_weights(ckpt: Path, model) -> None:
    """Load a checkpoint's weights into the live policy (full or LoRA)."""
    adapter = ckpt / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter)))
        return
    missing, unexpected = model.load_state_dict(read_full_weights(ckpt), strict=False)
    check_loaded_keys(ckpt, missing, unexpected)


def read_full_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's full weights: ``save_pretrained`` writes one
    ``model.safetensors``, or shards listed in an index for big models. (transformers 5 moved
    its load_sharded_checkpoint out of modeling_utils; reading the index here needs no
    transformers internals.)"""
    state: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(ckpt):
        state.update(load_file(str(shard)))
    return state


def check_loaded_keys(ckpt: Path, missing, unexpected) -> None:
    """Tied weights (lm_head = embeddings) are saved once; anything else missing, or any
    unexpected key, means the checkpoint is not this model's."""
    real_missing = [k for k in missing if "lm_head" not in k]
    if real_missing or unexpected:
        raise RuntimeError(f"{ckpt}: weights do not match the model (missing {real_missing[:5]}, "
                           f"unexpected {list(unexpected)[:5]})")
