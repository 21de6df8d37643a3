"""Plain decoding speed: this runtime's `ar` mode against mlx_lm on the same weights.

Run with the CLI's BLAS (OpenBLAS preloaded on Linux), e.g.
    env $(.venv/bin/python -m specstream_mlx.blas_env) \
        .venv/bin/python examples/bench_plain.py [--size small|medium|qwen0.5b | --model smollm2]

Builds a random checkpoint of the chosen shape (float32), or takes a real model
(``--model``: a directory or bundled name; its quantized weights are expanded to
float32 for both peers on the CPU backend, so both run the same weights in the
same dtype), loads it once with our loader and once with mlx_lm.load, then
alternates the two decoders over
several rounds (same prompt, same max tokens, greedy, after a warm-up) and
reports median tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SIZES = {
    "small": dict(
        hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    ),
    "medium": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    ),
    # Qwen2.5-0.5B's shape with a 32k vocabulary (ours is random anyway).
    "qwen0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
}


def build_dir(size: str, out: Path) -> Path:
    from specstream_mlx.demo.byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer
    from specstream_mlx.models import build_model

    cfg = dict(
        model_type="llama",
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    cfg.update(SIZES[size])
    mx.random.seed(0)
    model = build_model(cfg)
    w = {k: (v if "norm" in k else mx.random.normal(v.shape) * 0.05) for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), w)
    (out / "config.json").write_text(json.dumps(cfg))
    save_byte_tokenizer(out, chat_template=False)
    return out


def _rate(responses):
    """Tokens per second after the first token, timed identically for both peers:
    the harness clocks when each response arrives."""
    n, t0, t1 = 0, None, None
    for r in responses:
        now = time.perf_counter()
        k = len(r.tokens) if hasattr(r, "tokens") else 1
        if t0 is None:
            t0 = now
        else:
            n += k
            t1 = now
    return n / (t1 - t0), n + 1


def ours_tps(model, tok, prompt, max_tokens):
    from specstream_mlx.runtime.generation import stream_generate

    return _rate(stream_generate(model, tok, prompt, max_tokens=max_tokens, use_chat_template=False))


def mlx_lm_tps(model, tok, prompt, max_tokens):
    import mlx_lm

    return _rate(mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens))


def _load_per_core() -> float:
    import os

    return round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=list(SIZES))
    ap.add_argument("--model", default=None, help="a real model directory or bundled name instead of --size")
    ap.add_argument("--prompt", default="Write a long story about a dragon who learns to cook.")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    import mlx_lm

    from specstream_mlx import load
    from specstream_mlx.platform_info import runtime_info

    with tempfile.TemporaryDirectory() as d:
        if args.model:
            from specstream_mlx.io.loading import cast_floating, dequantize_model, resolve_model_path

            path = resolve_model_path(args.model)
        else:
            path = build_dir(args.size, Path(d) / "m")
        ours, tok = load(str(path))
        theirs, ttok = mlx_lm.load(str(path))
        if args.model:
            # The same weights in the same dtype for both: our loader expands quantized
            # weights to float32 on the CPU backend; do the same to mlx-lm's model.
            if mx.default_device() == mx.cpu:
                dequantize_model(theirs)
                cast_floating(theirs, mx.float32)
            msgs = [{"role": "user", "content": args.prompt}]
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            # Make the random model avoid EOS so both decode exactly max_tokens.
            prompt = "The quick brown fox jumps over the lazy dog. " * 2
        ours_tps(ours, tok, prompt, 16)
        mlx_lm_tps(theirs, ttok, prompt, 16)
        a, b = [], []
        for r in range(args.rounds):
            # Alternate which peer goes first, so neither always follows the other.
            order = [(ours_tps, ours, tok, a), (mlx_lm_tps, theirs, ttok, b)]
            for fn, m, tk, out in order if r % 2 == 0 else order[::-1]:
                t, n = fn(m, tk, prompt, args.max_tokens)
                out.append(t)
                if fn is ours_tps:
                    n1 = n
                else:
                    n2 = n
    info = runtime_info()
    res = {
        "model": args.model or f"random {args.size}",
        "load_1min_per_core": _load_per_core(),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "ours_tps_median": statistics.median(a),
        "mlx_lm_tps_median": statistics.median(b),
        "ratio": statistics.median(a) / statistics.median(b),
        "ours_tps": a,
        "mlx_lm_tps": b,
        "generated": [n1, n2],
        "blas": info["blas"],
        "device": info["device"],
        "mlx": info["mlx"],
        "mlx_lm": info["mlx_lm"],
    }
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
