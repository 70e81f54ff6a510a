"""How the hf export lays a quantized layer out: the packing formats engines read (docs/serving.md#layouts).

One packing per checkpoint (`quantization_config.packing_format` is global in every loader):

    auto_round:auto_gptq  GPTQ v1 (`kernels.packing.gptq_pack`, zero points stored minus one). Symmetric only: vLLM
                          reads it as uint4b8 / uint8b128 and never reads `qzeros`, so every stored zero must be
                          2^(b-1) (a mixed layer is re-centred first, below).
    auto_round:auto_awq   AutoAWQ's GEMM layout (`kernels.packing.awq_pack`): qweight (K, N*b/32) packed along the
                          outputs in the order [0, 2, 4, 6, 1, 3, 5, 7], real zero points, fp16 scales (groups, N).
                          4 and 8 bits. The default for any asymmetric checkpoint whose packed layers are all 4 or
                          8 bits; its symmetric layers are declared `sym: false` with their zero 2^(b-1) written
                          (vLLM reads an AWQ layer's zeros only when it is declared asymmetric), and
                          `compress.meta.sym_layers` lets `read_quantized` restore their flag.
    auto_round            GPTQ v2 (real zero points), every width 2..8, sym and asym: auto-round's torch loader in
                          transformers reads it; vLLM refuses it. Used for asymmetric checkpoints of other widths.
    gptq                  a plain GPTQ checkpoint (`quant_method: gptq`, v1, `desc_act: false`, per-layer schemes in
                          GPTQModel's `dynamic`), for engines without auto-round support. Symmetric only (v1 cannot
                          hold a zero point of 0, which asymmetric layers have).

Containers. A layer of b bits may be stored in a container of C > b bits: a mixed-precision layer (an `allocate`
plan) at its widest chunk, and any layer at the widest of the layers vLLM fuses with it (q/k/v, gate/up, the routed
experts of one block: `containers`), since vLLM takes one scheme per fused linear. The weights are unchanged: an
asymmetric part keeps its codes and real zeros; a symmetric part's zero 2^(b-1) is one an engine that ignores
`qzeros` would read as 2^(C-1), so it is **re-centred**: codes c' = c + 2^(C-1) - 2^(b-1), zero 2^(C-1) (`widen`).
The reader restores the layer from the chunk map and `compress.meta.widened` (`narrow`), bit-exact.
"""

from __future__ import annotations


import torch

from compress.kernels.packing import AWQ_BITS, awq_pack, awq_unpack, gptq_pack, gptq_unpack
from compress.qweight import KEEP_BITS, QuantizedWeight

SYM_PACKING, AWQ_PACKING, V2_PACKING, GPTQ = "auto_round:auto_gptq", "auto_round:auto_awq", "auto_round", "gptq"
V1_PACKINGS = (SYM_PACKING, "auto_round:gptq")  # auto-round's older name of the same layout
AUTO_ROUND_PACKINGS = (*V1_PACKINGS, AWQ_PACKING, V2_PACKING)
CHOICES = ("auto", "auto_round", "awq", "gptq")  # the recipe's `export.hf.packing`


def choose(packed: dict[str, QuantizedWeight], requested: str = "auto",
           wide: dict[str, int] | None = None) -> tuple[str, str | None]:
    """(packing_format, why it is not one vLLM reads, or None) for these packed layers (`wide`: the containers).

    requested: `auto` (GPTQ v1 when every layer is symmetric, else AWQ when every layer is 4 or 8 bits, else GPTQ
    v2), `auto_round` (always GPTQ v2), `awq`, `gptq`; an impossible request raises ValueError."""
    if requested not in CHOICES:
        raise ValueError(f"unknown packing {requested!r}; choose one of {CHOICES}")
    sym = all(qw.sym for qw in packed.values())
    width = {n: (wide or {}).get(n, qw.bits) for n, qw in packed.items()}  # as stored (`containers`)
    awq_bad = next((f"{n}: {b} bits" for n, b in width.items() if b not in AWQ_BITS), None)
    if requested == "gptq":
        if not sym:
            raise ValueError("packing `gptq` holds symmetric layers only (GPTQ v1 stores zero points minus one and "
                             "cannot hold the zero 0 of asymmetric ones); use packing `auto`")
        return GPTQ, None
    if requested == "awq":
        if awq_bad:
            raise ValueError(f"packing `awq` holds {AWQ_BITS} bits only ({awq_bad})")
        return AWQ_PACKING, None
    if requested == "auto_round":
        return V2_PACKING, "packing_format `auto_round` (GPTQ v2) is read by transformers only"
    if sym:
        return SYM_PACKING, None
    if awq_bad is None:
        return AWQ_PACKING, None
    return V2_PACKING, (f"asymmetric layers of widths AWQ cannot hold ({awq_bad}) are packed as `auto_round` (GPTQ "
                        "v2), which vLLM refuses; transformers loads it")


SIBLINGS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj"}  # vLLM's packed_modules_mapping: these load as one fused linear


def fused_group(name: str) -> str:
    """The fused linear `name` loads into in vLLM (its own name when none): q/k/v and gate/up of one block, and every
    projection of the routed experts of one MoE block (vLLM's fused MoE takes one scheme for all of them)."""
    import re

    m = re.match(r"(.+\.experts)\.\d+\.[^.]+$", name)
    if m:
        return m.group(1)
    head, _, leaf = name.rpartition(".")
    return f"{head}.{SIBLINGS[leaf]}" if leaf in SIBLINGS else name


def containers(packed: dict[str, QuantizedWeight], minimum: int | None = None) -> dict[str, int]:
    """{layer: container width} for the layers stored wider than their own `bits`: the layers vLLM fuses into one
    linear must share one scheme, so each is stored at the widest of its fused group (q/k/v, gate/up; routed experts
    keep their own widths, the storage expert-level precision is for), and at least at `minimum`
    (`export.hf.container`; weights unchanged)."""
    widest: dict[str, int] = {}
    key = {n: n if ".experts." in n else fused_group(n) for n in packed}  # expert-level widths keep their storage
    for n, qw in packed.items():
        widest[key[n]] = max(widest.get(key[n], 0), qw.bits, minimum or 0)
    return {n: widest[key[n]] for n, qw in packed.items() if widest[key[n]] > qw.bits}


def widen(qw: QuantizedWeight, container: int | None = None) -> QuantizedWeight:
    """`qw` as a uniform weight of `container` bits (default its own `bits`): every part of b < container bits keeps
    its weights; a symmetric part is re-centred to the container's zero 2^(C-1), c' = c + 2^(C-1) - 2^(b-1)
    (module docstring), an asymmetric one keeps its codes and real zeros. The chunk map goes to the checkpoint's
    meta, from which `narrow` restores `qw` bit-exactly."""
    c = container or qw.bits
    if c == qw.bits and not (qw.mixed and qw.sym):
        return qw
    codes, zeros = qw.codes.to(torch.int16).clone(), qw.zeros.clone()
    if qw.sym:
        for (s, e), b in _parts(qw):
            codes[:, s:e] += 2 ** (c - 1) - 2 ** (b - 1)
            zeros[:, s // qw.group: -(-e // qw.group)] = 2 ** (c - 1)
    return QuantizedWeight(codes=codes.to(torch.uint8), scales=qw.scales, zeros=zeros, bits=c,
                           group_size=qw.group_size, sym=qw.sym)


def narrow(qw: QuantizedWeight, bits: int, chunks: dict | None) -> QuantizedWeight:
    """Inverse of `widen`: the stored uniform weight of a container back to its own `bits` and chunk map."""
    chunk_map = {} if not chunks else {"chunk_size": chunks["chunk_size"], "chunk_bits": tuple(chunks["chunk_bits"]),
                                       "map_bits": chunks["map_bits"]}
    shape = dict(scales=qw.scales, group_size=qw.group_size, sym=qw.sym, bits=bits, **chunk_map)
    codes, zeros = qw.codes.to(torch.int16).clone(), qw.zeros.clone()
    if qw.sym:
        c = qw.bits
        for (s, e), b in _parts(QuantizedWeight(codes=torch.zeros_like(qw.codes), zeros=zeros, **shape)):
            codes[:, s:e] -= 2 ** (c - 1) - 2 ** (b - 1)
            zeros[:, s // qw.group: -(-e // qw.group)] = 2 ** (b - 1)
    return QuantizedWeight(codes=codes.to(torch.uint8), zeros=zeros, **shape)


def _parts(qw: QuantizedWeight) -> list[tuple[tuple[int, int], int]]:
    """[((first column, end), bits)] of the quantized parts: each chunk of a mixed weight, or the whole weight."""
    if not qw.mixed:
        return [((0, qw.in_features), qw.bits)]
    return [(se, b) for se, b in zip(qw.chunk_bounds(), qw.chunk_bits) if b != KEEP_BITS]


def pack(qw: QuantizedWeight, packing: str, container: int | None = None) -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales"} of one layer in `packing`, stored at `container` bits (`widen`)."""
    qw = widen(qw, container)
    if packing == AWQ_PACKING:
        return awq_pack(qw)
    t = gptq_pack(qw, v1=packing in (*V1_PACKINGS, GPTQ))
    return {k: t[k] for k in ("qweight", "qzeros", "scales")}


def unpack(tensors: dict[str, torch.Tensor], packing: str, scheme: dict, chunks: dict | None,
           declared_sym: bool | None = None, bits: int | None = None) -> QuantizedWeight:
    """Inverse of `pack`: `scheme` is the layer's {bits, group_size, sym} from the config, `chunks` its chunk map
    from compress's meta (None for a uniform layer), `declared_sym` its real sym flag when the config declares it
    otherwise (AWQ), `bits` its own width when it is stored in a wider container."""
    stored, group, sym = int(scheme["bits"]), int(scheme["group_size"]), bool(scheme["sym"])
    sym = sym if declared_sym is None else declared_sym
    if packing == AWQ_PACKING:
        qw = awq_unpack(tensors, stored, group, sym)
    else:
        qw = gptq_unpack(tensors, stored, group, sym, v1=packing in (*V1_PACKINGS, GPTQ))
    if not chunks and bits in (None, stored):
        return qw
    own = bits or max(b for b in chunks["chunk_bits"] if b != KEEP_BITS)
    return narrow(qw, own, chunks)


def gptq_config(packed: dict[str, QuantizedWeight], qweights: dict[str, QuantizedWeight] | None = None,
                wide: dict[str, int] | None = None) -> dict:
    """A plain GPTQ `quantization_config`: the most common (bits, group_size, sym), GPTQModel's `dynamic` with a
    `+:` rule for each layer of another scheme and a `-:` rule for each quantized layer written dense (in
    `qweights`, not in `packed`). A rule matches the module name and its tensors' names (`name([.]|$)`), which
    vLLM, GPTQModel and the ONNX Runtime GenAI builder each match against."""
    from collections import Counter

    def rule(name: str) -> str:
        return "^" + name.replace(".", "[.]") + "([.]|$)"

    scheme = {n: ((wide or {}).get(n, q.bits), q.group_size, q.sym) for n, q in packed.items()}
    bits, group, sym = Counter(scheme.values()).most_common(1)[0][0]
    dynamic = {f"+:{rule(n)}": {"bits": b, "group_size": g, "sym": sy}
               for n, (b, g, sy) in scheme.items() if (b, g, sy) != (bits, group, sym)}
    dynamic.update({f"-:{rule(n)}": {} for n in (qweights or {}) if n not in packed})
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": False,
            "checkpoint_format": "gptq", "lm_head": "lm_head" in packed, **({"dynamic": dynamic} if dynamic else {})}
