"""The tokenizer of a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes it (llama.cpp b8xxx, the copy vendored
by llama-cpp-python 0.3.36: `conversion/base.py`), from a tokenizer directory (`save_pretrained` output):

- SentencePiece (`tokenizer.model`): `tokenizer.ggml.model = llama`, pieces, scores and token types
  (`gguf.SentencePieceVocab`'s reading, as `_set_vocab_sentencepiece`);
- a Llama-style BPE `tokenizer.json` with byte fallback: `llama` through `gguf.LlamaHfVocab` (`_set_vocab_llama_hf`);
- a byte-level BPE (GPT-2 style: SmolLM2, Qwen, Llama 3): `tokenizer.ggml.model = gpt2`, the vocabulary, merges and
  `tokenizer.ggml.pre`, the pre-tokenizer llama.cpp runs, found as llama.cpp finds it: the sha256 of the token ids of a
  fixed text (`PRE`: the entries for the families compress writes). An unknown hash is refused (llama.cpp would
  pre-tokenize differently), except a plain GPT-2 byte-level regex, which is `gpt-2`.

Special tokens, `add_bos`/`add_eos` and the chat template come from `gguf.SpecialVocab`.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

from compress.errors import BadInput

# convert_hf_to_gguf.py's get_vocab_base_pre: its check text and the hashes of the families compress writes
CHKTXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
          '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
          '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
          '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
}


def kind(directory: Path) -> str:
    """`spm`, `llama-hf` or `bpe`: which of the three readings applies (BadInput when none does)."""
    if (directory / "tokenizer.model").is_file():
        return "spm"
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise BadInput(f"the GGUF export needs the model's tokenizer (tokenizer.model or tokenizer.json); {directory} "
                       "has neither")
    t = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = t.get("model") or {}, t.get("decoder") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback") and decoder.get("type") == "Sequence":
        return "llama-hf"
    if model.get("type") == "BPE":
        return "bpe"
    raise BadInput(f"the GGUF export writes SentencePiece and BPE tokenizers; this one is `{model.get('type')}`")


def pre_tokenizer(tokenizer, directory: Path) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE tokenizer, or BadInput."""
    digest = sha256(str(tokenizer.encode(CHKTXT)).encode()).hexdigest()
    if digest in PRE:
        return PRE[digest]
    pre = (json.loads((directory / "tokenizer.json").read_text(encoding="utf-8")).get("pre_tokenizer") or {})
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):  # GPT-2's own regex
        return "gpt-2"
    raise BadInput(f"the tokenizer's pre-tokenizer (hash {digest[:12]}...) is not one llama.cpp knows from the "
                   f"families compress writes ({', '.join(sorted(set(PRE.values())))}): a GGUF file would "
                   "tokenize differently in llama.cpp")


def add_vocab(writer, directory: Path, vocab_size: int) -> str:
    """Write the tokenizer of `directory` into `writer` (a `gguf.GGUFWriter`); returns the reading used."""
    import gguf
    from transformers import AutoTokenizer

    how = kind(directory)
    if how in ("spm", "llama-hf"):
        vocab = gguf.SentencePieceVocab(directory) if how == "spm" else gguf.LlamaHfVocab(directory)
        tokens, scores, types = _padded(list(vocab.all_tokens()), vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        gguf.SpecialVocab(directory, n_vocab=len(tokens)).add_to_gguf(writer)
    else:
        tok = AutoTokenizer.from_pretrained(directory)
        tokens, types = _bpe_tokens(tok, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer(tok, directory))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(directory, load_merges=True).add_to_gguf(writer)
    return how


def _padded(entries, vocab_size: int):
    import gguf

    tokens = [t for t, _, _ in entries]
    scores = [s for _, s, _ in entries]
    types = [int(k) for _, _, k in entries]
    for i in range(len(tokens), vocab_size):  # an embedding wider than the vocabulary
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    return tokens[:vocab_size], scores[:vocab_size], types[:vocab_size]


def _bpe_tokens(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf.py's get_vocab_base: the tokens in id order, added ones normalised, holes as [PADi]."""
    import gguf

    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                token = token.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))
