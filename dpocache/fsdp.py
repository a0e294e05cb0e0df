"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the policy, and its checkpoints.

Sharding: each decoder layer is its own FSDP unit (all-gathered just before it runs, freed
after), and ``CompletionLogProbs`` is the root. The root matters: ``CompletionLogProbs`` calls
the body (``get_decoder()``) and the output head (``get_output_embeddings()``) separately, so
no forward of the ``*ForCausalLM`` itself ever runs; the root's pre-forward hook is what
all-gathers the parameters no layer owns (embeddings, final norm, ``lm_head``). Tied
embeddings are one parameter owned by the root, so the tie survives sharding.

Checkpoints are gathered, not sharded: ``get_model_state_dict(full_state_dict=True,
cpu_offload=True)`` assembles the full weights on rank 0's CPU, which writes an ordinary
Hugging Face checkpoint with ``save_pretrained``; the optimizer state is gathered the same way
and written in the same layout a single-process run writes (``state.<param index>.<name>``).
So a checkpoint resumes on any world size, with or without FSDP, and loads in transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import check_loaded_keys, read_full_weights
from .distributed import DistEnv
from .logprobs import unwrap_causal_lm


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the modules whose class transformers lists in
    ``_no_split_modules`` (what accelerate and TRL shard on); else the largest ModuleList."""
    lm = unwrap_causal_lm(policy)
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in lm.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def mixed_precision(dtype: torch.dtype | None):
    """FSDP2's policy for compute in ``dtype``: parameters all-gathered in ``dtype`` (so each
    layer's matrices are cast once per gather, not on every use), gradients reduced in fp32
    and applied to the fp32 sharded master weights (the optimizer state stays fp32). None for
    fp32 (or no dtype): nothing to cast."""
    if dtype is None or dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_policy(scorer: nn.Module, policy: nn.Module, env: DistEnv, reshard_after_forward: bool = True,
                 compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``policy`` (inside ``scorer``, a ``CompletionLogProbs``) over every rank, with
    ``mixed_precision(compute_dtype)``.

    The model may sit on the CPU: ``fully_shard`` moves each unit to ``env.device`` as it
    shards it, so a GPU never holds more than one full layer during set-up. It may also sit on
    the meta device (``dpocache.loading.load_for_sharding`` fills the shards afterwards).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    layers = decoder_layers(policy)
    if not layers:
        raise ValueError(f"{type(unwrap_causal_lm(policy)).__name__}: found no decoder layers to shard")
    mp = mixed_precision(compute_dtype)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    if env.device.type == "cpu":
        trim_after_each(layers)
    return scorer


def trim_after_each(layers: list[nn.Module]) -> None:
    """On the CPU, hand the memory of each layer's gathered parameters back to the system
    once it is resharded (``malloc_trim``). glibc keeps freed blocks below its mmap threshold
    (32 MiB with ``dpocache.allocator``'s settings) in per-thread heaps it rarely trims, and
    the gathered layers' blocks were measured to pile up to a whole model's worth over one
    forward. The hook runs after FSDP's own (registered first), which reshards."""
    import ctypes

    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim(module, args, out) -> None:  # returns None: the layer's output is left as it is
        malloc_trim(0)

    for layer in layers:
        layer.register_forward_hook(trim)


# ------------------------------------------------------------------------------ checkpoints


def full_model_state(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full state dict on rank 0's CPU (empty elsewhere). A collective: call
    it on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(policy, options=_full_options(cpu_offload=True))


def _param_fqns(policy: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the order ``optimizer.state_dict()`` numbers
    them (group by group)."""
    names = {id(p): n for n, p in policy.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state on rank 0's CPU, in ``torch.optim`` layout (parameters by
    index), exactly what an unsharded optimizer's ``state_dict()`` returns. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(policy, optimizer, options=_full_options(cpu_offload=True))
    if not by_name:
        return {}
    index = {n: i for i, n in enumerate(_param_fqns(policy, optimizer))}
    groups = []
    for group in by_name["param_groups"]:
        groups.append({**group, "params": [index[n] for n in group["params"]]})
    return {"state": {index[n]: v for n, v in by_name["state"].items()}, "param_groups": groups}


def tied_aliases(model: nn.Module) -> list[str]:
    """Names under which an already-named parameter appears again (``lm_head.weight`` when
    the embeddings are tied), in ``named_parameters`` order."""
    seen: set[int] = set()
    aliases = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.append(name)
        seen.add(id(p))
    return aliases


class GatheredModel:
    """Stands in for the policy in ``checkpoint.save_checkpoint``: ``save_pretrained`` writes
    the gathered weights (rank 0 only)."""

    def __init__(self, policy: nn.Module, state: dict[str, torch.Tensor]):
        self.policy = policy
        # Gathering copies each tensor, so transformers can no longer see that two names share
        # storage; drop the aliases as its own save does for a live model (tied weights are
        # saved once and re-tied on load from the config).
        aliases = set(tied_aliases(policy))
        self.state = {k: v for k, v in state.items() if k not in aliases}

    def save_pretrained(self, path, **kwargs) -> None:
        self.policy.save_pretrained(path, state_dict=self.state, **kwargs)


class GatheredOptimizer:
    """Stands in for the optimizer in ``checkpoint.save_checkpoint`` / ``load_trainer_state``:
    ``state_dict()`` is the gathered full state; ``load_state_dict`` takes a full state in
    index layout and shards it onto the live (sharded) optimizer."""

    def __init__(self, policy: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None = None):
        self.policy, self.optimizer, self.state = policy, optimizer, state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        names = _param_fqns(self.policy, self.optimizer)
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(self.policy, self.optimizer, by_name, options=_full_options())


def load_full_weights(ckpt: Path, policy: nn.Module, env: DistEnv) -> None:
    """Load a gathered (or single-process) checkpoint into the sharded policy: rank 0 reads
    the files and each tensor is broadcast and sharded, so only one process holds the full
    weights in memory."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = read_full_weights(ckpt) if env.is_main else {}
    result = set_model_state_dict(policy, state, options=_full_options(broadcast_from_rank0=True, strict=False))
    check_loaded_keys(ckpt, result.missing_keys, result.unexpected_keys)
