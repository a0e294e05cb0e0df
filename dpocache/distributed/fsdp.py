"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the policy, and its checkpoints.

Sharding: each decoder layer is its own FSDP unit (all-gathered just before it runs, freed
after), so are the input embeddings when untied (and, for the frozen reference, the output
head), and ``CompletionLogProbs`` is the root. The root matters: ``CompletionLogProbs`` calls
the body (``get_decoder()``) and the output head (``get_output_embeddings()``) separately, so
no forward of the ``*ForCausalLM`` itself ever runs; the root's pre-forward hook is what
all-gathers the parameters no other unit owns (final norm, ``lm_head``). Tied embeddings are
one parameter owned by the root, so the tie survives sharding.

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

from dpocache.distributed.process_group import DistEnv, device_mesh
from dpocache.models.checkpoint import check_loaded_keys, read_full_weights
from dpocache.models.loading import tied_aliases
from dpocache.runtime.allocator import trim_heap
from dpocache.scoring.bf16_matmul import plain_linear
from dpocache.scoring.logprobs import decoder_layers, unwrap_causal_lm


def _full_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def mixed_precision(dtype: torch.dtype | None):
    """FSDP2's policy for compute in ``dtype``: parameters all-gathered in ``dtype`` (so each
    layer's matrices are cast once per gather, not on every use), gradients reduced in fp32
    and applied to the fp32 sharded master weights (the optimizer state stays fp32). None for
    fp32 (or no dtype): nothing to cast."""
    if dtype is None or dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def vocabulary_modules(policy: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The input embeddings and the output head, the two ``(vocab, hidden)`` tables, when
    they can be FSDP units of their own: both None when the head is tied to the embeddings
    (one parameter, which one unit must own), the head None when it is not a plain
    ``nn.Linear`` (a custom head may read other modules' weights); FSDP2's subclass of either
    (once sharded) counts as the class itself."""
    lm = unwrap_causal_lm(policy)
    embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if not isinstance(embed, nn.Embedding) or head is None or head.weight is embed.weight:
        return None, None
    return embed, head if plain_linear(head) else None


def matrix_units(layer: nn.Module) -> list[nn.Module]:
    """The modules inside a decoder layer that hold a matrix of their own (``nn.Linear``, a
    fused experts module's 3-D weights: at least 1/64 of the layer's parameters directly, so
    norms stay with the layer), innermost first: the order ``fully_shard`` needs (a unit's
    parameters are those not already in a unit below it)."""
    least = sum(p.numel() for p in layer.parameters()) / 64
    modules = [m for m in layer.modules() if m is not layer]
    owning = [m for m in modules if sum(p.numel() for p in m.parameters(recurse=False)) >= least]
    return list(reversed(owning))


def shard_policy(scorer: nn.Module, policy: nn.Module, env: DistEnv, reshard_after_forward: bool = True,
                 compute_dtype: torch.dtype | None = None, head_unit: bool = False,
                 matrix_granularity: bool = False) -> nn.Module:
    """Shard ``policy`` (inside ``scorer``, a ``CompletionLogProbs``) over every rank, with
    ``mixed_precision(compute_dtype)``. Returns ``scorer``, the root.

    Units: each decoder layer; the input embeddings (untied), gathered for their one call per
    forward and freed after it, so the root does not hold a whole ``(vocab, hidden)`` table
    through the forward; with ``head_unit``, the output head too (not resharded after its
    forward: it is called once per row chunk; the sharded reference streams it from its shards,
    ``dpocache.distributed.sharded_reference.stream_vocabulary``, or gathers it once around all the chunks,
    ``gather_head_around``); the root owns the rest (final norm, and the head unless
    ``head_unit``). With ``matrix_granularity`` (a frozen reference: no backward to batch
    reductions for), each matrix of a layer is a unit of its own (``matrix_units``) and the
    layer's unit keeps its norms: FSDP holds a gathered unit twice for a moment (its all-gather
    buffer and the unsharded parameters), so what a process holds beyond its shards is two of
    its largest matrices instead of two whole layers.

    The model may sit on the CPU: ``fully_shard`` moves each unit to ``env.device`` as it
    shards it, so a GPU never holds more than one full layer during set-up. It may also sit on
    the meta device (``dpocache.models.loading.load_for_sharding`` fills the shards afterwards).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh(env)
    layers = decoder_layers(policy)
    if not layers:
        raise ValueError(f"{type(unwrap_causal_lm(policy)).__name__}: found no decoder layers to shard")
    mp = mixed_precision(compute_dtype)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    embed, head = vocabulary_modules(policy)
    if embed is not None:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True, **kwargs)
    units = []
    for layer in layers:
        for unit in matrix_units(layer) if matrix_granularity else []:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
            units.append(unit)
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    if head_unit and head is not None:
        fully_shard(head, mesh=mesh, reshard_after_forward=False, **kwargs)
    fully_shard(scorer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    if env.device.type == "cpu":
        trim_after_each(layers + units + ([embed] if embed is not None else []))
        free_gathers_at_once(scorer)
    return scorer


def gather_head_around(scorer: nn.Module) -> None:
    """Gather the output head (an FSDP unit of its own, ``shard_policy(head_unit=True)``) once
    around all of ``scorer``'s head chunks and free it after them, on every call.

    ``CompletionLogProbs.head_logps`` calls the head once per row chunk, or reads its weight
    directly (fp32 CPU tiles), and a rank's number of chunks depends on its batch: FSDP's own
    per-call gathering would run a different number of all-gathers on each rank, or none."""
    from torch.distributed.fsdp import FSDPModule

    head = unwrap_causal_lm(scorer.model).get_output_embeddings()
    if not isinstance(head, FSDPModule):
        return
    head_logps = scorer.head_logps

    def gathered(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head.unshard()
        try:
            return head_logps(hidden, labels)
        finally:
            head.reshard()
            if hidden.device.type == "cpu":
                trim_heap()

    scorer.head_logps = gathered
    # Without the fast path the model's own forward calls the head, whose pre-forward hook
    # gathers it: free it after the root's forward then.
    scorer.register_forward_hook(lambda module, args, out: head.reshard())


def free_gathers_at_once(root: nn.Module) -> None:
    """On the CPU, free each unit's all-gather buffer as soon as its parameters are copied out
    of it. In forward FSDP2 keeps that buffer until the next unit's all-gather, so that on a
    GPU the copy-out overlaps the next collective on another stream; a CPU has no streams to
    overlap, and the buffer (one whole unit) would sit beside the gathered unit and the next
    unit's buffer, three units in flight instead of two. FSDP2 skips the deferral for an
    asynchronous unshard (``_set_unshard_async_op``, documented, not yet public), which on
    gloo is the same collective, waited for at the unit's pre-forward."""
    set_async = getattr(root, "_set_unshard_async_op", None)
    if set_async is not None:
        set_async(True)


def trim_after_each(layers: list[nn.Module]) -> None:
    """On the CPU, hand the memory of each layer's gathered parameters back to the system
    once it is resharded (``dpocache.runtime.allocator.trim_heap``). glibc keeps freed blocks below its
    mmap threshold (32 MiB with ``dpocache.runtime.allocator``'s settings) in per-thread heaps it rarely
    trims, and the gathered layers' blocks were measured to pile up to a whole model's worth
    over one forward. The hook runs after FSDP's own (registered first), which reshards."""

    def trim(module, args, out) -> None:  # returns None: the layer's output is left as it is
        trim_heap()

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
