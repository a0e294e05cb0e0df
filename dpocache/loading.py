"""How models get into memory: a frozen reference stored in its compute dtype, and models
created on the meta device and filled shard by shard under ``torchrun`` (never whole in every
process).

Storage dtype of a frozen bf16 reference (``store_frozen_matrices_``): under bf16 autocast
every matrix product casts its fp32 weight to bf16 on each call, so storing the matrix weights
(``nn.Linear`` and GPT-2's ``Conv1D``) in bf16 once gives the same values bit for bit and
halves their memory. Embeddings stay fp32: an embedding lookup is not an autocast op, so an
fp32 table keeps the residual stream in fp32, and a bf16 one would change every number after
it. Norms, biases of norms and buffers (rotary frequencies) stay fp32 as well. Layers that
``dpocache.bf16_matmul`` routes through the fp32 GEMM (CPUs without AMX) keep their fp32
storage: that route multiplies bf16-rounded fp32 values and needs them in fp32.

Loading for sharding (``load_for_sharding``): every rank builds the model on the meta device
(no memory), rank 0 alone reads the safetensors files, and after ``fully_shard`` each tensor
is broadcast from rank 0 and each rank keeps its own shard
(``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, as torchtune and
torchtitan do). Host memory then holds one full copy (rank 0's, read from the files) plus one
shard per process, not one copy per process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .distributed import DistEnv


# ------------------------------------------------------------------ frozen reference storage


def _matrix_layers(model: nn.Module) -> list[nn.Module]:
    """``nn.Linear`` and transformers' ``Conv1D`` (GPT-2) layers: exactly the modules whose
    forward is a matrix product that bf16 autocast computes in bf16."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always has it
        Conv1D = ()
    return [m for m in model.modules() if type(m) is nn.Linear or (Conv1D and isinstance(m, Conv1D))]


@torch.no_grad()
def store_frozen_matrices_(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Store the matrix weights (and their biases) of a frozen model used only under ``dtype``
    autocast in ``dtype``, in place; returns how many layers changed.

    Left in fp32: a weight tied to an embedding (an embedding lookup is not autocast, so its
    fp32 values reach the residual stream), every non-matrix parameter, and the layers
    ``dpocache.bf16_matmul`` switched to the fp32 GEMM (they need fp32 storage).
    """
    from .bf16_matmul import _INSTALLED

    if dtype == torch.float32:
        return 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    count = 0
    for layer in _matrix_layers(model):
        if getattr(layer, _INSTALLED, False) or id(layer.weight) in embeddings:
            continue
        for name, p in list(layer.named_parameters(recurse=False)):
            if p.dtype == torch.float32:
                setattr(layer, name, nn.Parameter(p.to(dtype), requires_grad=False))
        count += 1
    return count


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def routes_bf16_through_fp32(device: torch.device | str) -> bool:
    """Whether bf16 linear layers on ``device`` take ``dpocache.bf16_matmul``'s fp32-GEMM
    route (CPUs without AMX tiles, unless ``$DPOCACHE_BF16_MATMUL`` says otherwise)."""
    from .bf16_matmul import resolve_mode

    return torch.device(device).type == "cpu" and resolve_mode() == "fp32-gemm"


# ------------------------------------------------------------------------ loading for sharding


def meta_model(path: str | Path, attn_implementation: str | None = "sdpa") -> nn.Module:
    """The model of ``path``'s config with every tensor on the meta device (no memory, no
    initialisation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config, **kwargs)
        except (ValueError, ImportError):  # no SDPA kernel: the architecture's default, as load_causal_lm
            kwargs.pop("attn_implementation", None)
            return AutoModelForCausalLM.from_config(config, **kwargs)


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers the state dict leaves out (rotary frequencies): computed at construction, so a
    meta model has none of their values."""
    persistent = set(model.state_dict())
    return {name: b for name, b in model.named_buffers() if name not in persistent}


def _set_buffers(model: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(device)


def load_for_sharding(path: str | Path, env: DistEnv, prepare, shard, attn_implementation: str | None = "sdpa"):
    """Build the model of ``path`` on the meta device on every rank, ``prepare(model)`` it
    (dtypes, dropout, checkpointing), ``shard(model)`` it (returns the FSDP2 root), then fill
    the shards from rank 0's copy of the weights. A collective. Returns ``(model, root)``.

    Rank 0 loads the checkpoint as ``reference.load_causal_lm`` does (so key renames and tied
    weights are transformers' own) and prepares it the same way; only its state dict is kept,
    each tensor is broadcast and every rank keeps its shard of it. The other ranks never hold
    more than one tensor of the full model at a time.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .checkpoint import check_loaded_keys
    from .distributed import broadcast_object
    from .fsdp import tied_aliases
    from .reference import load_causal_lm

    state, buffers = {}, None
    if env.is_main:
        full = load_causal_lm(path, "cpu", attn_implementation)
        prepare(full)
        aliases = set(tied_aliases(full))  # saved once, re-tied by the meta model's own config
        state = {k: v for k, v in full.state_dict().items() if k not in aliases}
        buffers = _non_persistent_buffers(full)
        del full
    buffers = broadcast_object(env, buffers)
    model = meta_model(path, attn_implementation)
    prepare(model)
    root = shard(model)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    result = set_model_state_dict(model, state, options=options)
    check_loaded_keys(Path(path), result.missing_keys, result.unexpected_keys)
    _set_buffers(model, buffers, env.device)
    return model, root
