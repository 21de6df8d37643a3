"""Lossless training on cached frozen features against the uncached step, at a build's settings.

    python examples/cached_features.py [MODEL] [DATA] [--sequences 48] [--rounds 2] [--out F.json]

For the first SEQUENCES train sequences: the time to build their feature cache, then the
same batches trained (forward + backward, no optimizer step) uncached and cached in
alternation, ROUNDS times, reported as stream positions per second; and, for the teacher's
top-k, the kept mass and the KL term's error against the whole vocabulary for several k,
with the model's own streams. Defaults: SmolLM2 with its shipped streams and the build's
settings (``demo/build.py: SMOL_STREAMS``). Precision: bfloat16 where the CPU has it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specstream_mlx.demo.build import RUNS, SMOL_EXAMPLES, SMOL_STREAMS  # noqa: E402
from specstream_mlx.io.loading import load_model_dir, resolve_model_path  # noqa: E402
from specstream_mlx.train import TrainConfig  # noqa: E402
from specstream_mlx.train import torch_backend as tb  # noqa: E402
from specstream_mlx.train import torch_objective as tobj  # noqa: E402
from specstream_mlx.train.data import iterate_batches, load_dataset  # noqa: E402
from specstream_mlx.train.feature_cache import CacheSpec, FeatureCache  # noqa: E402
from specstream_mlx.train.objective import Trainable  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("data", nargs="?", default=str(RUNS / f"sharegpt-{SMOL_EXAMPLES // 1000}k"))
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top-k", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    s = SMOL_STREAMS
    loaded = load_model_dir(str(resolve_model_path(args.model)), warn=False)
    model = loaded.model
    model.freeze()
    cfg = TrainConfig(
        backend="torch",
        num_streams=s["num_streams"],
        stream_layers=s["stream_layers"],
        lora_rank=s["lora_rank"],
        batch_size=s["batch_size"],
        max_seq_len=s["max_seq_len"],
        stream_positions=s["stream_positions"],
    )
    trainable = Trainable(model, cfg)
    if loaded.streams is not None:
        trainable.streams.update(loaded.streams.parameters())
    train, _, _ = load_dataset(Path(args.data), loaded.tokenizer, cfg.max_seq_len)
    train.examples = train.examples[: args.sequences]
    hf = tb.hf_model_from_mlx(model, loaded.config)
    cfg.precision = "bfloat16" if tb.native_bfloat16(torch.device("cpu")) else "float32"
    if cfg.precision == "bfloat16":
        hf.to(torch.bfloat16)
    params = tb.torch_trainable(trainable, cfg.lora_scale)
    s0 = len(model.layers) - cfg.stream_layers
    report = dict(model=args.model, sequences=len(train), precision=cfg.precision, threads=torch.get_num_threads())
    report["settings"] = {k: s[k] for k in ("batch_size", "max_seq_len", "stream_positions", "stream_layers")}

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        spec = CacheSpec("measure", s0, cfg.precision, max(args.top_k))
        cache = FeatureCache(hf, train.examples, spec, Path(tmp))
        for i in range(0, len(train), cfg.batch_size):
            cache.fill(range(i, min(i + cfg.batch_size, len(train))))
        report["build_s_per_sequence"] = (time.perf_counter() - t0) / len(train)
        report["cache_bytes_per_position"] = cache.total_bytes / int(cache.offsets[-1])
        batches = list(iterate_batches(train, cfg.batch_size, cfg.max_seq_len, cfg.stream_positions, 0, 0))
        times = {"uncached": [], "cached": []}
        positions = sum(int(b.stream_weight.sum()) for b in batches)
        for _ in range(args.rounds):
            for kind in times:
                t0 = time.perf_counter()
                for b in batches:
                    rows = tb._batch_tensors(b, 0, 1)
                    if kind == "cached":
                        rows.update(cache.batch(b.index, rows["tokens"].shape[1]))
                    for p in params.parameters():
                        p.grad = None
                    tobj.backward_segments(hf, params, cfg, rows, s0)
                times[kind].append(time.perf_counter() - t0)
        for kind, ts in times.items():
            report[f"{kind}_positions_per_s"] = positions / min(ts)
            print(f"{kind}: {positions / min(ts):.1f} stream positions/s (best of {len(ts)}: {min(ts):.1f} s)")
        report["speedup"] = report["cached_positions_per_s"] / report["uncached_positions_per_s"]
        print(f"cached / uncached: {report['speedup']:.2f}x")

        # The teacher's top-k: kept mass and the KL term against the whole vocabulary.
        rows_k = []
        for k in sorted(args.top_k):
            full, kept, mass = [], [], []
            for b in batches[:2]:
                base = tb._batch_tensors(b, 0, 1)
                with torch.no_grad():
                    ref = tobj.backward_segments(hf, params, cfg, base, s0, train=False)
                    extra = cache.batch(b.index, base["tokens"].shape[1])
                    t = extra["teacher"]
                    top = tobj.Teacher(t.probs[:, :k], None, t.ids[:, :k], None)
                    q = top.probs
                    lq = q.clamp_min(1e-38).log()
                    extra["teacher"] = tobj.Teacher(q, (q * lq).sum(-1), top.ids, q.sum(-1))
                    got = tobj.backward_segments(hf, params, cfg, dict(base, **extra), s0, train=False)
                full.append(ref["stream_kl"])
                kept.append(got["stream_kl"])
                real = base["lengths"]
                mass.append(
                    float(
                        np.mean(
                            [
                                float(extra["teacher"].mass.view(len(real), -1)[i, :n].mean())
                                for i, n in enumerate(real.tolist())
                            ]
                        )
                    )
                )
            f, g = np.mean(full, 0), np.mean(kept, 0)
            rows_k.append(
                dict(
                    k=k,
                    kept_mass=float(np.mean(mass)),
                    kl_full=f.tolist(),
                    kl_kept=g.tolist(),
                    kl_rel_error=float(np.max(np.abs(g - f) / f)),
                )
            )
            print(f"top-{k}: kept mass {np.mean(mass):.3f}, stream KL {np.round(g, 3)} vs full {np.round(f, 3)}")
        report["top_k"] = rows_k
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
