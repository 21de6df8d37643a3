"""Tiny random Hugging Face models of every supported architecture, for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

# Odd sizes and GQA where the architecture has it, so a wrong reshape or a
# swapped projection cannot hide behind symmetric shapes.
_COMMON = dict(
    hidden_size=72,
    intermediate_size=100,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=151,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

VARIANTS: Dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-scaled": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama-linear": dict(
        model_type="llama",
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    # Widths divisible by 32, the smallest group size MLX quantizes with.
    "llama-q": dict(model_type="llama", tie_word_embeddings=False, hidden_size=96, intermediate_size=160),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, head_dim=16, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=16),
    # A window shorter than the test prompts: every layer of phi3 and mistral-window limited to it.
    "phi3": dict(
        model_type="phi3",
        tie_word_embeddings=False,
        num_key_value_heads=6,
        partial_rotary_factor=0.5,
        sliding_window=10,
    ),
    "mistral-window": dict(model_type="mistral", tie_word_embeddings=False, head_dim=16, sliding_window=8),
    # A window far shorter than the prompts, both layer kinds, distinct RoPE bases and a
    # score scale that is not head_dim's, so each Gemma-specific rule is exercised.
    "gemma3": dict(
        model_type="gemma3_text",
        tie_word_embeddings=True,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_theta=5000.0,
        rope_local_base_freq=100.0,
    ),
}

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


def make_hf_model(variant: str, out_dir: Path, seed: int = 0):
    """Save a random float32 ``transformers`` model; returns (torch model, dir)."""
    import torch
    import transformers

    spec = dict(_COMMON, **VARIANTS[variant])
    model_type = spec.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init gives near-uniform logits; a larger spread makes argmax
    # decisive, so greedy parity tests compare real decisions.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.05)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, out_dir
