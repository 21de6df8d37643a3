"""A GGUF file's tokenizer metadata -> ``tokenizer.json`` and ``tokenizer_config.json``.

llama.cpp stores a vocabulary, not a tokenizer: the tokens, their types (normal,
control, user-defined, byte), the merges or scores, the special ids and the name
of the pre-tokenizer the vocabulary was learned with. This module rebuilds the
``tokenizers`` pipeline those describe, so the output directory needs neither
llama.cpp nor the original repository.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# llama.cpp's token types.
CONTROL, USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> the regexes it splits with.
# The StarCoder family (SmolLM among it) first isolates every digit, then splits as GPT-2.
PRE_TOKENIZERS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "dbrx": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "codeshell": [r"\p{N}", _GPT2_SPLIT],
}


class GGUFTokenizerError(ValueError):
    pass


def _pre_tokenizer(splits: List[str]) -> dict:
    steps = [{"type": "Split", "pattern": {"Regex": s}, "behavior": "Isolated", "invert": False} for s in splits]
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
    return {"type": "Sequence", "pretokenizers": steps}


def _added_tokens(tokens: List[str], types: List[int]) -> List[dict]:
    """Control tokens as special, user-defined ones as plain added tokens: llama.cpp
    matches both whole in the text, so they must never be split by BPE."""
    out = []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            out.append(
                {
                    "id": i,
                    "content": tok,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": kind == CONTROL,
                }
            )
    return out


def _post_processor(bos: Optional[Tuple[str, int]], eos: Optional[Tuple[str, int]], byte_level: bool) -> Optional[dict]:
    procs = []
    if byte_level:
        procs.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    if bos or eos:
        single = ([{"SpecialToken": {"id": bos[0], "type_id": 0}}] if bos else []) + [
            {"Sequence": {"id": "A", "type_id": 0}}
        ]
        single += [{"SpecialToken": {"id": eos[0], "type_id": 0}}] if eos else []
        pair = single + [
            {"SpecialToken": {"id": bos[0], "type_id": 1}} if bos else None,
            {"Sequence": {"id": "B", "type_id": 1}},
            {"SpecialToken": {"id": eos[0], "type_id": 1}} if eos else None,
        ]
        specials = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (x for x in (bos, eos) if x)}
        procs.append(
            {
                "type": "TemplateProcessing",
                "single": single,
                "pair": [p for p in pair if p is not None],
                "special_tokens": specials,
            }
        )
    if not procs:
        return None
    return procs[0] if len(procs) == 1 else {"type": "Sequence", "processors": procs}


def _bpe_model(vocab: Dict[str, int], merges: List[List[str]], **kw) -> dict:
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": kw.get("unk_token"),
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": kw.get("fuse_unk", False),
        "byte_fallback": kw.get("byte_fallback", False),
        "ignore_merges": kw.get("ignore_merges", False),
        "vocab": vocab,
        "merges": merges,
    }


def gpt2_tokenizer(md: Dict[str, Any], path: Path, notes: List[str]) -> dict:
    tokens = md["tokenizer.ggml.tokens"]
    merges = md.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFTokenizerError(f"{path}: missing metadata key 'tokenizer.ggml.merges' (gpt2 tokenizer)")
    pre = md.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZERS.get(pre)
    if splits is None:
        notes.append(f"pre-tokenizer {pre!r} is not known here: text is split as GPT-2 splits it")
        splits = [_GPT2_SPLIT]
    return {
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(splits),
        "model": _bpe_model({t: i for i, t in enumerate(tokens)}, [m.split(" ", 1) for m in merges]),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    }


def spm_merges(tokens: List[str], scores: List[float]) -> List[List[str]]:
    """BPE merges equivalent to a SentencePiece BPE vocabulary: SentencePiece joins the
    adjacent pair whose joined piece scores highest, so a merge's rank is its result's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for tok, score in zip(tokens, scores):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[tok], vocab[left], vocab[right], left, right))
    found.sort()
    return [[f[4], f[5]] for f in found]


# Families whose SentencePiece vocabulary llama.cpp stores with two quirks: a token of
# only spaces is spelled with real spaces (SentencePiece spells them U+2581), and the
# scores do not follow the merge order, the order of the tokens does (as transformers'
# GGUF loader reads Gemma files).
GEMMA_FAMILY = ("gemma", "gemma2", "gemma3")


def llama_spm_tokenizer(md: Dict[str, Any], path: Path, notes: List[str]) -> dict:
    tokens = md["tokenizer.ggml.tokens"]
    scores = md.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFTokenizerError(f"{path}: missing metadata key 'tokenizer.ggml.scores' (llama tokenizer)")
    if md.get("general.architecture") in GEMMA_FAMILY:  # tokens respelled by tokenizer_files
        scores = [-float(i) for i in range(len(tokens))]
    merges = md.get("tokenizer.ggml.merges")
    merges = [m.split(" ", 1) for m in merges] if merges else spm_merges(tokens, scores)
    unk = md.get("tokenizer.ggml.unknown_token_id")
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    normalizer = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoder = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        normalizer.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizer},
        "pre_tokenizer": None,
        "model": _bpe_model(
            {t: i for i, t in enumerate(tokens)},
            merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        ),
        "decoder": {"type": "Sequence", "decoders": decoder},
    }


BUILDERS = {"gpt2": gpt2_tokenizer, "llama": llama_spm_tokenizer}


def tokenizer_files(md: Dict[str, Any], path: Path) -> Tuple[Dict[str, Any], Optional[str], List[str]]:
    """({file name: JSON}, chat template, notes) for a GGUF's tokenizer metadata."""
    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFTokenizerError(f"{path}: missing metadata key 'tokenizer.ggml.model'")
    if kind not in BUILDERS:
        raise GGUFTokenizerError(
            f"{path}: 'tokenizer.ggml.model' {kind!r} is not supported; supported: {', '.join(BUILDERS)}"
        )
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFTokenizerError(f"{path}: missing metadata key 'tokenizer.ggml.tokens'")
    if kind == "llama" and md.get("general.architecture") in GEMMA_FAMILY:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        md = {**md, "tokenizer.ggml.tokens": tokens}
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    notes: List[str] = []
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": _added_tokens(tokens, types)}
    tok.update(BUILDERS[kind](md, path, notes))

    def special(key):
        i = md.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFTokenizerError(f"{path}: 'tokenizer.ggml.{key}' {i} is outside the vocabulary")
        return tokens[int(i)], int(i)

    bos, eos, unk, pad = (special(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"))
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    tok["post_processor"] = _post_processor(bos if add_bos else None, eos if add_eos else None, kind == "gpt2")
    # Key order as tokenizers writes it (readers do not care, people diffing files do).
    order = ["version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor"]
    tok = {k: tok[k] for k in order + ["decoder", "model"]}
    template = md.get("tokenizer.chat_template")
    cfg: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get(f"{md.get('general.architecture')}.context_length") or 2048),
    }
    for name, v in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if v is not None:
            cfg[name] = v[0]
    if template is not None:
        cfg["chat_template"] = template
    _check_loadable(tok, path)
    return {"tokenizer.json": tok, "tokenizer_config.json": cfg}, template, notes


def _check_loadable(tok: dict, path: Path) -> None:
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(json.dumps(tok))
    except Exception as e:  # tokenizers raises a plain Exception on a bad spec
        raise GGUFTokenizerError(f"{path}: the tokenizer metadata does not make a valid tokenizer ({e})") from e
