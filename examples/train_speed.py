"""Training throughput of MLX (CPU backend) vs PyTorch (CPU) on the demo-sql shape.

    .venv/bin/python examples/train_speed.py [--batch 16 --seq 96]

One full step = forward + backward + AdamW update of a randomly initialised
Llama (d=256, 4 layers, 1,024-token vocabulary: demo-sql's shape), timed over
10 steps after 3 warm-up steps. MLX runs with the system OpenBLAS preloaded
(as the CLI does), PyTorch without it (its own kernels), each in its own
process. This is why the demo models' base weights are pretrained with PyTorch
(specstream_mlx/torch_pretrain.py) before the streams are trained in MLX.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIG = dict(
    model_type="llama",
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)

MLX = r"""
import json, sys, time
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
from specstream_mlx.models import build_model
cfg, B, L = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = build_model(cfg)
x = mx.random.randint(0, cfg["vocab_size"], (B, L))
opt = optim.AdamW(1e-3)
lg = nn.value_and_grad(model, lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean())
state = [model.state, opt.state]
def step(x):
    l, g = lg(model, x); opt.update(model, g); return l
step = mx.compile(step, inputs=state, outputs=state)
for _ in range(3): mx.eval(step(x), state)
t = time.perf_counter()
for _ in range(10): mx.eval(step(x), state)
print(B * L * 10 / (time.perf_counter() - t))
"""

TORCH = r"""
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg, B, L = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
x = torch.randint(0, cfg["vocab_size"], (B, L))
opt = torch.optim.AdamW(m.parameters(), 1e-3)
def step():
    m(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
for _ in range(3): step()
t = time.perf_counter()
for _ in range(10): step()
print(B * L * 10 / (time.perf_counter() - t))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    a = ap.parse_args()
    from specstream_mlx.platform_info import find_openblas, runtime_info

    args = [json.dumps(CONFIG), str(a.batch), str(a.seq)]
    base_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    lib = find_openblas()
    mlx_env = dict(base_env, **({"LD_PRELOAD": lib} if lib else {}))
    res = {}
    for name, code, env in (("mlx", MLX, mlx_env), ("torch", TORCH, base_env)):
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
        res[name] = float(out.stdout.strip().splitlines()[-1])
    info = runtime_info()
    print(
        json.dumps(
            {
                "tokens_per_second": {k: round(v) for k, v in res.items()},
                "torch_over_mlx": round(res["torch"] / res["mlx"], 2),
                "batch": a.batch,
                "seq": a.seq,
                "mlx_blas": lib or "reference",
                "cpu": info["cpu"],
                "cores": info["cores"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
