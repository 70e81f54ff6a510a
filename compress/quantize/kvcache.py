"""KV-cache quantization (`kv_cache:` on a quantize stage with a `scheme`; docs/formats.md#quantized-kv-cache): the
keys (after RoPE) and values each attention layer writes to its cache, quantized as the server stores them, so the
run's evaluation computes what is served.

Elements: `fp8` (E4M3, the only KV type vLLM takes from a compressed-tensors checkpoint), `int8` or `int4`
(symmetric). Scales (`kv_scales`):
- `tensor`: one static scale for K and one for V per attention layer, `s = max|K| / half` over the calibration text
  (half: 448 for E4M3, 127.5 / 7.5 for int8 / int4: compressed-tensors' `calculate_range`), rounded to the export
  dtype; stored as the attention's `k_scale` / `v_scale` (shape (1,)), `kv_cache_scheme` strategy `tensor`: what
  vLLM reads and llm-compressor writes;
- `head`: one static scale per KV head (`k_scale` (kv_heads, 1, 1), strategy `attn_head`);
- `dynamic`: a scale per token and KV head computed at run time from its own head_dim values (strategy `group`,
  group_size head_dim, dynamic): the KV4 of the W4A4KV4 studies (QuaRot, InfoQuant), symmetric here; no scales stored.

Each element: `clamp(round(x / s), lo, hi) s` (int) or `E4M3(clamp(x / s, -448, 448)) s`, compressed-tensors'
`fake_quantize` (the shared rounding of activations.py). The hook is compressed-tensors' own mechanism: a forward
pre-hook on the attention module swaps the cache argument for a wrapper whose `update(k, v, ...)` quantizes the
states, then hands them to the real cache (or returns them, without one), so every attention implementation and
cache type is covered, and the current token's K/V are quantized too, as a server reading its cache computes.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from compress.quantize.activations import ActivationSpec, round_to

KV_TYPES = {"fp8": ActivationSpec(type="float"), "int8": ActivationSpec(), "int4": ActivationSpec(bits=4)}
STRATEGIES = {"tensor": "tensor", "head": "attn_head", "dynamic": "group"}


@dataclass
class KVCache:
    """A run's KV-cache setting and its attention modules: {name: (k_scale, v_scale)}, static scales float32 values of
    the export dtype, shape (1,) (`tensor`) or (kv_heads, 1, 1) (`head`); (None, None) while not calibrated and for
    `dynamic`."""

    type: str  # fp8 | int8 | int4
    scales: str = "tensor"  # tensor | head | dynamic
    head_dim: int = 0
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def grid(self) -> ActivationSpec:
        return replace(KV_TYPES[self.type], dynamic=self.scales == "dynamic")

    def as_compressed_tensors(self) -> dict:
        """The `kv_cache_scheme` of the checkpoint's quantization_config."""
        g = self.grid
        out = {"num_bits": g.bits, "type": g.type, "symmetric": True, "strategy": STRATEGIES[self.scales],
               "dynamic": self.scales == "dynamic"}
        return {**out, "group_size": self.head_dim} if self.scales == "dynamic" else out

    def describe(self) -> str:
        what = {"tensor": "one static scale per layer for K and for V", "head": "static scales per KV head",
                "dynamic": "a scale per token and KV head, computed at run time"}[self.scales]
        return f"{self.type} keys (after RoPE) and values, {what}"


def attention_modules(adapter) -> list[str]:
    """The attention module of every block (the parent of its `o` projection): those whose forward takes the cache
    argument (`cache`, or `past_key_values` before transformers 5.2x). Raises ValueError for an architecture whose
    cache is not plain keys and values (DeepSeek's latent attention) or without a KV cache (encoders)."""
    if adapter.arch.kind != "causal" or "kv_a" in adapter.arch.roles:
        raise ValueError(f"`kv_cache` quantizes a decoder's per-head keys and values; the `{adapter.model_type}` "
                         "attention caches " + ("a compressed latent" if "kv_a" in adapter.arch.roles else "nothing"))
    names = []
    for i in range(len(adapter.blocks)):
        o = adapter.arch.roles["o"]
        name = f"{adapter.block_name(i)}.{o.rsplit('.', 1)[0]}"
        if _cache_argument(adapter.model.get_submodule(name)) is None:
            raise ValueError(f"`{name}` ({type(adapter.model.get_submodule(name)).__name__}) takes no cache argument: "
                             "its keys and values cannot be hooked")
        names.append(name)
    return names


def _cache_argument(module: nn.Module) -> str | None:
    params = inspect.signature(module.forward).parameters
    return next((k for k in ("cache", "past_key_values", "past_key_value") if k in params), None)


def fake_quant(x: torch.Tensor, grid: ActivationSpec, scale: torch.Tensor | None) -> torch.Tensor:
    """`x` (batch, kv_heads, seq, head_dim) quantized and dequantized: with the static `scale` ((1,) or (kv_heads, 1,
    1)), or per token and head (dynamic, `scale` None)."""
    s = x.abs().amax(-1, keepdim=True) / grid.half if scale is None else scale.to(x.dtype)
    return round_to(x, s, grid)


class _QuantizingCache:
    """Stands for the attention's cache argument: quantizes the states `update` is given, then passes them on."""

    def __init__(self, inner, quant):
        self._inner, self._quant = inner, quant

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = self._quant(key_states, value_states)
        return self._inner.update(k, v, *args, **kwargs) if self._inner is not None else (k, v)

    def __getattr__(self, name):  # anything else the model reads from its cache (lengths, sliding windows)
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def attach(model: nn.Module, names: list[str], quant) -> list:
    """Route the keys and values of each named attention module through `quant(name, k, v) -> (k, v)` before its
    cache (and its attention) sees them; returns the hooks' handles."""
    def pre_hook(name, arg):
        def hook(_m, args, kwargs):
            kwargs[arg] = _QuantizingCache(kwargs.get(arg), lambda k, v: quant(name, k, v))
            return args, kwargs
        return hook

    handles = []
    for name in names:
        m = model.get_submodule(name)
        handles.append(m.register_forward_pre_hook(pre_hook(name, _cache_argument(m)), with_kwargs=True))
    return handles


@contextmanager
def hooked(model: nn.Module, names: list[str], quant):
    """`attach` while inside."""
    handles = []
    try:
        handles = attach(model, names, quant)
        yield
    finally:
        for h in handles:
            h.remove()


def _quant(kv: KVCache):
    grid = kv.grid
    if kv.scales != "dynamic" and any(k is None for k, _ in kv.layers.values()):
        raise ValueError("the KV cache's static scales are not calibrated")

    def quant(name, k, v):
        ks, vs = kv.layers[name]
        return fake_quant(k, grid, ks), fake_quant(v, grid, vs)
    return quant


@contextmanager
def quantized_kv(model: nn.Module, kv: KVCache | None):
    """While inside: `model` computes with its KV cache quantized as `kv` says (nothing without one)."""
    if kv is None:
        yield
        return
    with hooked(model, list(kv.layers), _quant(kv)):
        yield


def from_checkpoint(model: nn.Module, directory) -> str | None:
    """Make `model`, transformers' load of the compressed-tensors checkpoint in `directory`, compute with the KV cache
    its `kv_cache_scheme` names. The compressed-tensors library does it itself where it recognises the attention
    (transformers < 5.20: the `past_key_values` argument; 0.20.1 does not hook the `cache` argument transformers 5.2x
    renamed it to, and then drops the scales unread); otherwise compress attaches its own hooks with the stored
    scales. Returns who applies it ("compressed-tensors", "compress"), None without a KV scheme."""
    import json
    from pathlib import Path

    from compress.models.adapters import ModelAdapter

    config = Path(directory) / "config.json"
    qc = (json.loads(config.read_text()).get("quantization_config") or {}) if config.is_file() else {}
    scheme = qc.get("kv_cache_scheme") if isinstance(qc, dict) else None
    if not scheme:
        return None
    names = attention_modules(ModelAdapter(model))
    if all(hasattr(model.get_submodule(n), "kv_cache") for n in names):
        return "compressed-tensors"
    from compress.export.hf import load_tensors

    scales = {v: k for k, v in STRATEGIES.items()}.get(scheme.get("strategy"))
    typ = "fp8" if scheme.get("type") == "float" else f"int{scheme.get('num_bits')}"
    if typ not in KV_TYPES or scales is None or not scheme.get("symmetric", True) or \
            (scales == "dynamic") != bool(scheme.get("dynamic")):
        raise ValueError(f"kv_cache_scheme {scheme} is not one compress computes")
    tensors = load_tensors(Path(directory)) if scales != "dynamic" else {}
    stored = {n: tuple(None if (t := tensors.get(f"{n}.{p}_scale")) is None else t.float() for p in "kv")
              for n in names}
    kv = KVCache(typ, scales, int(scheme.get("group_size") or 0), stored)
    attach(model, names, _quant(kv))
    return "compress"


@torch.no_grad()
def calibrate(model: nn.Module, kv: KVCache, tokens: torch.Tensor, dtype: torch.dtype, batch_size: int = 8) -> KVCache:
    """`kv` with its static scales: max |K| and max |V| of each attention layer (per KV head for `head`) over `tokens`
    (windows of the calibration text through `model` as it computes at this point: quantized weights and
    activations, so the cache sees what it will be served), divided by the grid's half range and rounded to `dtype`,
    the export's. A `dynamic` setting has no scales to calibrate."""
    if kv.scales == "dynamic":
        return kv
    names = list(kv.layers)
    top: dict[str, list[torch.Tensor]] = {}

    def observe(name, k, v):
        per = [t.abs().amax(dim=(0, 2, 3)).float() for t in (k, v)]  # (kv_heads,)
        old = top.get(name)
        top[name] = per if old is None else [torch.maximum(a, b) for a, b in zip(old, per)]
        return k, v

    with hooked(model, names, observe):
        for i in range(0, tokens.shape[0], batch_size):
            model(tokens[i:i + batch_size])
    half = kv.grid.half
    layers = {}
    for name in names:
        pair = []
        for m in top[name]:
            m = m.amax().reshape(1) if kv.scales == "tensor" else m.reshape(-1, 1, 1)
            pair.append((m.clamp_min(1e-30) / half).to(dtype).float())
        layers[name] = (pair[0], pair[1])
    return replace(kv, layers=layers)
