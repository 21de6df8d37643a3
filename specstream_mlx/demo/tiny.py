"""Tiny complete model directories (random weights, config, byte tokenizer), built
in MLX: what the tests and the synthetic-training example run on."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models import build_model
from .byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer


def tiny_config(model_type: str = "llama", **overrides) -> dict:
    cfg = dict(
        model_type=model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def make_tiny_model_dir(out: Path, seed: int = 0, **overrides) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**overrides)
    mx.random.seed(seed)
    model = build_model(cfg)
    # Spread the weights so the random model makes confident, varied choices.
    params = {
        k: (mx.random.normal(v.shape) * (0.15 if v.ndim > 1 else 0.02) + (1.0 if "norm" in k else 0.0))
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), params)
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    save_byte_tokenizer(out)
    return out
