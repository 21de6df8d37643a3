"""``specstream-mlx export``: an MLX model with streams -> Hugging Face layout.

Writes ``config.json`` (with ``speculative_streaming``), ``model.safetensors``
holding the base weights under their HF names, ``speculative_streaming.safetensors``
holding the stream tensors under ``speculative_streaming.*`` (see :mod:`.hf_layout`),
and the tokenizer files. transformers and mlx-lm load the base as is. PyTorch trainers can produce the same layout, and
``specstream-mlx convert`` imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from specstream_mlx.io.files import atomic_directory, check_replaceable, check_writable, copy_tokenizer_files
from specstream_mlx.io.fingerprint import weights_fingerprint
from specstream_mlx.io.loading import ModelLoadError, load_config, load_model, resolve_model_path
from specstream_mlx.io.quantization import cast_floating
from specstream_mlx.method.streams import load_streams

from .converter import ConvertError
from .hf_layout import CONFIG_KEY, STREAMS_FILE, streams_to_hf


def export_hf(model_path: str, hf_path: str, force: bool = False, log=lambda s: None) -> Path:
    dst = Path(hf_path).expanduser()
    try:
        src = resolve_model_path(model_path)
        config = load_config(src)
    except ModelLoadError as e:
        raise ConvertError(str(e)) from e
    check_replaceable(dst, force, ConvertError)  # before the load: a path it cannot write costs nothing
    check_writable(dst, ConvertError)
    # The Hugging Face layout holds no MLX quantization: a quantized model is written as the
    # float32 weights its quantized ones stand for (expanded exactly, as the CPU backend
    # decodes them), so that transformers, mlx-lm and `convert` read it as it decodes here.
    quantization = config.get("quantization")
    try:
        model, _ = load_model(src, dtype=None, dequantize=bool(quantization))
    except ModelLoadError as e:
        raise ConvertError(str(e)) from e
    if quantization:
        cast_floating(model, mx.float32)
    streams = load_streams(model, src, warn=False)
    weights = dict(tree_flatten(model.parameters()))
    out_config = dict(config)
    if quantization:
        for key in ("quantization", "quantization_config"):
            out_config.pop(key, None)
        out_config["torch_dtype"] = "float32"
    stream_tensors = None
    if streams is not None:
        tensors, scfg = streams_to_hf(model, streams)
        dtype = model.model.norm.weight.dtype
        # Float tensors in the base's dtype; token ids (the draft vocabulary) stay integers.
        stream_tensors = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
        # In a file of their own, named from config.json: model.safetensors stays the
        # plain base that transformers and mlx-lm load without unexpected keys.
        out_config[CONFIG_KEY] = {**scfg, "weights_file": STREAMS_FILE}
    if out_config.get("tie_word_embeddings", True):
        weights.pop("lm_head.weight", None)
    if quantization and out_config.get(CONFIG_KEY, {}).get("base_fingerprint"):
        # The streams were trained on the weights written here (the quantized ones expanded),
        # stored in other bytes: they name those bytes now, so that the import attaches them.
        out_config[CONFIG_KEY]["base_fingerprint"] = weights_fingerprint(weights)
    with atomic_directory(dst, force, ConvertError) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "pt"})
        if stream_tensors is not None:
            mx.save_safetensors(str(tmp / STREAMS_FILE), stream_tensors, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True))
        copy_tokenizer_files(src, tmp)
    log(
        f"[export] wrote {dst}"
        + (f" with {streams.num_streams} streams" if streams else "")
        + (f" ({quantization.get('bits')}-bit weights expanded to float32)" if quantization else "")
    )
    return dst
