"""A frozen reference's decoder layers kept in host memory and copied to the device one layer
ahead of the layer that runs (``--stream-reference``): the device holds the embeddings, the
final norm, the head and two layers' weights instead of the whole model.

Why: a reference pass needs each layer's weights once per forward, and a forward over a token
budget of thousands of tokens can compute on a layer for longer than a PCIe link takes to bring
the next one in, so the copies can hide behind the compute (docs/memory.md has the arithmetic
for an 8B model). An 8B Llama's 32 layers are 13.0 GiB of its 15.0 GiB in bf16; streamed, they
take two slots of 0.41 GiB on the device. verl
(``ref.fsdp_config.param_offload``) and OpenRLHF (``--ref_reward_offload``) offload the
reference too, through FSDP's or DeepSpeed's CPU offload, which are built for training (sharded
optimizer steps on the host, collectives); a frozen reference in one process needs neither,
only the copies, so they are done here.

How: each layer's parameters are packed into one page-locked host buffer (one large copy per
layer: PCIe moves large copies at full speed). Before layer ``i`` runs, the compute stream waits
for ``i``'s copy and the layer's parameters are pointed at its slot; then ``i + 1``'s copy is
issued on a side stream into the other slot, after the compute stream is done with the slot's
last user (``i - 1``). After the layer its parameters point back at the host buffer, so between
forwards the model's parameters hold its values wherever they are read. The last layer fetches
the first for the next forward. On a CPU the "device" slots are host tensors and the copies
synchronous: it runs the same bookkeeping, which is what the tests check there.

Inference only (no autograd through the swapped parameters), and eager only: a compiled layer
would trace the hooks (``--compile on`` is refused with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

ALIGN = 256  # bytes: each parameter starts on a boundary its dtype (and any vector load) accepts


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


class StreamedLayers:
    """``layers``' parameters in host memory, each layer copied into one of ``slots`` device
    buffers just ahead of its forward (module docstring). ``resident``: the ids of parameters
    that stay where they are (shared with a module outside the layers, such as tied weights).

    While a layer runs its modules hold parameters that view its slot; after it, their own
    again, whose values are in the host buffer: between forwards ``model.parameters()`` are the
    model's, on the host."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str, slots: int = 2,
                 resident: set[int] = frozenset()):
        if slots < 2:
            raise ValueError(f"slots must be at least 2 (one running, one being filled); got {slots}")
        self.device = torch.device(device)
        self.layers = list(layers)
        self._cuda = self.device.type == "cuda"
        self._packed = [self._pack(layer, resident) for layer in self.layers]
        self._host = [self._host_buffer(packed) for packed in self._packed]
        width = max((buffer.numel() for buffer in self._host), default=0)
        self._slots = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        # [layer][slot]: the parameters a layer's modules hold while it runs from that slot
        self._slot_params = [[[nn.Parameter(p.view(slot), requires_grad=False) for p in packed]
                              for slot in self._slots] for packed in self._packed]
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._copied: list[torch.cuda.Event | None] = [None] * slots  # the slot's last copy, done
        self._freed: list[torch.cuda.Event | None] = [None] * slots  # the compute on the slot's last layer, done
        self._fetched: dict[int, int] = {}  # layer -> slot holding it (copy issued, layer not run yet)
        self._running: dict[int, int] = {}  # layer -> slot it runs from
        self.copies = 0  # layers copied to the device so far
        self._handles = []
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(layer.register_forward_hook(self._post_hook(index), always_call=True))

    # --------------------------------------------------------------------- what it holds

    @property
    def host_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._host)

    @property
    def slot_bytes(self) -> int:
        return sum(slot.numel() for slot in self._slots)

    def to_json(self) -> dict:
        return {"layers": len(self.layers), "slots": len(self._slots),
                "host_gib": round(self.host_bytes / 2**30, 3), "device_gib": round(self.slot_bytes / 2**30, 3)}

    def remove(self) -> None:
        """Take the hooks off; the parameters stay in host memory."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --------------------------------------------------------------------- packing

    @staticmethod
    def _pack(layer: nn.Module, resident: set[int]) -> list[_Packed]:
        packed: dict[int, _Packed] = {}
        offset = 0
        for module in layer.modules():
            for name, param in module._parameters.items():
                if param is None or id(param) in resident:
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

    def _host_buffer(self, packed: list[_Packed]) -> torch.Tensor:
        """The layer's values in one buffer, page-locked where a GPU copies from it; each
        parameter's own storage is released as it moves in (the host never holds both whole)."""
        size = packed[-1].offset + packed[-1].nbytes if packed else 0
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
        for p in packed:
            p.view(buffer).copy_(p.param.data)
            p.param.data = p.view(buffer)
        return buffer

    # --------------------------------------------------------------------- the hooks

    def _pre_hook(self, index: int):
        def before(module, args):
            self._release_running()  # a layer whose forward raised before its post-hook ran
            if index not in self._fetched:  # the first forward's first layer, or a layer called out of order
                self._fetch(index)
            slot = self._fetched.pop(index)
            if self._copied[slot] is not None:
                torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
            for p, param in zip(self._packed[index], self._slot_params[index][slot]):
                p.hold(param)
            self._running[index] = slot
            following = (index + 1) % len(self.layers)
            if following not in self._fetched and following != index:
                self._fetch(following)
        return before

    def _post_hook(self, index: int):
        def after(module, args, output):
            self._release(index)
        return after

    def _release(self, index: int) -> None:
        slot = self._running.pop(index, None)
        if slot is None:
            return
        if self._cuda:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            self._freed[slot] = freed
        for p in self._packed[index]:
            p.hold(p.param)

    def _release_running(self) -> None:
        for index in list(self._running):
            self._release(index)

    def _fetch(self, index: int) -> None:
        """Issue layer ``index``'s copy into a slot no running or fetched layer holds."""
        busy = set(self._running.values()) | set(self._fetched.values())
        free = [s for s in range(len(self._slots)) if s not in busy]
        if not free:  # every slot holds a fetched layer that has not run (an interrupted forward)
            self._fetched.clear()
            free = [s for s in range(len(self._slots)) if s not in set(self._running.values())]
        slot = free[0]
        host = self._host[index]
        target = self._slots[slot][:host.numel()]
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if self._freed[slot] is not None:
                    self._copy_stream.wait_event(self._freed[slot])
                target.copy_(host, non_blocking=True)
                # The slot is freed on the compute stream; this copy may still be writing to it then.
                target.record_stream(self._copy_stream)
                copied = torch.cuda.Event()
                copied.record(self._copy_stream)
            self._copied[slot] = copied
        else:
            target.copy_(host)
        self._fetched[index] = slot
        self.copies += 1


def outside_parameters(model: nn.Module, layers: Sequence[nn.Module]) -> set[int]:
    """The ids of ``model``'s parameters held by a module outside ``layers`` (embeddings, final
    norm, head; a weight a layer shares with them stays resident)."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return {id(p) for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)}


def move_all_but_layers_(model: nn.Module, layers: Sequence[nn.Module], device: torch.device | str) -> None:
    """Move ``model`` to ``device`` except the parameters only ``layers`` hold: they stay on the
    host for ``StreamedLayers`` (the whole model never passes through device memory)."""
    streamed = {id(p) for layer in layers for p in layer.parameters()} - outside_parameters(model, layers)
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

