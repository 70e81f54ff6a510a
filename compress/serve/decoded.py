"""What an engine's greedy decoding returns, and how two of them are compared (docs/serving.md#agreement).

Every engine runner returns a `Decoded` for the same prompts (token ids, so no tokenizer differences enter):
the greedy tokens of each prompt and, per generated position, the engine's top-k log-probabilities
(`{token id: logprob}`, k = TOP_K; empty where an engine does not report them). `compare(reference, other)` counts
the tokens equal before each prompt's first divergence, and over the positions where both decoded the same prefix
the mean top-5 overlap and the largest |logprob difference| of the reference's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOP_K = 5
TIE = 0.02  # nats: a divergence where the reference's two tokens are this close is a tie, not a disagreement
PROMPTS = (
    "Once upon a time, there was a little",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Tom and Lily went to the park. They saw",
)
N_TOKENS = 32


@dataclass
class Decoded:
    tokens: list[list[int]]  # per prompt: the generated ids (prompt excluded)
    top: list[list[dict[int, float]]] = field(default_factory=list)  # per prompt, per position: {id: logprob}

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "top": [[{str(k): v for k, v in d.items()} for d in p] for p in self.top]}

    @classmethod
    def from_json(cls, d: dict) -> "Decoded":
        return cls(d["tokens"], [[{int(k): float(v) for k, v in s.items()} for s in p] for p in d.get("top", [])])


def compare(ref: Decoded, got: Decoded) -> dict:
    """{"equal": tokens equal before the first divergence (all prompts), "total": tokens decoded by the reference,
    "top5_overlap": mean |top-5 ∩ top-5| / 5 on the shared prefixes (None without log-probabilities), "max_dlogprob":
    largest |logprob_ref(t) - logprob_got(t)| of the reference's token t there (None without them), "divergences":
    [{prompt, position, margin}] where margin = logprob_ref(ref's token) - logprob_ref(engine's token) (None when the
    engine's token is outside the reference's top-k), "ties": how many of them have margin <= TIE}."""
    if len(ref.tokens) != len(got.tokens):
        raise ValueError(f"{len(ref.tokens)} reference prompts, {len(got.tokens)} decoded")
    equal = total = 0
    overlaps, deltas, divergences = [], [], []
    for p, (a, b) in enumerate(zip(ref.tokens, got.tokens)):
        total += len(a)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        equal += n
        if n < min(len(a), len(b)):
            r = ref.top[p][n] if ref.top and n < len(ref.top[p]) else {}
            margin = round(r[a[n]] - r[b[n]], 4) if a[n] in r and b[n] in r else None
            divergences.append({"prompt": p, "position": n, "margin": margin})
        if not (ref.top and got.top):
            continue
        # position i is compared while the prefixes agree (the position of the first divergence included)
        for i in range(min(n + 1, len(a), len(b), len(ref.top[p]), len(got.top[p]))):
            ra, rb = ref.top[p][i], got.top[p][i]
            ka = sorted(ra, key=ra.get, reverse=True)[:TOP_K]
            kb = sorted(rb, key=rb.get, reverse=True)[:TOP_K]
            overlaps.append(len(set(ka) & set(kb)) / TOP_K)
            if a[i] in rb:
                deltas.append(abs(ra[a[i]] - rb[a[i]]))
    return {"equal": equal, "total": total, "divergences": divergences,
            "ties": sum(d["margin"] is not None and d["margin"] <= TIE for d in divergences),
            "top5_overlap": round(sum(overlaps) / len(overlaps), 4) if overlaps else None,
            "max_dlogprob": round(max(deltas), 4) if deltas else None}
