"""Stream training throughput and peak memory: `train --backend mlx` vs `--backend torch`.

    .venv/bin/python examples/stream_train_speed.py [--model demo-chat --iters 12 --batch-size 16]

Both backends train the same lossless streams (frozen base, self-distillation,
pruning adapter, segment-wise stream gradients) on the same data, each through
the real CLI in its own process, alternating backends over ``--rounds`` rounds.
Reported per backend: the training tokens/s the trainer logs (median over
rounds) and the process's peak resident memory (max over rounds, from the OS:
weights, data, activations and both frameworks' runtimes). MLX runs with the
system OpenBLAS preloaded (as the CLI does on Linux), PyTorch without it (as
the CLI runs the torch backend). Data: ``--data`` or, by default, ShareGPT V3
conversations written by `prepare-sharegpt`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "specstream_mlx"]


def _run(cmd, env) -> "tuple[int, float]":
    """(exit status, peak RSS in GB) of one child process."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        sys.stderr.write(err[-2000:])
    kib = usage.ru_maxrss if sys.platform != "darwin" else usage.ru_maxrss / 1024
    return rc, kib * 1024 / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo-chat")
    ap.add_argument("--data", default=None, help="Data directory (default: ShareGPT via prepare-sharegpt).")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-seq-length", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--segment", type=int, default=32, help="Stream positions per gradient segment.")
    ap.add_argument("--stream-positions", type=int, default=64)
    ap.add_argument("--backends", default="mlx,torch", help="Comma-separated backends to compare.")
    ap.add_argument("--json", default=None, help="Write the results here.")
    a = ap.parse_args()
    from specstream_mlx.platform_info import find_openblas, runtime_info

    work = Path(tempfile.mkdtemp(prefix="stream-train-speed-"))
    data = a.data
    if data is None:
        data = str(work / "data")
        subprocess.run(CLI + ["prepare-sharegpt", "--out", data, "--max-examples", "400"], check=True)
    lib = find_openblas()
    # As the CLI runs them: MLX with OpenBLAS preloaded, PyTorch without (its kernels slow down
    # when OpenBLAS's threads compete with its own).
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    envs = {"mlx": dict(plain, **({"LD_PRELOAD": lib} if lib else {})), "torch": plain}
    common = ["--model", a.model, "--data", data, "--mode", "lossless", "--iters", str(a.iters)]
    common += ["--batch-size", str(a.batch_size), "--max-seq-length", str(a.max_seq_length), "--new-streams"]
    common += ["--steps-per-eval", "100000", "--save-every", "100000"]
    common += ["--segment", str(a.segment), "--stream-positions", str(a.stream_positions)]
    backends = a.backends.split(",")
    results = {b: [] for b in backends}
    for r in range(a.rounds):
        for backend in backends if r % 2 == 0 else backends[::-1]:
            out = work / f"{backend}-{r}"
            t = time.perf_counter()
            rc, rss = _run(CLI + ["train", "--backend", backend, "--out", str(out)] + common, envs[backend])
            if rc != 0:
                print(f"{backend}: train failed (exit {rc})", file=sys.stderr)
                return 1
            log = json.loads((out / "training_log.json").read_text())
            results[backend].append(
                {"tokens_per_second": log["tokens_per_second"], "peak_rss_gb": rss, "wall_s": time.perf_counter() - t}
            )
            print(f"round {r} {backend}: {log['tokens_per_second']:,.0f} tok/s, peak RSS {rss:.2f} GB", flush=True)
    summary = {
        b: {
            "tokens_per_second": statistics.median(x["tokens_per_second"] for x in v),
            "peak_rss_gb": max(x["peak_rss_gb"] for x in v),
        }
        for b, v in results.items()
    }
    ratio = None
    if {"mlx", "torch"} <= set(summary):
        ratio = summary["torch"]["tokens_per_second"] / summary["mlx"]["tokens_per_second"]
    info = runtime_info()
    print(
        f"{a.model}, lossless streams, {a.batch_size} x ≤{a.max_seq_length} tokens, "
        f"{a.stream_positions} stream positions in segments of {a.segment}, {a.iters} steps, "
        f"{a.rounds} rounds; load {os.getloadavg()[0]:.2f}; {info['cpu']} ({info['cores']} cores); "
        f"MLX {info['mlx']} with BLAS {lib or 'the wheel reference BLAS'}; PyTorch with its own kernels"
    )
    for b, s in summary.items():
        print(f"  {b:5s} {s['tokens_per_second']:8,.0f} tok/s   peak RSS {s['peak_rss_gb']:.2f} GB")
    if ratio is not None:
        print(f"  torch / mlx: {ratio:.2f}x")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"summary": summary, "rounds": results, "ratio": ratio, "runtime": info, "mlx_blas": lib}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
