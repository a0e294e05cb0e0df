"""The policy: loading (full or LoRA), the optimizer, the schedule, distributed wrapping."""

from __future__ import annotations

import difflib
import inspect
import math
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dpocache.cache.probes import ProbeMemo
from dpocache.config import Config, ConfigError, LoraConfig, checkpoint_keep_names, flag_name
from dpocache.distributed.fsdp import shard_policy
from dpocache.distributed.process_group import DistEnv
from dpocache.distributed.sharded_reference import probe_sharded, report_shards
from dpocache.models.checkpointing import enable_checkpointing
from dpocache.models.directories import adapter_base_dir
from dpocache.models.kernels import KernelChoice, apply_kernels
from dpocache.models.lora_fused import fuse_lora_updates_
from dpocache.models.streaming import StreamedLayers, move_resident_, spread_resident
from dpocache.models.loading import (
    disable_dropout,
    load_causal_lm,
    load_for_sharding,
    load_for_storage,
    routes_bf16_through_fp32,
    store_frozen_matrices_,
)
from dpocache.scoring.logprobs import CompletionLogProbs, decoder_layers


def check_lora_settings(cfg: Config) -> None:
    """LoRA fields that would be ignored or fail, refused before any model loads: ``--lora.alpha``
    (or dropout, targets) without ``--lora-r`` trained every weight; ``--lora-r``, alpha or
    targets with a PEFT adapter directory as ``--model`` trained the saved adapter as it was; a
    target module the model does not have. An adapter directory takes ``--lora.dropout``
    (``set_lora_dropout``)."""
    defaults = LoraConfig()

    def changed(*names: str) -> str:
        return ", ".join(f"{flag_name('lora.' + n)} {getattr(cfg.lora, n)!r}" for n in names
                         if getattr(cfg.lora, n) != getattr(defaults, n))

    if cfg.model.path and (Path(cfg.model.path) / "adapter_config.json").is_file():
        if flags := changed("r", "alpha", "target_modules"):
            raise ConfigError(f"{flags}: --model {cfg.model.path} is a PEFT adapter, which trains with its own rank, "
                              "alpha and target modules (adapter_config.json); drop these flags, or pass its base "
                              "model as --model to train a fresh adapter")
    elif cfg.lora.r == 0 and (flags := changed("alpha", "dropout", "target_modules")):
        raise ConfigError(f"{flags} set without {flag_name('lora.r')}: a rank of 0 trains every weight (no LoRA); "
                          "pass --lora-r N for a LoRA adapter")
    elif cfg.lora.r > 0 and cfg.model.path:
        check_lora_target_names(cfg.model.path, cfg.lora.target_modules)


def set_lora_dropout(model: nn.Module, p: float) -> int:
    """Give every LoRA layer of ``model`` dropout ``p`` (peft's ``nn.Identity`` for 0), in place of
    the rate saved with a loaded adapter: ``--lora.dropout`` is the run's, and the base model's
    dropout is off (``disable_dropout``). Returns how many layers were set."""
    count = 0
    for module in model.modules():
        rates = getattr(module, "lora_dropout", None)
        if isinstance(rates, nn.ModuleDict):
            for name in rates:
                rates[name] = nn.Dropout(p) if p > 0 else nn.Identity()
                count += 1
    return count


def load_policy(cfg: Config, device: torch.device, kernels: KernelChoice | None = None,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """fp32 master weights (autocast supplies ``dtype`` compute). With ``lora.r > 0`` a fresh
    PEFT LoRA adapter is added; a PEFT adapter directory as ``model.path`` is loaded trainable,
    with the run's ``lora.dropout``. ``kernels``: Liger's patched in, if chosen
    (``dpocache.models.kernels``), after LoRA (Liger's forwards call PEFT's layers) and before
    any layer is compiled.

    Under LoRA the base's matrices are frozen: where ``dtype`` is bf16 or fp16 and the device
    runs it natively, they are stored in ``dtype`` (``frozen_in_compute_dtype``), the same
    values autocast would cast them to at every call, in half the memory (16 GiB less for an
    8B base). A checkpoint saved in ``dtype`` is read in it on the host (``load_for_storage``),
    so neither the host nor the device ever holds the fp32 base (an 8B LoRA run's host peak
    was 49 GB with it: docs/benchmarks/gpu-suite-h200-20261126.md). PEFT rounds a fresh
    adapter's init to its base layer's dtype before it casts it to fp32, so the init is drawn
    again in fp32 (``init_lora_``), and the adapters take their inputs in ``dtype``
    (``keep_adapter_inputs_``). Under bf16 or fp16 autocast each LoRA layer adds its update
    inside ``lora_B``'s GEMM (``fuses_lora_updates``).

    ``model.stream_base``: the frozen base's decoder layers stay in host memory, each copied to
    the device just ahead of its forward and, in reverse, of the backward's recompute
    (``dpocache.models.streaming``); the adapters, embeddings and head are on the device, and so
    are ``model.resident_layers`` of the decoder layers, spread among the streamed ones
    (``spread_resident``), and ``model.turn_layers`` more streamed layers wait there from each
    backward to the next forward. The model then has ``dpocache_streamed``, its ``StreamedLayers``.

    ``model.gradient_checkpointing``: each decoder layer checkpointed, with
    ``model.checkpoint_keep`` the named frozen matrices' products kept through the recompute and
    with ``model.skip_unread_products`` those the backward never reads not computed in it
    (``dpocache.models.checkpointing``, ``skips_unread_products``); ``dpocache_products`` names
    those layers (``CheckpointedProducts``). With a
    streamed base and ``model.compile`` on, each layer's forward is compiled inside its
    checkpoint (``LayerCheckpoint``); a resident policy's layers are compiled by ``train``'s
    setup (``scoring.compiling.compile_layers``)."""
    path = Path(cfg.model.path)
    base = adapter_base_dir(path)  # the same base the reference of an adapter directory loads
    staged = frozen_in_compute_dtype(cfg, device, dtype)
    stream = cfg.model.stream_base  # read to the host, where the base's layers stay

    def load_base(where: Path) -> nn.Module:
        if staged:  # on the host, in dtype where the checkpoint holds dtype
            return load_for_storage(where, dtype, cfg.model.attn_implementation)
        return load_causal_lm(where, "cpu" if stream else device, cfg.model.attn_implementation)

    if base is not None:
        from peft import PeftModel

        # PEFT casts the adapter to fp32 before it reads the file: its values are the file's.
        model = PeftModel.from_pretrained(load_base(base), str(path), is_trainable=True)
        # The base as loaded, a local directory (a Hub id's snapshot is named by its id again when
        # saved: checkpoint.name_adapter_base), so that PEFT's save looks for its config locally.
        for adapter in model.peft_config.values():
            adapter.base_model_name_or_path, adapter.revision = str(base), None
        set_lora_dropout(model, cfg.lora.dropout)
    else:
        model = load_base(path)
        if cfg.lora.r > 0:
            model = add_lora(model, cfg)
    if staged:
        store_frozen_matrices_(model, dtype, skip_trainable=True)
        keep_adapter_inputs_(model)
    if fuses_lora_updates(cfg, device, dtype):
        fuse_lora_updates_(model)
    if kernels is not None:
        apply_kernels(model, kernels)
    if cfg.model.gradient_checkpointing:
        # --checkpoint-keep: the named frozen matrices' products kept through the recompute;
        # --skip-unread-products: those no backward reads not computed there;
        # --compile on with a streamed base: each layer's forward compiled inside its checkpoint
        model.dpocache_products = enable_checkpointing(model, checkpoint_keep_names(cfg.model.checkpoint_keep),
                                                       compiled=stream and cfg.model.compile == "on",
                                                       skip_unread=skips_unread_products(cfg, device, dtype))
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    if stream:
        layers = decoder_layers(model)
        resident = set(spread_resident(len(layers), cfg.model.resident_layers))  # checked by train's setup
        streamed = [layer for index, layer in enumerate(layers) if index not in resident]
        move_resident_(model, streamed, device)
        model.dpocache_streamed = StreamedLayers(model, streamed, device, turn_layers=cfg.model.turn_layers)
        return model
    return model.to(device)


def frozen_in_compute_dtype(cfg: Config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``load_policy`` stores a LoRA base's frozen matrices in ``dtype``: a LoRA run
    (fresh or an adapter directory) in bf16 or fp16 where the linear layers run that dtype
    natively (not through ``bf16_matmul``'s fp32 GEMM, which needs fp32 weights)."""
    return _lora_under_native_autocast(cfg, device, dtype)


def _lora_under_native_autocast(cfg: Config, device: torch.device, dtype: torch.dtype) -> bool:
    """A LoRA run (fresh or an adapter directory) under bf16 or fp16 autocast on native kernels."""
    lora = cfg.lora.r > 0 or adapter_base_dir(Path(cfg.model.path)) is not None
    return lora and dtype in (torch.bfloat16, torch.float16) and not routes_bf16_through_fp32(device)


def keep_adapter_inputs_(model: nn.Module) -> int:
    """Stop PEFT casting each adapter's input to the adapter's fp32 (``cast_input_dtype_enabled``,
    PEFT's documented switch); returns how many layers changed. For a base stored in the autocast
    dtype only: there autocast casts ``lora_A``'s input back to that dtype at once, so the round
    trip (bf16 to fp32 to bf16, exact) changes no value and cost two copies of the input, and two
    of its gradient, in every adapted layer whose input is bf16 (attention's output and the MLP's
    down projection: on an 8B Llama, activations up to 14336 wide)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def fuses_lora_updates(cfg: Config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``load_policy`` adds each LoRA layer's update inside ``lora_B``'s GEMM
    (``dpocache.models.lora_fused``): a LoRA run under bf16 or fp16 autocast on native kernels.
    fp32 runs, and bf16 through ``bf16_matmul``'s fp32 GEMM, keep PEFT's forward."""
    return _lora_under_native_autocast(cfg, device, dtype)


def skips_unread_products(cfg: Config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a checkpointed policy's recompute skips the products its backward never reads
    (``model.skip_unread_products``): where asked, except where its layers compile whole
    (``--compile on`` without ``--stream-base``: the checkpoint is inside the graph, where the
    phase of a call is not known), and in bf16 on a CPU that routes bf16 products through
    ``bf16_matmul``'s fp32 GEMM, whose forward those layers keep (a skipping layer runs its
    product natively, slower there and rounded otherwise)."""
    whole = cfg.model.compile == "on" and not cfg.model.stream_base
    routed = dtype == torch.bfloat16 and routes_bf16_through_fp32(device)
    return cfg.model.skip_unread_products and not whole and not routed


def _prepare_policy(model: nn.Module, cfg: Config) -> None:
    """What ``load_sharded_policy`` does to a full-weight model after loading: no dropout,
    per-layer activation checkpointing if asked (every weight trained: no product to skip,
    ``skip_unread_products_``)."""
    disable_dropout(model)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)


def load_sharded_policy(cfg: Config, env: DistEnv, dtype: torch.dtype, probe_memo: ProbeMemo | None = None,
                        kernels: KernelChoice | None = None) -> tuple[nn.Module, nn.Module]:
    """``train --fsdp``'s policy, created on the meta device on every rank and filled shard by
    shard from the files, each rank reading its own rows (``dpocache.models.loading.load_for_sharding``),
    sharded with FSDP2 in ``dtype``'s mixed precision. A collective. Returns ``(policy, scorer)``: the causal LM and
    the ``CompletionLogProbs`` that is FSDP's root. ``kernels``: Liger's patched in before sharding, if chosen."""
    if (Path(cfg.model.path) / "adapter_config.json").exists():
        raise ConfigError(f"{cfg.model.path}: --fsdp (distributed.fsdp) trains full weights; a PEFT adapter "
                          "directory is a LoRA run (use DDP: no --fsdp)")

    def shard(model):
        scorer = CompletionLogProbs(model, probe=False)  # probed below, once its shards are filled
        return shard_policy(scorer, model, env, compute_dtype=dtype)

    def prepare(model):
        _prepare_policy(model, cfg)
        if kernels is not None:
            apply_kernels(model, kernels)  # on the meta device: Liger patches the modules' forwards

    policy, scorer = load_for_sharding(cfg.model.path, env, prepare, shard, cfg.model.attn_implementation)
    # The fast-path verdict of the sharded reference pass when it ran on this architecture
    # (dpocache.cache.probes): probing here would gather the whole output head and embeddings.
    probe_sharded(scorer, env, dtype, probe_memo)
    report_shards("policy", policy, env)
    return policy, scorer


def add_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """A fresh LoRA adapter on ``model`` (PEFT's), its weights initialised in fp32 from the run's
    seed (``init_lora_``)."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora.target_modules
    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout, task_type="CAUSAL_LM",
                      target_modules=names)
    model = get_peft_model(model, lora)
    init_lora_(model, cfg.train.seed)
    return model


def check_lora_target_names(model_path: str | Path, target_modules: str) -> None:
    """``check_lora_targets`` against the model at ``model_path`` built on the meta device from its
    config: no weights are read, so a typo costs one line before any model loads."""
    if target_modules == "all-linear":
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    check_lora_targets(model, [t.strip() for t in target_modules.split(",")])


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Each of ``--lora.target_modules`` names modules of ``model`` as PEFT matches them (a
    module's full name, or its last parts): a typo was PEFT's traceback after the model loaded,
    and one typo in a list of several trained the others without a word."""
    modules = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if not any(True for _ in m.children()) and getattr(m, "weight", None) is not None
                         and getattr(m.weight, "ndim", 0) == 2 and not isinstance(m, nn.Embedding)})
        close = difflib.get_close_matches(missing[0], leaves, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{flag_name('lora.target_modules')}: no module of the model is named "
                          f"{', '.join(map(repr, missing))}{hint}; its linear layers are {', '.join(leaves)}, or "
                          "all-linear")


def init_lora_(model: nn.Module, seed: int) -> int:
    """PEFT's own initialisation of every LoRA layer of ``model`` (A: kaiming-uniform, B: zero),
    run again on its fp32 weights from ``seed``: PEFT drew A in fp32 and then rounded it to the
    base layer's dtype, which a base stored in bf16 makes bf16. So the init is the same whatever
    the base's storage, and on every rank. The process's random state is left as it was.
    Returns how many layers were initialised."""
    layers = [m for m in model.modules() if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in layers:
            for name in layer.lora_A:
                layer.reset_lora_parameters(name, True)
    return len(layers)


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases and norm weights (1-D parameters), as is standard."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # On GPUs the fused kernel updates every parameter in a few launches (the default, foreach,
    # makes several passes over the weights and states); CPUs keep the default, whose results
    # the CPU tests compare bit for bit across process counts.
    on_cuda = all(p.is_cuda for group in groups for p in group["params"])
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             fused=True if on_cuda and (decay or no_decay) else None)


def build_grad_scaler(dtype: torch.dtype, device: torch.device, sharded: bool):
    """Loss scaling for float16 autocast; None for bfloat16 and float32, whose exponent range
    holds any gradient. float16's smallest normal value is 6.1e-5 (subnormals end at 6e-8), and
    a preference loss's gradient is beta times a sigmoid, divided over the global batch and
    spread over the tokens: unscaled, much of it rounds to zero in float16 backward, silently.
    The loss is multiplied by a scale before backward and the gradients divided by it before
    clipping; a step whose gradients overflow is skipped and the scale halved, and the scale
    doubles after 2,000 clean steps (torch.amp.GradScaler's defaults, which Hugging Face's
    Trainer uses for fp16 too). FSDP2: each rank holds a shard of the gradients, so the overflow
    flag is reduced over the ranks (ShardedGradScaler)."""
    if dtype != torch.float16:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


def lr_multiplier(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over ``warmup`` steps, then linear or cosine decay to 0 at ``total``.
    Warm-up step ``s`` runs at ``(s + 1) / warmup`` of the peak: no step is spent at lr 0
    (transformers' schedules start at 0, so their ramp ends one step later)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(1.0, max(0.0, progress))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"optim.schedule must be linear, cosine or constant; got '{schedule}'")


def warmup_steps(ratio: float, total_steps: int) -> int:
    """Warm-up steps for ``optim.warmup_ratio``: rounded up, as transformers does, so a ratio
    above 0 always warms up (0.05 of 9 steps rounded to nearest was no warm-up at all). The
    product is rounded to 9 decimals first: 0.1 * 30 is 3.0000000000000004 in floats, and 10%
    of 30 steps is 3, not 4."""
    return math.ceil(round(ratio * total_steps, 9))


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    warmup = warmup_steps(cfg.optim.warmup_ratio, total_steps)
    lr_multiplier(0, total_steps, warmup, cfg.optim.schedule)  # validate the schedule name now
    return torch.optim.lr_scheduler.LambdaLR(optimizer,
                                             lambda s: lr_multiplier(s, total_steps, warmup, cfg.optim.schedule))


def wrap_for_distributed(scorer: nn.Module, policy: nn.Module, cfg: Config, env: DistEnv) -> nn.Module:
    """DDP (or FSDP2 with ``distributed.fsdp``) around the log-prob module under torchrun."""
    if not env.enabled:
        return scorer
    if cfg.distributed.fsdp:
        return shard_policy(scorer, policy, env)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    streamed = getattr(policy, "dpocache_streamed", None)
    if streamed is not None:
        # A streamed base's frozen weights rest in host memory between their layers' calls and are
        # the same on every rank (each reads them from the checkpoint): DDP neither broadcasts nor
        # checks them. Left in, DDP refuses a module whose parameters are on two device types.
        own = {id(p) for p in streamed.parameters()}
        DDP._set_params_and_buffers_to_ignore_for_model(scorer, [n for n, p in scorer.named_parameters()
                                                                 if id(p) in own])
    # The only buffers are constants (rotary frequencies): no need to broadcast them before
    # every forward, and without that collective an eval forward needs no other rank.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})  # the name before torch 2.13
    return DDP(scorer, device_ids=device_ids, **no_buffer_sync)
