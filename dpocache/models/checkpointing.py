"""Activation checkpointing of the decoder layers, and the products it keeps (``--checkpoint-keep``).

``--gradient-checkpointing true`` checkpoints each decoder layer where transformers' per-layer
checkpoint calls it, through a ``LayerCheckpoint`` of dpocache's (``enable_checkpointing``): the
forward keeps each layer's input only, and the backward runs the layer's forward again before
its own backward. For a LoRA policy that recompute is a third pass over the frozen base: a step
executes 6N FLOPs for the 4N it needs (a forward and the backward to the activations). With a
streamed base and ``--compile on`` the layer's forward is compiled inside its checkpoint
(``LayerCheckpoint``).

``--checkpoint-keep o_proj`` (``model.checkpoint_keep``, a comma-separated list of the
decoder layers' linear layers, by name as in ``--lora.target_modules``) keeps, in the forward,
the product of each named layer's frozen matrix, and the recompute takes it instead of
running the GEMM again: memory for speed, one ``(tokens, out_features)`` tensor in the compute
dtype per named layer and decoder layer. Which to keep, by what a kept byte saves: an 8B
Llama's ``down_proj`` is 27% of a layer's matrix FLOPs for an output 4,096 wide (8 KiB per
token in bf16), and skipped without keeping anything where no backward reads it (below);
``gate_proj`` and ``up_proj`` are as large for outputs 14,336 wide, and ``q_proj``,
``k_proj``, ``v_proj`` and ``o_proj`` save as much per byte as those two (docs/memory.md,
"Products kept through the recompute").

The recompute runs the layer's modules as before, so the frozen matrix is still at hand for the
backward, as autograd saved it (``_KeptProduct`` saves the weight and gives the input its
gradient ``grad @ W``, as ``F.linear``'s own backward does: the same values bit for bit,
``tests/models/test_checkpointing.py``); a streamed layer (``dpocache.models.streaming``) is
still fetched for it. Only frozen matrices are kept (a LoRA policy's base): a trained one
would need its input kept for its own gradient too.

``--checkpoint-keep attention`` keeps the causal rows' attention output and log-sum-exp
instead, so the recompute runs no flash attention forward (``dpocache.models.kept_attention``).
The phases of a checkpointed call, and what the forward keeps for the recompute, live in
``dpocache.models.checkpoint_phases``.

A frozen product the recompute never reads is not computed at all (``--skip-unread-products``,
``model.skip_unread_products``, on by default): the recompute exists to rebuild the tensors the
layer's backward saved, and its output is never read (the non-reentrant checkpoint drops it; the
reentrant one backpropagates through it, reading its shape only). In the families of
``UNREAD_PRODUCTS`` the MLP's output projection (``down_proj``) goes straight into the residual
sum the layer returns, so no saved tensor depends on its product: the recompute returns zeros of
its shape instead, and the input still gets ``grad @ W``. On an 8B Llama that is the same 27% of
a layer's matrix FLOPs ``--checkpoint-keep down_proj`` saves, without its 8 KiB per token and
layer; the tests check the gradients bit for bit against full recomputation in each family, and
that zeros in place of any other product change them. Training every weight needs none of it:
there the down projection saves its input last, and torch's checkpoint stops the recompute once
the last saved tensor is back (its early stop), before that product runs; under LoRA the
adapter's products save tensors after it.

torch's selective checkpointing (``create_selective_checkpoint_contexts``) keeps any op's output
by a policy, but sees every op of the checkpointed layer through a Python dispatch mode: on a
tiny LoRA Llama on one CPU thread, where the kernels take no time, it raised the host time of a
checkpointed forward and backward by about half (docs/memory.md), where the 8B LoRA step's host
time is already as long as its device time. Here only the named layers do any Python work, and
the checkpoint's own context hooks (``context_fn``) say whether a call is the forward or the
recompute, a store per checkpointed call: a forward whose backward never runs leaves nothing
for another's recompute to take.

A layer compiled inside its checkpoint (``LayerCheckpoint``, a streamed base under ``--compile
on``) keeps its products through one operation the compiler leaves opaque
(``dpocache::kept_linear``, ``compiled_kept_product_forward``): the call's phase is its grad
mode there (the reentrant checkpoint's forward runs without autograd), and the operation reads
it when it runs, not when it is traced, so one graph serves the forward and another the
recompute, every layer alike.
"""

from __future__ import annotations

import functools
import logging
import types
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpocache.config import KEEP_ATTENTION, ConfigError, flag_name
from dpocache.models.checkpoint_phases import Phase, checkpoint_phases, current_phase, in_phase_by_grad_mode
from dpocache.models.directories import adapter_base_dir
from dpocache.models.kept_attention import keep_attention_
from dpocache.scoring.attention import causal_supported
from dpocache.scoring.compiling import compiled_function
from dpocache.scoring.logprobs import decoder_layers

log = logging.getLogger(__name__)

# Set on an nn.Linear whose forward keeps its product (lora_fused adds the update out of place).
KEEPS_PRODUCT = "dpocache_keeps_product"
# Set on an nn.Linear given a forward of this module's (bf16_matmul leaves it alone).
OWN_FORWARD = "dpocache_checkpoint_forward"
# Set on an nn.Linear given ``compiled_unread_product_forward``: read by lora_fused while dynamo
# traces, where a plain attribute reads alike under every torch. Told by the forward's identity
# instead, the skipped products' LoRA layers did not take dpocache::lora_linear on an H200 under
# torch 2.11 (docs/benchmarks/gpu-suite-h200-20261127-1850.md).
COMPILED_UNREAD = "dpocache_compiled_unread_product"

# The linear layers whose product no saved tensor of a checkpointed layer depends on, by decoder
# layer class (the code that runs): the output projection added straight into the residual sum
# the layer returns. Families whose layers normalise that product first (Gemma 2 and 3, OLMo 2:
# ``post_feedforward_layernorm``) read it in their backward and are not here; neither is a
# family no test builds (tests/models/test_checkpointing.py checks each one listed).
UNREAD_PRODUCTS: dict[str, tuple[str, ...]] = {
    "LlamaDecoderLayer": ("down_proj",), "MistralDecoderLayer": ("down_proj",),
    "Qwen2DecoderLayer": ("down_proj",), "Qwen3DecoderLayer": ("down_proj",), "GemmaDecoderLayer": ("down_proj",),
}


class CheckpointedProducts(NamedTuple):
    """What ``enable_checkpointing`` did, by qualified name: the linear layers whose products
    are kept through the recompute (``--checkpoint-keep``) or not computed in it (unread), and
    the attention modules whose output is kept (``--checkpoint-keep attention``)."""

    kept: list[str]
    skipped: list[str]
    attention: list[str]


def enable_checkpointing(model: nn.Module, keep: tuple[str, ...] = (), compiled: bool = False,
                         skip_unread: bool = False) -> CheckpointedProducts:
    """Checkpoint each decoder layer of ``model`` (a transformers model, or a PEFT model around
    one) through a ``LayerCheckpoint`` of its own: non-reentrant, or, with ``compiled``, the
    layer's forward compiled inside the checkpoint (``LayerCheckpoint``); either way keeping the
    products of the linear layers named in ``keep`` (``keep_products_``) and, with
    ``skip_unread``, not computing in the recompute those no saved tensor reads
    (``skip_unread_products_``; a name in ``keep`` among them is skipped, not kept); ``attention``
    in ``keep``: the attention's output (``dpocache.models.kept_attention``). Returns the
    qualified names of all three (``CheckpointedProducts``). Non-reentrant works with inputs
    that do not require grad (frozen embeddings in LoRA); the compiled checkpoint needs the
    layers' input to require it (``enable_input_require_grads``)."""
    attention = keep_attention_(model) if KEEP_ATTENTION in keep else []
    keep = tuple(name for name in keep if name != KEEP_ATTENTION)
    unread = unread_products(model) if skip_unread else ()
    if set(keep) & set(unread):
        log.info("activation checkpointing: %s is never read by the backward; its product is skipped in the "
                 "recompute, not kept", ", ".join(n for n in keep if n in unread))
    keep = tuple(name for name in keep if name not in unread)
    kept = keep_products_(model, keep, compiled=compiled) if keep else []
    skipped = skip_unread_products_(model, unread, compiled=compiled) if unread else []
    kwargs = {"use_reentrant": False}
    # transformers 5.x renamed it, warning at every call of the old name; 4.x has the old one only
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in decoder_layers(model):
        if hasattr(layer, "_gradient_checkpointing_func"):
            layer._gradient_checkpointing_func = LayerCheckpoint(phased=bool(kept or skipped or attention),
                                                                 compiled=compiled)
        elif kept or skipped or attention or compiled:  # a model that checkpoints its layers in its own loop
            raise ValueError(f"{type(layer).__name__} is not checkpointed by transformers' per-layer checkpoint; "
                             "it cannot keep or skip products or compile inside its checkpoint")
    return CheckpointedProducts(kept, skipped, attention)


class LayerCheckpoint:
    """How one decoder layer is checkpointed: transformers calls a checkpointed layer's
    ``_gradient_checkpointing_func`` with ``partial(forward, layer, **kwargs)`` and the layer's
    positional inputs, outside the layer's own hooks (they do not run in the recompute).

    Eager: torch's non-reentrant checkpoint, with ``checkpoint_phases`` as its ``context_fn``
    where products are kept or skipped (``phased``). ``compiled`` (``--compile on`` with
    ``--stream-base``): the layer's forward compiled (``scoring.compiling.compiled_function``,
    one graph for every layer) inside torch's reentrant checkpoint, which runs the forward
    without autograd and, in the backward, the recompute and its backward as one autograd call
    (the phase of a call that keeps or skips products is its grad mode): the non-reentrant
    checkpoint's hooks on every saved tensor are host work per tensor, which a compiled layer's
    few kernels no longer hide
    (docs/benchmarks/lora-host-probe-compiled-cpu-2core-20261126.md). A resident layer compiles
    whole instead, its checkpoint inside the graph (``scoring.compiling.compile_layers``), which
    needs its weights alive until its backward: a streamed layer's slot holds another layer by
    then.

    ``before``: called first in the forward and again in the recompute, outside any compiled
    code (a streamed layer fetches its weights: ``dpocache.models.streaming``).

    Earlier transformers (5.17, for one) hand over ``partial(layer.__call__, **kwargs)`` instead,
    the layer's hooks inside the checkpoint. Compiled, this class runs those hooks outside it, as
    5.24 does: traced inside, the hook that gives a streamed slot back breaks the graph and is
    compiled again for every layer, and the reentrant forward runs them without autograd, where
    the streamed order takes the pass for an evaluation
    (docs/benchmarks/gpu-suite-h200-20261126-1325.md)."""

    def __init__(self, phased: bool = False, compiled: bool = False) -> None:
        self.phased, self.compiled = phased, compiled
        self.before: Callable[[], None] | None = None

    def __call__(self, forward: functools.partial, *args):
        layer = getattr(forward.func, "__self__", None)
        if self.compiled and isinstance(layer, nn.Module):  # an earlier transformers: the layer's call
            return _call_with_forward(layer, functools.partial(self._class_forward, layer), *args, **forward.keywords)
        return self._checkpoint(forward, *args)

    def _class_forward(self, layer: nn.Module, *args, **kwargs):
        return self._checkpoint(functools.partial(type(layer).forward, layer, **kwargs), *args)

    def _checkpoint(self, forward: functools.partial, *args):
        """``forward``: ``partial(the layer class's forward, layer, **kwargs)``."""
        run = forward
        if self.compiled:
            run = functools.partial(compiled_function(forward.func), *forward.args, **forward.keywords)
            if self.phased:  # the reentrant forward runs without autograd, its recompute with it
                run = functools.partial(in_phase_by_grad_mode, {}, run)
        if self.before is not None:
            run = functools.partial(_after, self.before, run)
        if self.compiled:
            return checkpoint(run, *args, use_reentrant=True)
        if self.phased:
            return checkpoint(run, *args, use_reentrant=False, context_fn=checkpoint_phases)
        return checkpoint(run, *args, use_reentrant=False)


def _call_with_forward(layer: nn.Module, forward: Callable, *args, **kwargs):
    """``layer`` called with ``forward`` in place of its own: its hooks run as torch runs them.
    A forward set on the layer itself (accelerate's hooks set one) is put back after."""
    own = layer.__dict__.get("forward")
    layer.forward = forward
    try:
        return nn.Module._call_impl(layer, *args, **kwargs)
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


def _after(before: Callable[[], None], run: Callable, *args, **kwargs):
    before()
    return run(*args, **kwargs)


def keep_products_(model: nn.Module, names: tuple[str, ...], compiled: bool = False) -> list[str]:
    """Give every frozen linear layer named in ``names`` inside ``model``'s decoder layers the
    kept-product forward (on the instance; ``compiled``: the one a compiled layer traces); a
    PEFT LoRA layer's is its ``base_layer``. Returns their qualified names. A name that matches
    no linear layer of a decoder layer, or one whose weight is trained, is a ``ConfigError``
    that names the flag."""
    flag = flag_name("model.checkpoint_keep")
    layers = decoder_layers(model)
    found = {name: [linear for layer in layers for short, linear in layer_linears(layer) if short == name]
             for name in names}
    _check_names(names, layers[0])
    qualified = {id(m): name for name, m in model.named_modules()}
    chosen = [linear for name in names for linear in found[name]]
    trained = [linear for linear in chosen if any(p.requires_grad for p in linear.parameters())]
    if trained:
        raise ConfigError(f"{flag}: {qualified[id(trained[0])]} is trained; only frozen matrices (a LoRA policy's "
                          "base) keep their products (a trained one needs its input for its own gradient too)")
    for linear in chosen:
        linear.forward = types.MethodType(compiled_kept_product_forward if compiled else kept_product_forward, linear)
        setattr(linear, KEEPS_PRODUCT, True)
        setattr(linear, OWN_FORWARD, True)
    width = sum(found[name][0].out_features for name in names)
    log.info("activation checkpointing keeps the products of %s in %d decoder layers (%d values per token and layer)",
             ", ".join(names), len(layers), width)
    return [qualified[id(linear)] for linear in chosen]


def unread_products(model: nn.Module) -> tuple[str, ...]:
    """The names of the linear layers whose products no saved tensor of ``model``'s checkpointed
    decoder layers reads (``UNREAD_PRODUCTS``, by the first layer's class; none for a family not
    listed)."""
    layers = decoder_layers(model)
    return UNREAD_PRODUCTS.get(type(layers[0]).__name__, ()) if layers else ()


def skip_unread_products_(model: nn.Module, names: tuple[str, ...], compiled: bool = False) -> list[str]:
    """Give every frozen linear layer named in ``names`` inside ``model``'s decoder layers the
    forward that skips its product in the recompute (``unread_product_forward``; ``compiled``:
    the one a compiled layer traces); a PEFT LoRA layer's is its ``base_layer``. Returns their
    qualified names. ``names`` must come from ``unread_products``: any other product is read by
    the backward, which zeros in its place would change. A trained matrix is left alone: its
    product saves its input for its own gradient, and torch's non-reentrant checkpoint stops the
    recompute once the last saved tensor is back (its early stop), before that product runs."""
    qualified = {id(m): name for name, m in model.named_modules()}
    chosen = [linear for layer in decoder_layers(model) for short, linear in layer_linears(layer)
              if short in names and not any(p.requires_grad for p in linear.parameters())]
    if not chosen:
        return []
    for linear in chosen:
        linear.forward = types.MethodType(compiled_unread_product_forward if compiled else unread_product_forward,
                                          linear)
        setattr(linear, OWN_FORWARD, True)
        setattr(linear, COMPILED_UNREAD, compiled)
    log.info("activation checkpointing: the recompute skips the products of %s in %d decoder layers (the backward "
             "never reads them)", ", ".join(names), len(decoder_layers(model)))
    return [qualified[id(linear)] for linear in chosen]


def check_keep_names(model_path: str | Path, names: tuple[str, ...], attention: str = "causal",
                     device: torch.device | str = "cpu") -> None:
    """``names`` against the decoder layers of the model at ``model_path`` (a PEFT adapter
    directory's base), built on the meta device from its config: no weights are read, so a
    wrong name costs one line before any model loads (``check_keep_names_against``)."""
    if not names:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(adapter_base_dir(model_path) or model_path))
    check_keep_names_against(config, names, attention, device)


def check_keep_names_against(config, names: tuple[str, ...], attention: str = "causal",
                             device: torch.device | str = "cpu") -> None:
    """``names`` against the decoder layers of a model of ``config`` (a transformers config),
    built on the meta device. ``ConfigError`` if one matches no linear layer, or if ``attention``
    is kept where the causal rows will not run (``--attention`` ``attention`` on ``device``;
    the model's family: ``scoring.attention.causal_supported``)."""
    if not names:
        return
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _check_names(names, decoder_layers(model)[0])
    if KEEP_ATTENTION in names:
        why = causal_supported(model)
        if why is None and attention == "auto" and torch.device(device).type != "cuda":
            why = f"{flag_name('model.attention')} auto runs sdpa on {torch.device(device).type} (pass causal)"
        if why is not None:
            raise ConfigError(f"{flag_name('model.checkpoint_keep')}: {KEEP_ATTENTION} keeps the causal rows' "
                              f"attention output, which will not run here: {why}")


def _check_names(names: tuple[str, ...], layer: nn.Module) -> None:
    present = dict.fromkeys(short for short, _ in layer_linears(layer))
    missing = [name for name in names if name not in present and name != KEEP_ATTENTION]
    if missing:
        raise ConfigError(f"{flag_name('model.checkpoint_keep')}: no linear layer named {missing[0]!r} in the decoder "
                          f"layers; they have {', '.join(present) or 'none'}")


def layer_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(name, linear)`` for each linear layer of a decoder layer, in order: ``name`` the last
    component of its module name, ``linear`` the ``nn.Linear`` computing its base product
    (itself, or a PEFT layer's ``base_layer``; a PEFT layer's own parts are not listed)."""
    found, inside = [], set()
    for name, module in layer.named_modules():  # parents before their children
        if id(module) in inside:
            continue
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Linear):
            inside.update(id(m) for m in module.modules())
            found.append((name.rsplit(".", 1)[-1], base))
        elif type(module) is nn.Linear:
            found.append((name.rsplit(".", 1)[-1], module))
    return found


def kept_product_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for a layer that keeps its product through the recompute:
    ``x (..., in)`` → ``(..., out)``. Outside a checkpointed call under grad, the plain product."""
    phase = current_phase()
    if phase is None or not torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    return _KeptProduct.apply(x, self.weight, self.bias, phase, self)


class _KeptProduct(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a frozen ``weight`` and ``bias``: in the forward the
    product is computed and kept for ``module``; in the recompute the kept one is returned
    instead, or, with no ``module`` (a product the backward never reads), nothing is kept and
    the recompute returns zeros of its shape and dtype. Either way the weight is saved and ``x``
    gets ``grad @ weight``, as ``F.linear``'s backward gives it (under autocast the weight as
    the product used it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, phase: Phase,
                module: nn.Module | None) -> torch.Tensor:
        if phase.recompute:
            product = phase.take(module) if module is not None else x.new_zeros(
                (*x.shape[:-1], weight.shape[0]), dtype=_product_dtype(x))
        else:
            product = F.linear(x, weight, bias)  # under the caller's autocast, if any
            if module is not None:
                phase.keep(module, product)
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        return product

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return input_grad(grad, weight, ctx.x_dtype), None, None, None, None


def _product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of ``F.linear``'s product of ``x`` and a weight of its dtype: autocast's where it
    is on for ``x``'s device (none on a device autocast does not know: meta, where a test runs
    a step to see which device each tensor lands on)."""
    device = x.device.type
    on = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    return torch.get_autocast_dtype(device) if on else x.dtype


def input_grad(grad: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """``x``'s gradient of ``F.linear(x, weight)``: ``grad (..., out) @ weight (out, in)``, in
    ``x``'s dtype (autocast's cast of the weight: none where it is stored in the grad's dtype)."""
    return grad.matmul(weight.to(grad.dtype)).to(x_dtype)


def unread_product_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for a frozen layer whose product the backward never reads:
    ``x (..., in)`` → ``(..., out)``, zeros of that shape in a checkpointed call's recompute
    (``_KeptProduct`` keeping nothing). Outside a checkpointed call under grad, the plain product."""
    phase = current_phase()
    if phase is None or not torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    return _KeptProduct.apply(x, self.weight, self.bias, phase, None)


def autocast_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``x``, ``weight`` and ``bias`` cast to the autocast dtype where autocast is on for their
    device, as it would cast them for ``F.linear``; as they are otherwise."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return x, weight, bias


def compiled_kept_product_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for a layer that keeps its product, as a compiled layer traces it:
    one opaque operation (``dpocache::kept_linear``) that decides when it runs whether to
    compute and keep the product (the forward), return the kept one (the recompute) or only
    compute it (no checkpointed call), by the phase the eager ``LayerCheckpoint`` set around the
    compiled call. Autocast is applied here, where it is traced: the operation sees its dtypes."""
    return torch.ops.dpocache.kept_linear(*autocast_inputs(x, self.weight, self.bias))


def compiled_unread_product_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for a frozen layer whose product the backward never reads, as a
    compiled layer traces it: one opaque operation (``dpocache::unread_linear``) that returns
    zeros in a checkpointed call's recompute, by the phase set when it runs, and the product
    otherwise."""
    return torch.ops.dpocache.unread_linear(*autocast_inputs(x, self.weight, self.bias))


@torch.library.custom_op("dpocache::kept_linear", mutates_args=())
def _kept_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, kept in the forward's phase of a checkpointed call and
    taken in its recompute's. The forward keeps a copy: a compiled graph may write over its own
    output in place once its last reader ran (inductor reuses buffers)."""
    phase = current_phase()
    if phase is not None and phase.recompute:
        return phase.take(_kept_linear)
    product = F.linear(x, weight, bias)
    if phase is not None:
        phase.keep(_kept_linear, product.clone())
    return product


@_kept_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _kept_linear_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(weight)
    ctx.x_dtype = x.dtype


def _kept_linear_backward(ctx, grad: torch.Tensor):
    (weight,) = ctx.saved_tensors
    return input_grad(grad, weight, ctx.x_dtype), None, None


_kept_linear.register_autograd(_kept_linear_backward, setup_context=_kept_linear_context)


@torch.library.custom_op("dpocache::unread_linear", mutates_args=())
def _unread_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, zeros of its shape in a checkpointed call's recompute (the
    backward never reads it)."""
    phase = current_phase()
    if phase is not None and phase.recompute:
        return x.new_zeros((*x.shape[:-1], weight.shape[0]))
    return F.linear(x, weight, bias)


@_unread_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# A frozen weight's product: the same backward as a kept one (the input's gradient only).
_unread_linear.register_autograd(_kept_linear_backward, setup_context=_kept_linear_context)
