"""The one block-by-block calibration driver, shared by every data-dependent method so that none of them
re-implements capture, propagation, resume or memory release (docs/quantize.md).

    capture block-0 inputs -> for each block i:
        collect the statistics the method declares (Hessians, FP targets),
        call the method's pure per-block function -> {name: QuantizedWeight},
        write the dequantized weights into the block, checkpoint block i,
        propagate the compressed block's outputs as the inputs of block i+1

Methods declare what they need (`BlockQuantizer.needs_hessian`, `.needs_fp_targets`, and
`.needs_head` for an objective through the frozen LM head on the last block, which then gets no
Hessians: it is tuned through the head); the driver never branches on a method's class. A block whose
checkpoint exists (resume) is loaded instead of recomputed, and its outputs are recomputed by a forward pass, so a resumed run is bit-identical
to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from torch import nn

from compress.errors import RunFailure
from compress.hessian import gram_store
from compress.models.adapters import accepts_use_cache
from compress.qweight import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixedSpec:
    """A layer's per-chunk options from an allocation plan (docs/quantize.md#allocation-plans-mixed-precision):
    `options[j] = (bits, treatment)` of input columns [j*chunk_size, (j+1)*chunk_size); bits 16 keeps the
    chunk in fp16. `energy` (d_in,) is E[x^2] per input column (weights the clip search), or None."""

    chunk_size: int
    options: tuple[tuple[int, str], ...]
    map_bits: int
    energy: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerSpec:
    bits: int
    group_size: int
    sym: bool
    mixed: MixedSpec | None = None  # per-chunk bit widths from an `allocate` stage
    asked: int | None = None  # the recipe's group_size when the plan adapted it to this layer (`fit_group`)
    ggml: str | None = None  # a llama.cpp type to round onto (`gguf`: compress/quantize/ggml_grid.py)
    fp: str | None = None  # a float element format to round onto (`scheme: fp8`: compress/quantize/floatgrid.py)


@dataclass
class BlockData:
    """Everything a per-block method may read. `inputs`/`kwargs`/`fp_targets` are per calibration batch."""

    index: int
    block: nn.Module
    linears: dict[str, nn.Linear]
    specs: dict[str, LayerSpec]
    inputs: list[torch.Tensor]
    kwargs: list[dict]
    fp_targets: list[torch.Tensor] | None = None
    fp_inputs: list[torch.Tensor] | None = None
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)
    seed: int = 0
    head: Callable[[torch.Tensor], torch.Tensor] | None = None  # last block only, for methods that need it
    tokens: list[torch.Tensor] | None = None  # the calibration token batches behind `inputs`


class BlockQuantizer(Protocol):
    needs_hessian: bool
    needs_fp_targets: bool
    needs_data: bool
    needs_head: bool
    batch_size: int

    def quantize_block(self, data: BlockData) -> dict[str, QuantizedWeight]: ...


class _Stop(Exception):
    pass


class DeviceMemoryError(RunFailure):
    """The device ran out of memory on a block: which one, its size, and what to lower (the finished blocks are
    checkpointed: `--resume` continues from this one)."""

    def __init__(self, i: int, block: nn.Module, device: torch.device, quantizer, e: BaseException):
        mb = sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20
        super().__init__(
            f"{device} ran out of memory on block {i} ({mb:.0f} MB of weights, calibration batches of "
            f"{getattr(quantizer, 'batch_size', '?')}): lower the stage's `batch_size` or `calibration.nsamples` "
            f"(or use `device: cpu`), then rerun with --resume to continue from block {i}; torch said: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")


def capture_block0_inputs(model: nn.Module, block0: nn.Module, tokens: torch.Tensor, batch_size: int):
    """Hidden states and keyword arguments that block 0 receives, one entry per batch of `tokens`."""
    inputs, kwargs = [], []

    def hook(_mod, args, kw):
        hs = args[0] if args else kw.pop("hidden_states")
        inputs.append(hs.detach())
        kwargs.append({k: v for k, v in kw.items() if k not in ("past_key_values", "cache", "past_key_value")})
        raise _Stop

    h = block0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for b in tokens.split(batch_size):
                try:
                    model(input_ids=b, use_cache=False) if accepts_use_cache(model) else model(input_ids=b)
                except _Stop:
                    pass
    finally:
        h.remove()
    return inputs, kwargs


def block_forward(block: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
    out = block(x, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def propagate(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    return [block_forward(block, x, kw) for x, kw in zip(inputs, kwargs)]


@torch.no_grad()
def advance(block: nn.Module, acts: list[torch.Tensor], kwargs: list[dict]) -> None:
    """`propagate` in place: each batch is replaced by the block's output, so the calibration activations
    exist once (plus one batch), not as inputs and outputs side by side."""
    for j, kw in enumerate(kwargs):
        acts[j] = block_forward(block, acts[j], kw)


@torch.no_grad()
def _forward_only(block: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict]) -> None:
    """Run the block for its hooks; the outputs are dropped batch by batch."""
    for x, kw in zip(inputs, kwargs):
        block_forward(block, x, kw)


@torch.no_grad()
def collect_hessians(block, linears: dict[str, nn.Linear], inputs, kwargs, cover=None, devices=None) -> dict:
    """H = 2/n * sum x x^T over every calibration row reaching each linear (docs/quantize.md#gptq), accumulated
    in fp32 as the GPTQ reference does, in a `compress.hessian` store (on the CPU: the packed upper triangle).
    Linears fed the same tensor (q/k/v, gate/up) share one Hessian: the returned dict then maps their names to
    the same store object. `cover` (MoE blocks, compress.models.moe.Coverage)
    adds forced rows for the experts that too few rows reached.

    `devices` (several): data parallel. The batches are split into one contiguous shard per device, each device
    runs a replica of the block on its shard, and the unscaled sums and row counts are added on the first device
    (what an all-reduce computes) before the one scaling: the same H as one device up to fp32 summation order.
    MoE blocks (`cover`: forced routing needs every row's counts) collect on the first device alone."""
    for share in (True, False):  # not shared: a linear's input was not always its group's; collect again
        if devices is not None and len(devices) > 1 and cover is None and len(inputs) > 1:
            got = _split(block, linears, inputs, kwargs, devices, share)
        else:
            got = _accumulate(block, linears, inputs, kwargs, cover, share=share)
        if got is not None:
            break
    H, count, leader = got
    for n, h in H.items():
        h.scale_(1 / max(count[n], 1))
    return {n: H[leader[n]] if n in leader else gram_store(m.in_features, m.weight.device) for n, m in linears.items()}


def _split(block, linears, inputs, kwargs, devices, share: bool):
    """`_accumulate` per device on its shard of the batches (a replica of the block on each other device), the
    sums and counts added into the first shard's: (H, count, leader) unscaled, or None if a shard's sharing broke."""
    import copy

    from compress.models.devices import move

    rel = {id(m): p for p, m in block.named_modules()}
    shards = [idx for idx in torch.arange(len(inputs), device="cpu").tensor_split(len(devices)) if len(idx)]

    # the replicas are copied before any shard runs: a copy made while another shard's hooks are on the block
    # would carry them (the first device holds the block itself)
    replicas = [block] + [copy.deepcopy(block).to(d) for d in devices[1:len(shards)]]

    def shard(k: int):
        d, idx, replica = devices[k], shards[k], replicas[k]
        lin = {n: replica.get_submodule(rel[id(m)]) for n, m in linears.items()}
        with torch.no_grad():  # grad mode is per thread
            return _accumulate(replica, lin, move([inputs[j] for j in idx], d), move([kwargs[j] for j in idx], d),
                               None, share)

    if _parallel(devices):  # one thread per device: torch releases the GIL while each device computes
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(shards)) as pool:
            parts = list(pool.map(shard, range(len(shards))))
    else:
        parts = [shard(k) for k in range(len(shards))]
    if any(p is None for p in parts):
        return None
    H, count, leader = parts[0]
    for h, c, lead in parts[1:]:
        if lead != leader:  # the same block shares its inputs the same way on every shard
            return None
        for n in H:
            H[n].add_(h[n])
        for n in count:
            count[n] += c[n]
    return H, count, leader


def _parallel(devices: list[torch.device]) -> bool:
    """Whether the Hessian shards run at once (distinct accelerators; CPU "devices" share the same cores)."""
    return all(d.type != "cpu" for d in devices) and len(set(devices)) == len(devices)


def _away(device: torch.device) -> bool:
    """Whether blocks move to `device` for their work (tests force it on the CPU to run that path)."""
    return device.type != "cpu"


def _accumulate(block, linears, inputs, kwargs, cover, share: bool):
    """One propagation with a hook per linear: (H, count, leader), the unscaled sums of the leaders (the linears
    whose input the others share), the rows each linear saw and each linear's leader. With `share`, a linear
    whose input is the very tensor another linear's hook last saw (a weak reference: identity, never a freed
    tensor's address, at the same version) adds nothing of its own; it must then see its leader's input on
    every call and as many rows, else None (the caller collects again)."""
    H: dict[str, torch.Tensor] = {}
    count = {n: 0 for n in linears}
    leader: dict[str, str] = {}
    last: dict[str, tuple[weakref.ref, int]] = {}  # leader -> its latest input and that input's version
    broken = False

    def make_hook(name):
        def hook(_m, args, _out):
            nonlocal broken
            x = args[0]
            count[name] += x.numel() // x.shape[-1]
            if name not in leader:
                leader[name] = next((n for n, (r, v) in last.items() if r() is x and x._version == v), name) \
                    if share else name
                if leader[name] == name:
                    H[name] = gram_store(x.shape[-1], x.device)
            lead = leader[name]
            if lead != name:
                ref, version = last[lead]
                broken |= ref() is not x or x._version != version  # not the same tensor, or changed in place
                return
            if share:
                last[name] = (weakref.ref(x), x._version)
            H[name].add_gram_(x.reshape(-1, x.shape[-1]), 2)  # in place: no (d_in, d_in) temporary

        return hook

    handles = [m.register_forward_hook(make_hook(n)) for n, m in linears.items()]
    try:
        if cover is None:
            _forward_only(block, inputs, kwargs)
        else:
            with cover:
                _forward_only(block, inputs, kwargs)
            if forced := cover.finish(count):
                log.warning("block %d: experts %s received fewer than %d calibration rows; their statistics use "
                            "the rows their router scores highest (forced routing)", cover.i, forced, cover.min_tokens)
    finally:
        for h in handles:
            h.remove()
    if broken or any(count[n] != count[lead] for n, lead in leader.items()):
        return None
    return H, count, leader


def set_weight(linear: nn.Linear, qw: QuantizedWeight) -> None:
    with torch.no_grad():
        qw.dequantize(out=linear.weight.data)  # row chunks straight into the weight: no copy of its size


def light(qw: QuantizedWeight) -> QuantizedWeight:
    """The same QuantizedWeight without its codes (a zero-size view of the right shape)."""
    codes = torch.zeros((), dtype=torch.uint8).expand(qw.out_features, qw.in_features)
    return dataclasses.replace(qw, codes=codes)


def run_blockwise(
    *,
    model: nn.Module,
    blocks: nn.ModuleList,
    block_linears: Callable[[int], dict[str, nn.Linear]],
    specs: Callable[[str, nn.Linear], LayerSpec | None],
    quantizer: BlockQuantizer,
    tokens: torch.Tensor | None,
    load_block: Callable[[int], dict[str, QuantizedWeight] | None],
    save_block: Callable[[int, dict[str, QuantizedWeight]], None],
    seed: int = 0,
    progress: Callable | None = None,
    materialize: Callable[[int], None] | None = None,
    release: Callable[[int], None] | None = None,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    cover: Callable[[int], object] | None = None,
    devices: list[torch.device] | None = None,
) -> dict[str, QuantizedWeight]:
    """Quantize every block in order; returns all QuantizedWeights by module name.

    With `materialize`/`release` (streaming), block i is read just before it is used and dropped
    after its outputs are propagated; the returned QuantizedWeights then keep only their scales and
    zero points (`light`), the codes stay in the block checkpoints. `head` (final norm + LM head) is
    handed to the last block only. `cover(i)`: block i's MoE coverage for the Hessians (or None).
    `devices` (docs/accelerators.md): the first is where each block, the calibration activations and the head
    live while the block is worked on (the model stays where it is; the block goes back after); several split
    the Hessians' batches (`collect_hessians`). The QuantizedWeights come back on the CPU.
    """
    from compress.models.devices import move, out_of_memory

    device = devices[0] if devices else torch.device("cpu")
    away = _away(device)  # on the CPU nothing moves: the run is the one it always was
    result: dict[str, QuantizedWeight] = {}
    q_in = kw = fp_in = None
    if quantizer.needs_data:
        q_in, kw = capture_block0_inputs(model, blocks[0], tokens, quantizer.batch_size)
        if away:
            q_in, kw = move(q_in, device), move(kw, device)
        fp_in = list(q_in) if quantizer.needs_fp_targets else None
    n = len(blocks)
    batches = list(tokens.split(quantizer.batch_size)) if tokens is not None else None
    if away and batches is not None:
        batches = move(batches, device)
    for i in range(n):
        block = blocks[i]
        if materialize:
            materialize(i)
        last_head = head if i == n - 1 else None
        if away:
            block.to(device)
            if last_head is not None:
                last_head.to(device)
        linears = {name: m for name, m in block_linears(i).items() if specs(name, m) is not None}
        try:
            fp_out = propagate(block, fp_in, kw) if fp_in is not None else None
            done = load_block(i)
            if done is None:
                data = BlockData(i, block, linears, {nm: specs(nm, m) for nm, m in linears.items()},
                                 q_in or [], kw or [], fp_out, fp_in, seed=seed * 1000 + i,
                                 head=last_head, tokens=batches)
                if quantizer.needs_hessian and data.head is None:  # a block handed the head is tuned through it
                    data.hessians = collect_hessians(block, linears, q_in, kw, cover(i) if cover else None,
                                                     devices=devices)
                done = quantizer.quantize_block(data)
                for name, qw in done.items():
                    set_weight(linears[name], qw)
                if away:
                    done = move(done, torch.device("cpu"))
                save_block(i, done)
            else:
                for name, qw in done.items():
                    set_weight(linears[name], move(qw, device) if away else qw)
            if q_in is not None and i + 1 < n:
                advance(block, q_in, kw)
        except Exception as e:
            if away and out_of_memory(e):
                raise DeviceMemoryError(i, block, device, quantizer, e) from e
            raise
        finally:
            if away:
                block.to("cpu")
                if last_head is not None:
                    last_head.to("cpu")
        fp_in = fp_out
        if release:  # the codes are in the block checkpoint: drop them, then the block (its release collects)
            done = {name: light(qw) for name, qw in done.items()}
            release(i)
        else:
            gc.collect()
        result.update(done)
        if progress:
            progress(i + 1, n)
    return result
