"""Frozen decoder layers kept in host memory and copied to the device one layer ahead of the
layer that runs: a reference's (``--stream-reference``) and a LoRA policy's base
(``--stream-base``). The device holds the embeddings, the final norm, the head, the adapters
and two layers' frozen weights instead of the whole model.

Why: a pass needs each layer's weights once, and over a token budget of thousands of tokens it
can compute on a layer for longer than a PCIe link takes to bring the next one in, so the
copies can hide behind the compute (docs/memory.md has the arithmetic for an 8B model). An 8B
Llama's 32 layers are 13.0 GiB of its 15.0 GiB in bf16; streamed, they take two slots of 0.41
GiB on the device. verl (``ref.fsdp_config.param_offload``) and OpenRLHF
(``--ref_reward_offload``) offload a reference too, through FSDP's or DeepSpeed's CPU offload,
which are built for sharded training (optimizer steps on the host, collectives); frozen weights
in one process need neither, only the copies, so they are done here.

How: each layer's frozen parameters are packed into one page-locked host buffer (one large
copy per layer: PCIe moves large copies at full speed). When a layer starts, the compute stream
waits for its copy and the layer's modules are pointed at parameters that view its slot; then
the next layer's copy is issued on a side stream into the other slot, once the compute stream
is done with the slot's last user. Without autograd a layer gives its slot back when it ends,
and its modules hold their own parameters again (their values in the host buffer), so between
passes the model's parameters are its own; the last layer fetches the first for the next pass.
Under autograd (a LoRA policy, checkpointed) a layer keeps its slot until the next one starts,
and the order turns at each end: the backward's recompute runs the layers last to first, and
each needs its weights for its recompute and its backward. transformers checkpoints a layer's
``forward`` and keeps the layer's hooks outside, so a layer is also entered by dpocache's
checkpoint (``LayerCheckpoint``, the one training installs) or, under any other, by the first of
its children, or of the modules holding its streamed weights, to be called. A slot that still
holds the layer wanted (at a turn, or with as many slots as layers) is used again without a
copy.

At the bottom turn the two slots already hold the first two layers, which the next forward runs
first. ``turn_layers`` N keeps N more there: in the backward each of the streamed layers 2 to
N+1 keeps its slot when it is done (a new slot takes its place among the two), so the forward
starts with N+2 layers on the device and copies N fewer a step. Their memory is taken where a
step's memory is lowest: at the end of the backward the checkpointed inputs and kept products
of every layer above are freed, and in the forward each gives its slot up as it runs, the
freed slot taking the next copy ahead (the copy stream works from the forward's first layer on,
ahead of compute that needs no copy) until the forward passes the kept layers, when the slots
are given back down to two, before the activations have grown: the step's peak, at its top
turn, holds two slots as before. Copies and the compute on kept layers overlap; a forward
whose compute is shorter than its copies (a small token budget) gains most.

On a CPU the "device" slots are host tensors and the copies synchronous: it runs the
same bookkeeping, which the tests check. Each copy is timed, and on a GPU so is each wait of
the compute for one, and each layer's start says whether the device had run out of work
before the host reached it (``Transfers``): the record says whether the copies hid, and
whether the host or the device set the pace.

Without checkpointing autograd would keep each layer's weights for the backward, which their
slot no longer holds (training refuses it; autograd's version check would stop the backward).
``--compile on`` with ``--stream-base``: each layer's forward is compiled inside its checkpoint
(``dpocache.models.checkpointing.LayerCheckpoint``), which enters the layer before it, in the
forward and in the recompute. A whole layer
compiled (``scoring.compiling.compile_layers``) would trace its own hooks and keep its weights
for its backward, so a streamed reference (``--stream-reference``) stays eager.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dpocache.config import ConfigError, flag_name
from dpocache.models.checkpointing import LayerCheckpoint
from dpocache.runtime.preflight import model_layers

ALIGN = 256  # bytes: each parameter starts on a boundary its dtype (and any vector load) accepts
# The most layers one page-locked allocation holds. torch's page-locked allocator rounds every
# allocation up to a power of two, so a layer's buffer of its own takes up to twice its size (0.5
# GiB for an 8B layer's 0.41), where an allocation holding several wastes its tail only; at most
# this many, because packing fills an allocation before the layers' own storage is let go.
CHUNK_LAYERS = 16


def page_locked_chunks(sizes: Sequence[int]) -> list[int]:
    """How many consecutive layer buffers of ``sizes`` bytes each page-locked allocation holds:
    the split into runs of at most ``CHUNK_LAYERS`` whose allocations, each rounded up to a power
    of two, take the least memory (the cheapest path over the split points), fewer allocations
    where two splits take the same."""
    n = len(sizes)
    cost, take = [0] * (n + 1), [0] * (n + 1)  # from buffer i on: the least bytes, the first run's length
    for first in range(n - 1, -1, -1):
        run = 0
        for count in range(1, min(CHUNK_LAYERS, n - first) + 1):
            run += sizes[first + count - 1]
            total = _rounded(run) + cost[first + count]
            if count == 1 or total <= cost[first]:
                cost[first], take[first] = total, count
    counts, first = [], 0
    while first < n:
        counts.append(take[first])
        first += take[first]
    return counts


def page_locked_bytes(sizes: Sequence[int]) -> int:
    """What torch's page-locked allocator takes for layer buffers of ``sizes`` bytes (each a
    multiple of ``ALIGN``) as ``page_locked_chunks`` packs them."""
    total, first = 0, 0
    for count in page_locked_chunks(sizes):
        total += _rounded(sum(sizes[first:first + count]))
        first += count
    return total


def _rounded(size: int) -> int:
    """``size`` bytes as torch's page-locked allocator allocates them: the next power of two."""
    return 1 << (size - 1).bit_length() if size > 0 else 0


@dataclass
class _Packed:
    """One parameter of a layer: its place in the layer's buffers, and the modules that hold it."""

    param: nn.Parameter  # the layer's own, its values in the host buffer
    owners: list[tuple[nn.Module, str]]
    offset: int
    nbytes: int

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset:self.offset + self.nbytes].view(self.param.dtype).view(self.param.shape)

    def hold(self, param: nn.Parameter) -> None:
        """Its owners hold ``param`` (a slot's, or the layer's own again)."""
        for module, name in self.owners:
            module._parameters[name] = param


@dataclass(eq=False)
class _Slot:
    """A device buffer a layer's frozen values are copied into, and what it holds."""

    buffer: torch.Tensor
    content: int | None = None  # the layer whose values it holds
    copied: torch.cuda.Event | None = None  # its last copy, done (untimed: what the compute waits on)
    # the same moment as a timing event: the waits keep events without timing, which CUDA serves
    # fastest, and the record of the copies (Transfers) reads these
    copy_ended: torch.cuda.Event | None = None
    freed: torch.cuda.Event | None = None  # the compute on what it held (or on its memory before it), done
    params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # layer -> its parameters viewing it


@dataclass
class Transfers:
    """What a ``StreamedLayers`` copied and how long it took: the copies' own time (on a GPU from
    timing events around each copy on the copy stream, on a CPU the host's clock), and on a GPU
    how long the compute stream stood waiting for a copy (``stall_s``: from the moment it
    reached a layer to the end of that layer's copy, where the copy ended later). Where the
    stall is near zero the copies hide behind the compute; where ``copy_s`` nears a run's
    time the link sets it. Event pairs are read once both have run (``read``).

    On a GPU ``idle_entries`` counts the layer starts (of ``entries``) at which the compute
    stream had finished everything queued on it: the device stood idle until the host queued
    more, so there the host, not the kernels or the copies, set the pace. Where it is near
    ``entries`` the step is bound by its host work (Python, dispatch, hooks)."""

    cuda: bool
    copies: int = 0  # layers copied to the device
    waits: int = 0  # layers not fetched ahead of their call (on a GPU the compute waits for their copy)
    copied_bytes: int = 0
    entries: int = 0  # layers started from a slot
    idle_entries: int = 0  # of them, on a GPU: the compute stream had nothing left to run
    turn_kept: int = 0  # of them, layers that stayed on the device through a bottom turn (no copy)
    copy_s: float = 0.0
    stall_s: float = 0.0
    _pending: list = field(default_factory=list)  # (kind, start event, end event), not read yet

    # The most event pairs kept unread: past it the pairs that have run are read, so a long
    # run's list stays short (the host runs at most a step or so ahead of the device).
    PENDING = 512

    def timed(self, kind: str, start, end) -> None:
        self._pending.append((kind, start, end))
        if len(self._pending) > self.PENDING:
            self.read(wait=False)

    def read(self, wait: bool = True) -> None:
        """Add the pairs whose events have run (all of them with ``wait``, which waits for the device)."""
        left = []
        for kind, start, end in self._pending:
            if wait:
                end.synchronize()
                start.synchronize()
            elif not (start.query() and end.query()):
                left.append((kind, start, end))
                continue
            seconds = max(start.elapsed_time(end), 0.0) / 1000  # a copy done before the compute came: no stall
            if kind == "copy":
                self.copy_s += seconds
            else:
                self.stall_s += seconds
        self._pending = left

    def to_json(self) -> dict:
        self.read()
        return {"copies": self.copies, "waits": self.waits, "copied_gib": round(self.copied_bytes / 2**30, 3),
                "copy_s": round(self.copy_s, 6),
                "copy_gib_per_s": round(self.copied_bytes / 2**30 / self.copy_s, 2) if self.copy_s > 0 else None,
                "stall_s": round(self.stall_s, 6) if self.cuda else None, "entries": self.entries,
                "idle_entries": self.idle_entries if self.cuda else None, "turn_kept": self.turn_kept}


class StreamedLayers:
    """The frozen parameters ``layers`` alone hold (``streamed_parameters``) in host memory,
    each layer copied into one of ``slots`` device buffers just ahead of its forward (module
    docstring); trainable parameters (a LoRA adapter) and those shared with a module outside
    the layers (tied weights) stay where they are.

    While a layer runs its modules hold parameters that view its slot, and otherwise their own,
    whose values are in the host buffer; under autograd a layer keeps its slot until the next
    one starts, and layers 2 to ``turn_layers`` + 1 keep theirs from the backward to the next
    forward (module docstring)."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], device: torch.device | str, slots: int = 2,
                 turn_layers: int = 0):
        if slots < 2:
            raise ValueError(f"slots must be at least 2 (one running, one being filled); got {slots}")
        most = most_turn_layers(len(layers))
        if not 0 <= turn_layers <= most:
            raise ValueError(f"turn layers must be from 0 to {most} for {len(layers)} streamed layers (the forward "
                             f"gives their slots back before its top turn); got {turn_layers}")
        self.device = torch.device(device)
        self.layers = list(layers)
        self._cuda = self.device.type == "cuda"
        streamed = streamed_parameters(model, self.layers)
        self._packed = [self._pack(layer, streamed) for layer in self.layers]
        self._host = self._host_buffers(self._packed)
        self._width = max((buffer.numel() for buffer in self._host), default=0)
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._base = slots
        self._pool = [self._new_slot() for _ in range(slots)]  # the slots layers are fetched into
        self._turn = range(2, 2 + turn_layers)  # the layers kept on the device through the bottom turn
        self._kept: dict[int, _Slot] = {}  # layer -> its slot, kept from the backward for the next forward
        self._spare = 0  # slots past the base the forward fills ahead: kept layers' slots, given up as they ran
        self._fetched: dict[int, _Slot] = {}  # layer -> the slot holding it (copy issued, layer not run yet)
        self._running: dict[int, _Slot] = {}  # layer -> the slot it runs from (under autograd: ran last)
        self._last: int | None = None  # the layer that started last under autograd
        self._direction = 1  # +1: forward order; -1: the backward's recompute, last layer first
        self.transfers = Transfers(self._cuda)
        shared = _modules_in_several(self.layers)
        for index, layer in enumerate(self.layers):
            enter = self._enter_hook(index)
            layer.register_forward_pre_hook(enter)
            layer.register_forward_hook(self._leave_hook(index), always_call=True)
            # A checkpointed layer's recompute runs its forward without the layer's own hooks
            # (transformers checkpoints ``forward`` and keeps module hooks outside): dpocache's
            # checkpoint enters it first (``before``), and under any other checkpoint the first of
            # its children or of the modules holding its streamed weights to be called does.
            checkpointed = getattr(layer, "_gradient_checkpointing_func", None)
            if isinstance(checkpointed, LayerCheckpoint):
                # the children's hooks would be host work for nothing, and in a compiled layer
                # guards that tell a streamed layer from a resident one: a second graph each
                checkpointed.before = functools.partial(enter, layer, ())
                continue
            owners = [m for p in self._packed[index] for m, _ in p.owners]
            for key, module in {id(m): m for m in [*layer.children(), *owners]}.items():
                if module is not layer and key not in shared:
                    module.register_forward_pre_hook(enter)

    # --------------------------------------------------------------------- what it holds

    @property
    def copies(self) -> int:
        return self.transfers.copies

    @property
    def waits(self) -> int:
        return self.transfers.waits

    @property
    def _slots(self) -> list[torch.Tensor]:
        """Every device buffer a layer's values are in now: the slots and the kept layers'."""
        return [slot.buffer for slot in [*self._pool, *self._kept.values()]]

    def parameters(self) -> list[nn.Parameter]:
        """The layers' own streamed parameters, their values in host memory: what their modules
        hold between the layers' calls."""
        return [p.param for packed in self._packed for p in packed]

    @property
    def host_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._host)

    @property
    def slot_bytes(self) -> int:
        """The device memory the slots take through a step's peak (the kept layers' is taken below it)."""
        return self._base * self._width

    def to_json(self) -> dict:
        """What run.json and the build summary record: the layers' bytes on the host, the
        allocations holding them and, on a GPU, the page-locked memory those take (rounded); the
        slots' device memory and the layers kept through the bottom turn; the copies so far
        (``Transfers``: reading their times waits for the device)."""
        allocations = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in self._host}
        page_locked = sum(_rounded(size) for size in allocations.values()) if self._cuda else None
        return {"layers": len(self.layers), "slots": self._base,
                "host_gib": round(self.host_bytes / 2**30, 3), "host_allocations": len(allocations),
                "page_locked_gib": None if page_locked is None else round(page_locked / 2**30, 3),
                "device_gib": round(self.slot_bytes / 2**30, 3), "turn_layers": len(self._turn),
                "turn_gib": round(len(self._turn) * self._width / 2**30, 3), "transfers": self.transfers.to_json()}

    # --------------------------------------------------------------------- packing

    @staticmethod
    def _pack(layer: nn.Module, streamed: set[int]) -> list[_Packed]:
        packed: dict[int, _Packed] = {}
        offset = 0
        for module in layer.modules():
            for name, param in module._parameters.items():
                if param is None or id(param) not in streamed:
                    continue
                if id(param) in packed:  # shared within the layer: one place, several owners
                    packed[id(param)].owners.append((module, name))
                    continue
                if not param.is_contiguous():
                    raise ValueError(f"a streamed parameter must be contiguous; {name} of shape "
                                     f"{tuple(param.shape)} is not")
                nbytes = param.numel() * param.element_size()
                packed[id(param)] = _Packed(param, [(module, name)], offset, nbytes)
                offset += -(-nbytes // ALIGN) * ALIGN
        return list(packed.values())

    def _host_buffers(self, packed: list[list[_Packed]]) -> list[torch.Tensor]:
        """Each layer's values in one buffer, page-locked where a GPU copies from it, several
        layers' buffers to an allocation (``page_locked_chunks``); each parameter's own storage
        is let go as it moves in (the host holds both for one allocation's layers at most)."""
        sizes = [layer[-1].offset + layer[-1].nbytes if layer else 0 for layer in packed]
        aligned = [-(-size // ALIGN) * ALIGN for size in sizes]
        buffers, first = [], 0
        for count in page_locked_chunks(aligned):
            chunk = torch.empty(sum(aligned[first:first + count]), dtype=torch.uint8, pin_memory=self._cuda)
            offset = 0
            for index in range(first, first + count):
                buffer = chunk[offset:offset + sizes[index]]
                for p in packed[index]:
                    p.view(buffer).copy_(p.param.data)
                    p.param.data = p.view(buffer)
                buffers.append(buffer)
                offset += aligned[index]
            first += count
        return buffers

    def _new_slot(self) -> _Slot:
        """A device buffer for one layer. On a GPU from the compute stream's memory, so a slot
        given up returns to the activations; a copy into it waits for the compute that used
        that memory before (``freed``)."""
        slot = _Slot(torch.empty(self._width, dtype=torch.uint8, device=self.device))
        if self._cuda:
            slot.freed = torch.cuda.Event()
            slot.freed.record(torch.cuda.current_stream(self.device))
        return slot

    def _params(self, index: int, slot: _Slot) -> list[nn.Parameter]:
        """The parameters layer ``index``'s modules hold while it runs from ``slot``."""
        if index not in slot.params:
            slot.params[index] = [nn.Parameter(p.view(slot.buffer), requires_grad=False) for p in self._packed[index]]
        return slot.params[index]

    # --------------------------------------------------------------------- the hooks

    def _enter_hook(self, index: int):
        def enter(module, args):
            if index not in self._running:
                self._enter(index)
        return enter

    def _leave_hook(self, index: int):
        def leave(module, args, output):
            if not torch.is_grad_enabled():  # under autograd the layer's backward may still need its slot
                self._release(index, False)
        return leave

    def _enter(self, index: int) -> None:
        """Layer ``index`` starts: the layer still holding its slot gives it back (the one before
        under autograd, or one whose forward raised), ``index`` takes its own, and the layer
        that runs after it is fetched."""
        autograd = torch.is_grad_enabled()
        if autograd:
            self._turn_at(index)
        if index not in self._kept and index not in self._turn:  # past the kept layers: back down to the base
            self._spare = 0
        n = len(self.layers)
        # at an end under autograd the layer before runs next again: its slot is kept whatever the count
        again = index - self._direction if autograd and not 0 <= index + self._direction < n else None
        for other in list(self._running):
            self._release(other, autograd, again)
        self._hold(index)
        following = self._following(index, autograd)
        if following is not None and not any(following in held for held in (self._fetched, self._running, self._kept)):
            self._fetch(following)

    def _hold(self, index: int) -> None:
        """Point layer ``index``'s modules at its slot, once its copy is done: the slot it kept
        through the bottom turn (which then joins the slots, for the next copy ahead), or the
        one its copy went to."""
        slot = self._kept.get(index)
        if slot is None:
            if index not in self._fetched:  # not fetched ahead: the first layer of a pass, or one out of order
                self._fetch(index)
                self.transfers.waits += 1
            slot = self._fetched.pop(index)
        elif torch.is_grad_enabled():  # the forward after the turn (an evaluation leaves it where it waits)
            del self._kept[index]
            self._pool.append(slot)
            self._spare += 1
            self.transfers.turn_kept += 1
        self.transfers.entries += 1
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            # done with all it was given (a query, no wait): the device waited for the host here
            self.transfers.idle_entries += compute.query()
            if slot.copied is not None:
                reached = _timing_event(compute)
                compute.wait_event(slot.copied)
                self.transfers.timed("stall", reached, slot.copy_ended)
        for p, param in zip(self._packed[index], self._params(index, slot)):
            p.hold(param)
        self._running[index] = slot

    def _turn_at(self, index: int) -> None:
        """Under autograd: the order turns at each end (forward 0..L-1, the backward's
        recompute L-1..0, the next forward 0..L-1); ``index`` starting says which way it runs."""
        last, self._last = self._last, index
        if last is not None and index != last:
            self._direction = 1 if index > last else -1

    def _following(self, index: int, autograd: bool) -> int | None:
        """The layer to fetch while ``index`` runs. Without autograd the next, the first after the
        last. Under autograd the next in the current direction, and at an end the one before
        (the end layer itself runs again next, from the slot it holds); in a forward past the
        layers kept through the bottom turn and those fetched into their slots, the first
        that needs a copy."""
        n = len(self.layers)
        if not autograd:  # an evaluation between training steps leaves the autograd order as it was
            return (index + 1) % n if n > 1 else None
        following = index + self._direction
        if not 0 <= following < n:
            following = index - self._direction
        if self._direction > 0 and (self._kept or self._spare):
            while following < n and (following in self._kept or following in self._fetched):
                following += 1
            if following >= n or not self._free():
                return None
        return following if 0 <= following < n and following != index else None

    def _release(self, index: int, autograd: bool, again: int | None = None) -> None:
        """Layer ``index`` is done with its slot: in the backward one of the layers kept through
        the bottom turn keeps it (a new slot takes its place); a slot past the base and the kept
        layers' spares is given up, but for layer ``again``'s (a turn runs it next); any other
        waits for the next copy."""
        slot = self._running.pop(index, None)
        if slot is None:
            return
        if self._cuda:
            slot.freed = torch.cuda.Event()
            slot.freed.record(torch.cuda.current_stream(self.device))
        for p in self._packed[index]:
            p.hold(p.param)
        if self._kept.get(index) is slot:  # an evaluation ran it where it waits for the next forward
            return
        if autograd and self._direction < 0 and index in self._turn:
            self._pool.remove(slot)
            self._kept[index] = slot
            if len(self._pool) < self._base:  # a new slot takes its place among the base ones
                self._pool.append(self._new_slot())
        elif len(self._pool) > self._base + self._spare and index != again:
            self._pool.remove(slot)  # its memory back to the activations

    def _free(self) -> list[_Slot]:
        """The slots no running or fetched layer holds."""
        busy = {id(slot) for slot in [*self._running.values(), *self._fetched.values()]}
        return [slot for slot in self._pool if id(slot) not in busy]

    def _fetch(self, index: int) -> None:
        """Issue layer ``index``'s copy into a slot no running or fetched layer holds; none where
        such a slot holds its values still (a layer given back and fetched again at a turn)."""
        free = self._free()
        if not free:  # every slot holds a fetched layer that has not run (an interrupted pass)
            self._fetched.clear()
            free = self._free()
        kept = [slot for slot in free if slot.content == index]
        if kept:
            self._fetched[index] = kept[0]
            return
        slot = min(free, key=lambda s: s.content is not None)  # an empty slot first
        host = self._host[index]
        target = slot.buffer[:host.numel()]
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if slot.freed is not None:
                    self._copy_stream.wait_event(slot.freed)
                started = _timing_event(self._copy_stream)
                target.copy_(host, non_blocking=True)
                # The slot is freed on the compute stream; this copy may still be writing to it then.
                target.record_stream(self._copy_stream)
                slot.copied = torch.cuda.Event()
                slot.copied.record(self._copy_stream)
                slot.copy_ended = _timing_event(self._copy_stream)
            self.transfers.timed("copy", started, slot.copy_ended)
        else:
            started = time.perf_counter()
            target.copy_(host)
            self.transfers.copy_s += time.perf_counter() - started
        slot.content = index
        self._fetched[index] = slot
        self.transfers.copies += 1
        self.transfers.copied_bytes += host.numel()


def _timing_event(stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` now, with timing (``Transfers``)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def most_turn_layers(streamed: int) -> int:
    """The most ``turn_layers`` for ``streamed`` layers: the forward fetches one copy ahead per
    kept layer it runs, and gives those slots back one a layer after the kept ones, so with
    2N + 3 streamed layers or more it is back to two slots before its top turn (the step's
    peak)."""
    return max((streamed - 3) // 2, 0)


def spread_resident(layers: int, resident: int) -> list[int]:
    """The indices of ``resident`` of ``layers`` decoder layers that stay on the device while the
    others stream (``--resident-layers``), spread evenly and never the first: while a resident
    layer runs, the copy of the streamed layer after it has that layer's compute to hide behind
    too. ``ValueError`` unless 0 <= ``resident`` < ``layers``."""
    if not 0 <= resident < layers:
        raise ValueError(f"resident layers must be from 0 to {layers - 1} of {layers}; got {resident}")
    return [int((k + 1) * layers / (resident + 1)) for k in range(resident)]


def check_streamed_layers(model_path: str | Path, resident: int, turn: int = 0) -> None:
    """``--resident-layers`` and ``--turn-layers`` against the decoder layers of the model at
    ``model_path`` (its config's ``num_hidden_layers``; a PEFT adapter directory's base), before
    any model loads: at least one layer must stream, and the layers kept through the bottom turn
    must be few enough for the forward to give their slots back before its top turn
    (``most_turn_layers``). ``ConfigError`` naming the flag otherwise."""
    layers = model_layers(model_path) if resident or turn else None
    if layers is None:
        return
    if resident >= layers:
        raise ConfigError(f"{flag_name('model.resident_layers')} {resident}: the model has {layers} decoder layers, "
                          "and at least one must stream; pass fewer, or --stream-base false to keep them all")
    most = most_turn_layers(layers - resident)
    if turn > most:
        raise ConfigError(f"{flag_name('model.turn_layers')} {turn}: at most {most} for {layers - resident} streamed "
                          "layers (the forward gives their slots back before its top turn, the step's peak)")


def _modules_in_several(layers: Sequence[nn.Module]) -> set[int]:
    """The ids of modules found in more than one of ``layers`` (calling one says nothing of
    which layer runs)."""
    seen: dict[int, int] = {}
    for layer in layers:
        for module in {id(m) for m in layer.modules()}:
            seen[module] = seen.get(module, 0) + 1
    return {module for module, count in seen.items() if count > 1}


def outside_parameters(model: nn.Module, layers: Sequence[nn.Module]) -> set[int]:
    """The ids of ``model``'s parameters held by a module outside ``layers`` (embeddings, final
    norm, head)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}


def streamed_parameters(model: nn.Module, layers: Sequence[nn.Module]) -> set[int]:
    """The ids of the parameters that stream: frozen, and held by one of ``layers`` alone (a
    weight a layer shares with the embeddings or with another layer stays resident, and so does
    a trainable adapter, which its optimizer updates on the device)."""
    outside = outside_parameters(model, layers)
    count: dict[int, int] = {}
    for layer in layers:
        for p in layer.parameters():
            if not p.requires_grad and id(p) not in outside:
                count[id(p)] = count.get(id(p), 0) + 1
    return {param for param, n in count.items() if n == 1}


def move_resident_(model: nn.Module, layers: Sequence[nn.Module], device: torch.device | str) -> None:
    """Move ``model`` to ``device`` except the parameters that stream (``streamed_parameters``):
    they stay on the host for ``StreamedLayers`` (the whole model never passes through device
    memory)."""
    streamed = streamed_parameters(model, layers)
    moved: dict[int, nn.Parameter] = {}  # a tied parameter is moved once and stays one parameter
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or id(param) in streamed:
                continue
            if id(param) not in moved:
                moved[id(param)] = _moved(param, device)
            module._parameters[name] = moved[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _moved(param: nn.Parameter, device: torch.device | str) -> nn.Parameter:
    """``param`` on ``device``: the same parameter where its tensor type allows (as
    ``nn.Module.to`` does), else a new one (the meta device)."""
    data = param.data.to(device)
    if torch._has_compatible_shallow_copy_type(param.data, data):
        param.data = data
        return param
    return nn.Parameter(data, requires_grad=param.requires_grad)
