"""Speculative-streaming parameters in Hugging Face layout, and PEFT LoRA fusing.

A fine-tuned speculative-streaming checkpoint in Hugging Face layout is an
ordinary HF model directory whose ``config.json`` carries a
``speculative_streaming`` object and whose safetensors hold, besides the base
weights, these tensors (PyTorch ``nn.Linear`` conventions, ``weight`` is
``(out, in)``)::

    speculative_streaming.stream_embeddings                      (γ, hidden)
    speculative_streaming.lora.layers.<i>.<module>.lora_A.weight (r, in)
    speculative_streaming.lora.layers.<i>.<module>.lora_B.weight (out, r)
    speculative_streaming.pruning.down.weight                    (8, hidden)
    speculative_streaming.pruning.up.weight                      (hidden, 8)
    speculative_streaming.draft_vocab                            (N,) int32, optional

``<module>`` is the projection's path inside the decoder layer, e.g.
``self_attn.q_proj`` or ``mlp.down_proj``. The LoRA delta on a stream row x is
``scale * lora_B(lora_A(x))`` with ``scale`` from the config; the pruning
adapter is ``o(M) = M + up(down(M))``. ``config.json``::

    "speculative_streaming": {"num_streams": 4, "stream_layers": 4,
      "mode": "lossless", "lora": {"rank": 32, "scale": 2.0, "targets": [...]},
      "pruning": {"rank": 8, "threshold": 0.0}, "trained": true}
"""

from __future__ import annotations

from typing import Dict, Tuple

import mlx.core as mx

from specstream_mlx.method.streams import (
    DRAFT_VOCAB_KEY,
    StreamConfig,
    StreamParams,
    lora_key,
    one_line_mismatch,
    restore_draft_vocab,
)

PREFIX = "speculative_streaming."
CONFIG_KEY = "speculative_streaming"
# Where export puts the stream tensors (named by config.json's speculative_streaming.weights_file).
STREAMS_FILE = "speculative_streaming.safetensors"


def _module_path(layer, name: str) -> str:
    return ("self_attn." if name in layer.self_attn else "mlp.") + name


def streams_to_hf(model, streams: StreamParams) -> Tuple[Dict[str, mx.array], dict]:
    """(tensors, config object) of ``streams`` in the HF layout."""
    out = {PREFIX + "stream_embeddings": streams.embeddings}
    for key, mods in (streams.lora or {}).items():
        i = int(key[len("layer") :])
        layer = model.layers[i]
        for name, lora in mods.items():
            base = f"{PREFIX}lora.layers.{i}.{_module_path(layer, name)}"
            out[base + ".lora_A.weight"] = lora.a.T
            out[base + ".lora_B.weight"] = lora.b.T
    out[PREFIX + "pruning.down.weight"] = streams.pruning.down.T
    out[PREFIX + "pruning.up.weight"] = streams.pruning.up.T
    if streams.draft_vocab is not None:
        out[PREFIX + DRAFT_VOCAB_KEY] = streams.draft_vocab.ids
    return out, streams.config.to_json()


def split_stream_weights(weights: Dict[str, mx.array]):
    """(base weights, stream weights) of a checkpoint's tensors."""
    base = {k: v for k, v in weights.items() if not k.startswith(PREFIX)}
    streams = {k[len(PREFIX) :]: v for k, v in weights.items() if k.startswith(PREFIX)}
    return base, streams


def streams_from_hf(model, cfg_obj: dict, tensors: Dict[str, mx.array], where: str) -> StreamParams:
    """Build :class:`StreamParams` from HF-layout tensors (names without the prefix)."""
    cfg = StreamConfig.from_json(cfg_obj)
    sp = StreamParams(model, cfg)
    draft_ids = tensors.pop(DRAFT_VOCAB_KEY, None)
    mapped = {
        "embeddings": tensors.pop("stream_embeddings", None),
        "pruning.down": _t(tensors.pop("pruning.down.weight", None)),
        "pruning.up": _t(tensors.pop("pruning.up.weight", None)),
    }
    for k in list(tensors):
        if not k.startswith("lora.layers."):
            continue
        rest = k[len("lora.layers.") :]
        i, _, tail = rest.partition(".")
        module, _, which = tail.rpartition(".lora_")
        name = module.split(".")[-1]
        field = "a" if which.startswith("A") else "b"
        mapped[f"lora.{lora_key(int(i))}.{name}.{field}"] = _t(tensors.pop(k))
    if tensors:
        raise ValueError(f"{where}: unknown speculative_streaming tensors {sorted(tensors)[:3]}")
    missing = [k for k, v in mapped.items() if v is None]
    if missing:
        raise ValueError(f"{where}: missing speculative_streaming tensors {missing}")
    try:
        sp.load_weights(list(mapped.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"{where}: speculative_streaming tensors do not match the config ({one_line_mismatch(str(e))})"
        ) from e
    restore_draft_vocab(sp, model, draft_ids, where)
    return sp


def _t(x):
    return None if x is None else x.T
