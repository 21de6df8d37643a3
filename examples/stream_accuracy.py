"""Teacher-forced top-1 accuracy of a model's streams on a data directory's valid split.

    .venv/bin/python examples/stream_accuracy.py smollm2 data/smol-replies [more data dirs]

On the model's own greedy replies (``specstream-mlx distill --temp 0``) stream j's
top-1 accuracy at a reply position is the chance that a chain draft's j-th token is
accepted once the tokens before it were: stream 1's figure is the acceptance rate of
a one-token draft, measured in one forward pass per reply instead of by decoding. On
human replies it is agreement with the human text. Prints the mean over the split's
batches (8 sequences, every reply position up to 512 tokens) of the training
objective's ``stream_acc``, computed by the PyTorch objective in float32 (the
``torch`` extra; run it without OpenBLAS preloaded, which slows PyTorch down).
"""

import sys
from pathlib import Path

from specstream_mlx.io.loading import load_model_dir, resolve_model_path
from specstream_mlx.train import TrainConfig
from specstream_mlx.train import torch_objective as tobj
from specstream_mlx.train.data import load_dataset
from specstream_mlx.train.loop import mean_metrics
from specstream_mlx.train.objective import Trainable
from specstream_mlx.train.torch_backend import _batch_tensors, hf_model_from_mlx, torch_trainable
from specstream_mlx.train.trainer import _adopt_existing_streams


def accuracy(loaded, data: Path) -> list:
    # The trainer's own rule for taking a model's stream settings (γ, layers, LoRA).
    cfg = TrainConfig(mode="lossless", stream_positions=512, max_seq_len=512, compile=False)
    _adopt_existing_streams(loaded.streams, cfg, log=lambda _: None)
    trainable = Trainable(loaded.model, cfg)
    trainable.streams.update(loaded.streams.parameters())
    _, valid, _ = load_dataset(data, loaded.tokenizer, cfg.max_seq_len)
    hf = hf_model_from_mlx(loaded.model, loaded.config)
    params = torch_trainable(trainable, cfg.lora_scale)
    s0 = len(loaded.model.layers) - cfg.stream_layers

    def metrics_of(batch) -> dict:
        return tobj.backward_segments(hf, params, cfg, _batch_tensors(batch, 0, 1), s0, train=False)

    return mean_metrics(valid, cfg, cfg.max_seq_len, 1 << 30, metrics_of)["stream_acc"]


def main() -> int:
    name, dirs = sys.argv[1], sys.argv[2:]
    loaded = load_model_dir(str(resolve_model_path(name)), warn=False)
    if loaded.streams is None:
        print(f"{name}: no streams", file=sys.stderr)
        return 1
    for d in dirs:
        acc = accuracy(loaded, Path(d))
        print(f"{name} on {d}/valid.jsonl: stream top-1 " + " / ".join(f"{a:.3f}" for a in acc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
