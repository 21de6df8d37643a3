"""Stream accuracy and tokens/pass before and after training, on the synthetic corpus.

    env $(.venv/bin/python -m specstream_mlx.blas_env) \
        .venv/bin/python examples/train_synthetic.py

The configuration of tests/test_training.py::test_shared_training_raises_accuracy_and_tokens_per_pass
(tiny llama, byte tokenizer, phrase corpus, shared mode, 120 steps); prints one JSON line.
"""

import json
import tempfile
from pathlib import Path

import numpy as np

from specstream_mlx import generate, load
from specstream_mlx.convert import ConvertOptions, convert
from specstream_mlx.demo.datagen import write_phrase_corpus
from specstream_mlx.demo.tiny import make_tiny_model_dir
from specstream_mlx.method.tree import TreeSpec
from specstream_mlx.train import TrainConfig, train

d = Path(tempfile.mkdtemp())
base = make_tiny_model_dir(d / "base", hidden_size=64, num_hidden_layers=4)
table = write_phrase_corpus(d / "data", n_keys=8, words_per_phrase=5)
T = TreeSpec("dynamic", budget=8, depth=3)


def tau(m, tok):
    return float(
        np.mean(
            [generate(m, tok, p, max_tokens=40, mode="ss", tree=T).stats.tokens_per_pass for p in sorted(table)[:4]]
        )
    )


u = convert(str(base), str(d / "u"), ConvertOptions(num_streams=3, stream_layers=2))
m0, tok = load(str(u), warn=False)
t0 = tau(m0, tok)
cfg = TrainConfig(
    mode="shared",
    num_streams=3,
    stream_layers=2,
    lora_rank=16,
    iters=120,
    batch_size=8,
    learning_rate=3e-3,
    stream_positions=32,
    steps_per_report=10,
    steps_per_eval=1000,
)
res = train(str(base), str(d / "data"), str(d / "out"), cfg, progress=False, log=lambda s: None)
m1, tok = load(str(d / "out"), warn=False)
t1 = tau(m1, tok)
print(
    json.dumps(
        {
            "tau_before": t0,
            "tau_after": t1,
            "acc_first_report": res.history[0]["stream_acc"],
            "val_acc_after": res.val["stream_acc"],
            "tok_s": res.tokens_per_second,
            "peak_gb": res.peak_memory_gb,
        }
    )
)
