"""Self-distillation experiment on the bundled demo-chat: its streams, trained further
on demo-chat's own replies, against the bundled streams, by τ at fixed trees.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \\
        .venv/bin/python examples/distill_demo_chat.py [--out runs/distill-demo-chat]

Steps (each a specstream-mlx command; about 30 minutes on 2 CPU cores):

1. ``prepare-sharegpt`` — 3,000 ShareGPT conversations; prompts that are also
   demo-chat's bench prompts are dropped (the bench stays held out);
2. ``distill`` — demo-chat's greedy replies to 400 prompts and temperature-0.7
   replies to 200 others (≤ 96 tokens each), plus greedy replies to 40 valid prompts;
3. ``train --mode lossless`` — 160 steps of 16 sequences (≤ 384 tokens), continuing
   from demo-chat's own streams (the pruning threshold is calibrated at the end);
4. ``examples/tree_sweep.py`` — τ of both models on demo-chat's 16 bench prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "specstream_mlx"]
HERE = Path(__file__).resolve().parent


def run(*args: str) -> None:
    print("$ specstream-mlx " + " ".join(args), flush=True)
    subprocess.run([*CLI, *args], check=True)


def last_user_prompt(row: dict):
    msgs = row["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: last + 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/distill-demo-chat", type=Path)
    ap.add_argument("--steps", type=int, default=160)
    args = ap.parse_args()
    out: Path = args.out
    run("prepare-sharegpt", "--out", str(out / "sharegpt"), "--max-examples", "3000", "--force")
    from specstream_mlx.io.loading import bundled_models_dir

    bench = {json.loads(line)["prompt"] for line in (bundled_models_dir() / "demo-chat" / "bench_prompts.jsonl").open()}
    rows = [json.loads(line) for line in (out / "sharegpt" / "train.jsonl").open()]
    rows = [r for r in rows if last_user_prompt(r)[-1]["content"] not in bench]
    valid = [json.loads(line) for line in (out / "sharegpt" / "valid.jsonl").open()][:40]
    for name, part, extra in (
        ("greedy", rows[:400], []),
        ("sampled", rows[1500:1700], ["--temp", "0.7", "--seed", "1"]),
    ):
        src = out / "prompts" / name
        src.mkdir(parents=True, exist_ok=True)
        (src / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        if name == "greedy":
            (src / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in valid))
        run(
            "distill",
            "--model",
            "demo-chat",
            "--prompts",
            str(src),
            "--out",
            str(out / name),
            "-m",
            "96",
            "--batch-size",
            "16",
            *extra,
        )
    mix = out / "mix"
    mix.mkdir(exist_ok=True)
    (mix / "train.jsonl").write_text(
        (out / "greedy" / "train.jsonl").read_text() + (out / "sampled" / "train.jsonl").read_text()
    )
    (mix / "valid.jsonl").write_text((out / "greedy" / "valid.jsonl").read_text())
    model = out / "demo-chat-distilled"
    run(
        "train",
        "--model",
        "demo-chat",
        "--data",
        str(mix),
        "--mode",
        "lossless",
        "--out",
        str(model),
        "--iters",
        str(args.steps),
        "--batch-size",
        "16",
        "--max-seq-length",
        "384",
        "--steps-per-eval",
        "80",
        "--force",
    )
    (model / "bench_prompts.jsonl").write_text((bundled_models_dir() / "demo-chat" / "bench_prompts.jsonl").read_text())
    env = dict(os.environ, ROUNDS="1")
    for m in ("demo-chat", str(model)):
        subprocess.run(
            [sys.executable, str(HERE / "tree_sweep.py"), m, "dynamic:4,dynamic:8,dynamic:8@1"], check=True, env=env
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
