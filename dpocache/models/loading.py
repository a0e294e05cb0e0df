"""How models get into memory: a whole causal LM (fp32, dropout off), a frozen reference stored
in its compute dtype, and models created on the meta device and filled shard by shard under
``torchrun`` (never whole in every process).

Storage dtype of a frozen bf16 reference (``store_frozen_matrices_``): under bf16 autocast
every matrix product casts its fp32 weight to bf16 on each call, so storing the matrix weights
(``nn.Linear`` and GPT-2's ``Conv1D``) in bf16 once gives the same values bit for bit and
halves their memory. Embeddings stay fp32: an embedding lookup is not an autocast op, so an
fp32 table keeps the residual stream in fp32, and a bf16 one would change every number after
it; except a table whose values are all bf16 values (a checkpoint saved in bf16), stored in
bf16 with its lookup cast back to fp32, the same numbers (``store_exact_embeddings_``). Norms,
biases of norms and buffers (rotary frequencies) stay fp32 as well. Layers that
``dpocache.scoring.bf16_matmul`` routes through the fp32 GEMM (CPUs without AMX) keep their fp32
storage: that route multiplies bf16-rounded fp32 values and needs them in fp32.

Loading for sharding (``load_for_sharding``): every rank builds the model with its parameters
on the meta device (no memory; buffers such as rotary frequencies are computed from the
config), shards it with ``fully_shard``, and fills its own shards unit by unit: of each tensor
it reads only the rows its shard holds (safetensors' ``get_slice``) and assigns them as the
parameter's local shard. Nothing is broadcast and no process holds a whole tensor, so host
memory holds one shard per process plus one unit's shard in flight, never a whole model per
process (torchtune and torchtitan broadcast from rank 0 instead, which puts each whole tensor
in every process on its way).
"""

from __future__ import annotations

import contextlib
import re
import types
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dpocache.distributed.process_group import DistEnv
from dpocache.models.directories import reference_weights_dir
from dpocache.runtime.allocator import trim_heap

# checkpoint_files lives with the model directory checks (no torch there); imported from here too.
from dpocache.runtime.preflight import UsageError, checkpoint_files  # noqa: F401
from dpocache.scoring import bf16_matmul

# ------------------------------------------------------------------------- a whole model


def disable_dropout(model: nn.Module) -> None:
    """DPO compares log-probs of the same sequence under two models; dropout would make them
    random. TRL and open-instruct disable it too."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def load_causal_lm(path: str | Path, device: torch.device | str = "cpu",
                   attn_implementation: str | None = "sdpa", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a causal LM in fp32 (the master weights; lower precision is applied by autocast,
    so the reference and the training forward compute the same numbers). ``dtype``: read in
    another dtype (``load_for_storage`` only, which puts back what must stay fp32)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    except (ValueError, ImportError):
        # Some architectures have no SDPA kernel; their own default is the right choice.
        kwargs.pop("attn_implementation", None)
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True, **kwargs)
    check_loaded(path, info)
    disable_dropout(model)
    return model.to(device)


def load_for_storage(path: str | Path, dtype: torch.dtype, attn_implementation: str | None = "sdpa") -> nn.Module:
    """A causal LM on the host whose matrices are about to be stored in ``dtype``
    (``store_frozen_matrices_``: a frozen reference, with or without an adapter; not a LoRA
    policy, whose new adapters PEFT would round to the base's dtype). Tensor for tensor what
    ``load_causal_lm`` gives once those matrices are stored; for a checkpoint saved in ``dtype``
    (every floating tensor of its files), read in ``dtype`` directly, so that the host never
    holds the fp32 copy: an 8B model takes 16 GiB and half the time to load, not 32, in every
    process that loads it (8 ranks of a node: 128 GiB less).

    Read in ``dtype``, the matrices are what storing them would make them, and every other
    parameter (norms, biases, embeddings) is upcast to the fp32 the full load gives: exact, as
    the file holds ``dtype`` values. A model whose buffers ``dtype`` would change (Gemma's
    embedding scale, computed at construction in the loading dtype) is loaded in fp32 instead."""
    if dtype == torch.float32 or checkpoint_dtypes(path) != {dtype}:
        return load_causal_lm(path, "cpu", attn_implementation)
    model = load_causal_lm(path, "cpu", attn_implementation, dtype)
    if any(b.is_floating_point() and b.dtype != torch.float32 for b in model.buffers()):
        return load_causal_lm(path, "cpu", attn_implementation)
    matrices = {id(p) for layer in _matrix_layers(model) for p in layer.parameters(recurse=False)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    upcast: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.float32 and (id(p) not in matrices or id(p) in embeddings):
                # A head tied to an embedding is an embedding here, as store_frozen_matrices_ sees it.
                stored = upcast.setdefault(id(p), nn.Parameter(p.float(), requires_grad=p.requires_grad))
                setattr(module, name, stored)
    return model


def checkpoint_dtypes(path: str | Path) -> set[torch.dtype | None]:
    """The dtypes of the floating tensors in the safetensors files of the model in ``path``
    (read from their headers); empty for a model in another format."""
    files = checkpoint_files(reference_weights_dir(path))
    if not files or any(f.suffix != ".safetensors" for f in files):
        return set()
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
    found = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            found |= {f.get_slice(key).get_dtype() for key in f.keys()}
    # A floating dtype not named here (an 8-bit float) is None: never the storage dtype.
    return {names.get(d) for d in found if d in names or d.startswith(("F", "BF"))}


def check_loaded(path: str | Path, info: dict) -> None:
    """Refuse weights that do not fit the model: transformers fills a missing or wrongly shaped
    weight with a random one and goes on (a reference or a policy of random numbers, exit 0).
    Weights the model does not use (``unexpected``) are named alongside, for the diagnosis."""
    missing, mismatched = sorted(info.get("missing_keys") or ()), info.get("mismatched_keys") or ()
    if not missing and not mismatched:
        return
    unexpected = sorted(info.get("unexpected_keys") or ())
    parts = [f"{len(missing)} missing (e.g. {', '.join(missing[:2])})" if missing else "",
             f"{len(mismatched)} of another shape (e.g. {mismatched[0][0]})" if mismatched else "",
             f"{len(unexpected)} in the files the model does not have (e.g. {', '.join(unexpected[:2])})"
             if unexpected else ""]
    raise UsageError(f"{path}: the weights do not fit the model's config: {'; '.join(p for p in parts if p)}; "
                     "transformers would fill them with random values")


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
def store_frozen_matrices_(model: nn.Module, dtype: torch.dtype = torch.bfloat16, skip_trainable: bool = False) -> int:
    """Store the matrix weights (and their biases) of a frozen model used only under ``dtype``
    autocast in ``dtype``, in place; returns how many layers changed. ``skip_trainable``: leave
    the layers with a parameter that requires grad (a LoRA policy's adapters) in fp32, and store
    only its frozen base.

    Left in fp32: a weight tied to an embedding (an embedding lookup is not autocast, so its
    fp32 values reach the residual stream), every non-matrix parameter, and the layers
    ``dpocache.scoring.bf16_matmul`` switched to the fp32 GEMM (they need fp32 storage). An
    embedding table whose values are all exact in ``dtype`` (a checkpoint saved in it) is
    stored in it all the same, its lookup cast back to fp32 (``store_exact_embeddings_``).
    """
    if dtype == torch.float32:
        return 0
    count = store_exact_embeddings_(model, dtype, skip_trainable)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for layer in _matrix_layers(model):
        if bf16_matmul.installed(layer) or id(layer.weight) in embeddings:
            continue
        if skip_trainable and any(p.requires_grad for p in layer.parameters(recurse=False)):
            continue
        for name, p in list(layer.named_parameters(recurse=False)):
            if p.dtype == torch.float32:
                setattr(layer, name, nn.Parameter(p.to(dtype), requires_grad=False))
        count += 1
    return count


@torch.no_grad()
def store_exact_embeddings_(model: nn.Module, dtype: torch.dtype, skip_trainable: bool = False) -> int:
    """Store each frozen ``nn.Embedding`` table whose every value is exact in ``dtype`` in
    ``dtype``, its lookup cast back to fp32: the residual stream gets the same fp32 values, bit
    for bit, from half the memory (a checkpoint saved in bf16, as most are: 1 GiB of an 8B
    Llama's 2 GiB table). A head tied to the table shares the new weight (autocast computes it
    in ``dtype`` anyway), unless ``bf16_matmul`` routes that head through the fp32 GEMM.
    Subclasses of ``nn.Embedding`` are left alone (Gemma 3 scales inside its lookup, in the
    table's dtype), as are tables on the meta device and, with ``skip_trainable``, trainable
    ones. Returns how many tables changed."""
    count = 0
    for table in [m for m in model.modules() if type(m) is nn.Embedding]:
        weight = table.weight
        if weight.dtype != torch.float32 or weight.is_meta or (skip_trainable and weight.requires_grad):
            continue
        holders = [(m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False) if p is weight]
        if any(bf16_matmul.installed(m) for m, _ in holders) or not _exact_in(weight, dtype):
            continue
        stored = nn.Parameter(weight.to(dtype), requires_grad=False)
        for module, name in holders:
            setattr(module, name, stored)
        table.forward = types.MethodType(_lookup_in_fp32, table)
        count += 1
    return count


def _exact_in(weight: torch.Tensor, dtype: torch.dtype, rows: int = 8192) -> bool:
    """Whether every value of ``weight`` survives a round trip through ``dtype`` (in chunks of
    ``rows``: no copy of the whole table)."""
    return all(torch.equal(chunk.to(dtype).float(), chunk) for chunk in weight.split(rows))


def _lookup_in_fp32(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return nn.Embedding.forward(self, ids).float()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each shared tensor counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def routes_bf16_through_fp32(device: torch.device | str) -> bool:
    """Whether bf16 linear layers on ``device`` take ``dpocache.scoring.bf16_matmul``'s fp32-GEMM
    route (CPUs without AMX tiles, unless ``$DPOCACHE_BF16_MATMUL`` says otherwise)."""
    return torch.device(device).type == "cpu" and bf16_matmul.resolve_mode() == "fp32-gemm"


# ------------------------------------------------------------------------ loading for sharding


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device as they are registered (before any
    initialisation runs on them); buffers stay real. Buffers the state dict leaves out (rotary
    frequencies) are computed at construction from the config, so this gives every rank their
    values without reading or sending anything (what accelerate's ``init_empty_weights`` does)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_model(path: str | Path, attn_implementation: str | None = "sdpa") -> nn.Module:
    """The model of ``path``'s config with its parameters on the meta device (no memory, no
    initialisation) and its buffers computed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with _parameters_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except (ValueError, ImportError):  # no SDPA kernel: the architecture's default, as load_causal_lm
            kwargs.pop("attn_implementation", None)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    disable_dropout(model)
    return model


def safetensors_files(path: Path) -> list[Path]:
    """``checkpoint_files`` of a full model that must be safetensors (read by name and range)."""
    files = [f for f in checkpoint_files(path) if f.suffix == ".safetensors"]
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return files


def _unit_of(key: str) -> str:
    """The decoder layer a weight belongs to (``model.layers.3``), else ``""`` (the root's)."""
    match = re.match(r"(.*\.layers\.\d+)\.", key)
    return match.group(1) if match else ""


def _file_units(path: Path) -> tuple[dict[str, list[tuple[Path, str]]], set[str]]:
    """Every weight of the checkpoint grouped by FSDP unit, and the set of names (read from
    the files' headers only)."""
    units: dict[str, list[tuple[Path, str]]] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                units.setdefault(_unit_of(key), []).append((file, key))
    return units, {k for entries in units.values() for _, k in entries}


def shard_rows(rows: int, world: int, rank: int) -> slice:
    """The rows of a dim 0 of ``rows`` that ``rank``'s FSDP2 shard holds: FSDP2 splits dim 0 as
    ``torch.chunk`` does, ``ceil(rows / world)`` per rank, so the last ranks' shares may be
    shorter, or empty."""
    per_rank = -(-rows // world)
    start = min(rows, rank * per_rank)
    return slice(start, min(rows, start + per_rank))


def local_rows(param: torch.Tensor) -> slice | None:
    """The rows of dim 0 this rank's FSDP2 shard of ``param`` holds, else None (not a
    ``DTensor``: the whole tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or param.dim() == 0:
        return None
    return shard_rows(param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank())


def _read_unit(entries: list[tuple[Path, str]], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One unit's tensors as this rank holds them: of each sharded parameter only its own rows
    (read with ``get_slice``, so the file's other rows are never copied), as a ``DTensor``
    shard in the dtype the model stores it in; anything else (a persistent buffer) whole."""
    from torch.distributed.tensor import DTensor

    out = {}
    for file in dict.fromkeys(f for f, _ in entries):
        with safe_open(str(file), "pt") as f:
            for key in (k for g, k in entries if g == file):
                target = targets[key]
                rows = local_rows(target)
                value = f.get_tensor(key) if rows is None else f.get_slice(key)[rows]
                # A copy: safetensors' tensors are views of a private mapping of the whole file,
                # which a later write to the file (a checkpoint saved over it) would break.
                value = value.to(target.dtype, copy=True)
                if rows is not None:
                    value = DTensor.from_local(value, target.device_mesh, target.placements, run_check=False,
                                               shape=target.shape, stride=target.stride())
                out[key] = value
    return out


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


def _check_names(path: Path, model: nn.Module, in_files: set[str]) -> str | None:
    expected = set(model.state_dict()) - set(tied_aliases(model))
    missing, unexpected = sorted(expected - in_files), sorted(in_files - set(model.state_dict()))
    if missing or unexpected:
        return f"{path}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
    return None


def _ties(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` of each parameter that appears under a second name (tied weights)."""
    first: dict[int, str] = {}
    ties = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
        first.setdefault(id(p), name)
    return ties


def load_for_sharding(path: str | Path, env: DistEnv, prepare, shard, attn_implementation: str | None = "sdpa"):
    """Build the model of ``path`` on the meta device on every rank, ``prepare(model)`` it
    (dtypes, checkpointing), ``shard(model)`` it (returns the FSDP2 root), then fill the shards
    unit by unit from the safetensors files. A collective. Returns ``(model, root)``.

    Every rank reads, one FSDP unit (a decoder layer, or the root's weights) at a time, only
    the rows of each tensor its own shard holds (``local_rows``) and assigns them as the
    parameter's shard (FSDP2 re-pads them in its load hook). So no process ever holds a whole
    tensor of the model, nor sends or receives one; the page cache shares the files' pages.
    """
    path = Path(path)
    model = meta_model(path, attn_implementation)
    prepare(model)
    units, in_files = _file_units(path)
    problem = _check_names(path, model, in_files)
    if problem:
        raise ValueError(problem)
    ties = _ties(model)
    root = shard(model)
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    for entries in units.values():
        state = _read_unit(entries, targets)
        model.load_state_dict(state, strict=False, assign=True)
        del state
    # Loading assigns a new parameter under each name it loads: point the tied names (lm_head
    # = embeddings, saved once) at it again, before FSDP's first forward looks at them.
    for alias, source in ties.items():
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(source))
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"{path}: parameters not loaded: {left[:5]}")
    trim_heap()  # the files' read buffers: freed, but kept by glibc unless trimmed
    return model, root


def load_tokenizer(model_path: str | Path):
    """The tokenizer of a model directory (an adapter directory's base when it holds none)."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError):
        # A PEFT adapter directory may hold no tokenizer; its base does.
        tokenizer = AutoTokenizer.from_pretrained(str(reference_weights_dir(path)))
    if len(tokenizer) == 0:  # transformers builds an empty one from a directory without a vocabulary
        raise UsageError(f"--model {path}: the tokenizer there has an empty vocabulary")
    return tokenizer
