"""Load an MLX model directory (ours or mlx-lm's) into our model classes.

:func:`load_model_dir` returns a :class:`LoadedModel`: the base model, its
speculative streams (or None), the directory and its tokenizer. Bundled demo
models are found by name whether the package runs from a checkout or was
installed with pip (they ship as package data, ``specstream_mlx.bundled``).
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..method.streams import StreamParams, load_streams, one_line_mismatch
from ..models import UnsupportedModelError, build_model
from .limits import (
    MAX_TEMPLATE_CHARS,
    UnsafeFileError,
    check_against_shapes,
    check_bounds,
    check_directory_files,
    read_json,
    safetensors_shapes,
)
from .quantization import QuantizationConfigError, apply_quantization, cast_floating, dequantize_model  # noqa: F401


class ModelLoadError(RuntimeError):
    pass


def bundled_models_dir() -> Path:
    """Where the bundled demo models are: the package data ``specstream_mlx.bundled``
    (the repository's top-level ``models/`` folder, installed or editable)."""
    import importlib.util

    spec = importlib.util.find_spec("specstream_mlx.bundled")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    # A checkout used without installing (PYTHONPATH=.): the folder itself.
    return Path(__file__).resolve().parent.parent.parent / "models"


def resolve_model_path(name_or_path: str) -> Path:
    """A local directory, a bundled model name, or a Hugging Face hub id."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    bundled = bundled_models_dir() / name_or_path
    if "/" not in name_or_path and (bundled / "bundle.json").is_file():
        from .bundles import BundleError, materialize, read_bundle

        try:
            return materialize(read_bundle(bundled))
        except BundleError as e:
            raise ModelLoadError(str(e)) from e
    if "/" not in name_or_path and bundled.is_dir():
        return bundled
    if p.exists():
        raise ModelLoadError(f"{p}: not a model directory")
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(
                snapshot_download(
                    name_or_path,
                    allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"],
                )
            )
        except Exception as e:  # network, auth and missing-repo errors alike
            raise ModelLoadError(f"cannot download {name_or_path!r} from the hub: {e}") from e
    raise ModelLoadError(f"{name_or_path}: no such model directory")


# Fields every supported architecture needs, and their kinds.
_REQUIRED_INTS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_config(config: Any, cfg_path: Path) -> Dict[str, Any]:
    """``config`` if it describes a model we can build; else ModelLoadError naming the field."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_path}: must be a JSON object, got {type(config).__name__}")
    if "model_type" not in config:
        raise ModelLoadError(f"{cfg_path}: missing 'model_type'")
    for key in _REQUIRED_INTS:
        if key not in config:
            raise ModelLoadError(f"{cfg_path}: missing '{key}'")
    for key in _REQUIRED_INTS + _OPTIONAL_INTS:
        v = config.get(key)
        if v is not None and not (_is_int(v) and v > 0):
            raise ModelLoadError(f"{cfg_path}: '{key}' must be a positive integer, got {v!r}")
    for key in _OPTIONAL_NUMBERS:
        v = config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ModelLoadError(f"{cfg_path}: '{key}' must be a number, got {v!r}")
    for key in ("rope_scaling", "rope_parameters", "quantization"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ModelLoadError(f"{cfg_path}: '{key}' must be an object, got {config[key]!r}")
    try:
        check_bounds(config, cfg_path)
    except UnsafeFileError as e:
        raise ModelLoadError(str(e)) from None
    return config


def load_config(path: Path) -> Dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists() and not cfg_path.is_symlink():
        raise ModelLoadError(f"{cfg_path}: missing config.json")
    try:
        return check_config(read_json(cfg_path, root=Path(path)), cfg_path)
    except UnsafeFileError as e:
        raise ModelLoadError(str(e)) from None


def weight_files(path: Path) -> list:
    """The ``model*.safetensors`` of a directory (else every ``*.safetensors`` but the streams')."""
    files = sorted(glob.glob(str(Path(path) / "model*.safetensors")))
    if not files:
        files = [
            f
            for f in sorted(glob.glob(str(Path(path) / "*.safetensors")))
            if not os.path.basename(f).startswith("streams")
        ]
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    return files


def check_weight_shapes(path: Path, config: Dict[str, Any]) -> None:
    """``config.json`` agrees with the weights' headers: refused before any layer is built."""
    shapes: Dict[str, tuple] = {}
    try:
        for f in weight_files(path):
            shapes.update(safetensors_shapes(Path(f)))
        check_against_shapes(config, shapes, Path(path) / "config.json")
    except UnsafeFileError as e:
        raise ModelLoadError(str(e)) from None


def load_weights(path: Path) -> Dict[str, mx.array]:
    """All ``model*.safetensors`` of a directory (streams.safetensors excluded)."""
    files = weight_files(path)
    weights: Dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError on corrupt files
            raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from e
    return weights


def compute_dtype_for_device() -> Optional[mx.Dtype]:
    """float32 on the CPU backend (no half-precision BLAS on x86; docs/DESIGN.md §2.13),
    otherwise None: keep the stored dtype (the fast path on a GPU)."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return None


def dequantize_on_cpu() -> bool:
    """Whether quantized weights are expanded at load: on MLX's CPU backend a 4-bit
    ``quantized_matmul`` costs several float32 matmuls and grows linearly with rows,
    which is what verifying a draft tree needs; elsewhere they stay quantized."""
    return mx.default_device() == mx.cpu


def load_model(
    path: Path, dtype: Optional[mx.Dtype] = "auto", lazy: bool = False, dequantize: Optional[bool] = None
) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model for ``config.json`` and load its weights strictly.

    Args:
        path: model directory.
        dtype: "auto" (float32 on CPU, stored dtype elsewhere), None (stored) or a dtype.
        lazy: leave parameters unevaluated.
        dequantize: expand quantized weights to float32; None (default) does so on
            the CPU backend only (see :func:`dequantize_on_cpu`), with a note on stderr.
    """
    path = Path(path)
    try:
        check_directory_files(path)
    except UnsafeFileError as e:
        raise ModelLoadError(str(e)) from None
    config = load_config(path)
    check_weight_shapes(path, config)
    try:
        model = build_model(config)
    except (TypeError, KeyError, ValueError) as e:
        if isinstance(e, UnsupportedModelError):
            raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
        raise ModelLoadError(f"{path / 'config.json'}: cannot build the model ({e})") from e
    weights = load_weights(path)
    weights = model.sanitize(weights)
    try:
        apply_quantization(model, config, weights, path / "config.json")
    except QuantizationConfigError as e:
        raise ModelLoadError(str(e)) from e
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: weights do not match config.json ({one_line_mismatch(str(e))})") from e
    if config.get("quantization") and (dequantize_on_cpu() if dequantize is None else dequantize):
        added = dequantize_model(model)
        if dequantize is None:
            q = config["quantization"]
            print(
                f"specstream-mlx: {path.name}: {q.get('bits')}-bit weights dequantized to float32 for the CPU "
                f"backend (+{added / 1e6:,.0f} MB; quantized matmuls are several times slower there)",
                file=sys.stderr,
            )
    if dtype == "auto":
        dtype = compute_dtype_for_device()
    if dtype is not None:
        cast_floating(model, dtype)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, config


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer(path: Path):
    """The directory's tokenizer (streaming detokenizer, chat template, EOS ids): a
    :class:`~.fast_tokenizer.FastTokenizer` where it reproduces transformers' exactly (a
    plain ``tokenizer.json``), else mlx-lm's TokenizerWrapper."""
    path = Path(path)
    if not any((path / f).exists() for f in TOKENIZER_MARKERS):
        raise ModelLoadError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_MARKERS)})")
    eos = None
    cfg = path / "config.json"
    tok_cfg = path / "tokenizer_config.json"
    try:
        check_directory_files(path)
        config = read_json(cfg) if cfg.exists() else {}
        tok_config = read_json(tok_cfg) if tok_cfg.exists() else {}
    except UnsafeFileError as e:
        raise ModelLoadError(str(e)) from None
    if isinstance(config, dict):
        e = config.get("eos_token_id")
        eos = [e] if _is_int(e) else [x for x in e if _is_int(x)] if isinstance(e, list) else None
    if tok_cfg.exists():
        if not isinstance(tok_config, dict):
            raise ModelLoadError(f"{tok_cfg}: must be a JSON object")
        template = tok_config.get("chat_template")
        if isinstance(template, str) and len(template) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(
                f"{tok_cfg}: a chat template of {len(template):,} characters, over the limit of {MAX_TEMPLATE_CHARS:,}"
            )
        if "auto_map" in tok_config:
            raise ModelLoadError(
                f"{tok_cfg}: 'auto_map' asks to run Python code shipped with the model; specstream-mlx never "
                "runs a model's own code (remove 'auto_map' if the tokenizer works without it)"
            )
    from .fast_tokenizer import FastTokenizer, can_serve

    if isinstance(tok_config, dict) and can_serve(path, tok_config):
        # tokenizer.json as it is: read directly, without importing transformers (seconds).
        try:
            tok = FastTokenizer(path, tok_config, eos)
        except Exception as e:  # tokenizers raises on corrupt files
            raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
        _check_template_size(path, tok)
        return tok
    from mlx_lm.tokenizer_utils import load as _load_tok

    try:
        # Never run code from a model directory, and never ask on stdin (it may be a protocol).
        tok = _load_tok(path, tokenizer_config_extra={"trust_remote_code": False}, eos_token_ids=eos)
    except Exception as e:  # tokenizers/transformers raise many kinds on corrupt files
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    _check_template_size(path, tok)
    return tok


def _check_template_size(path: Path, tok) -> None:
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and len(template) > MAX_TEMPLATE_CHARS:
        raise ModelLoadError(
            f"{path}: a chat template of {len(template):,} characters, over the limit of {MAX_TEMPLATE_CHARS:,}"
        )


@dataclass
class LoadedModel:
    """What a model directory holds, loaded.

    Attributes:
        model: the base causal LM (our :class:`~specstream_mlx.models.base.Model`).
        streams: its speculative streams, or None when it has none.
        path: the directory it was loaded from.
        config: its ``config.json``.
        tokenizer: mlx-lm's TokenizerWrapper.
    """

    model: nn.Module
    streams: Optional[StreamParams]
    path: Path
    config: Dict[str, Any]
    tokenizer: Any


def load_model_dir(path_or_name: str, dtype="auto", lazy: bool = False, warn: bool = True) -> LoadedModel:
    """Load a model directory, bundled name or hub id with its streams and tokenizer."""
    path = resolve_model_path(path_or_name)
    model, config = load_model(path, dtype=dtype, lazy=lazy)
    try:
        streams = load_streams(model, path, warn=warn)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    if streams is not None and streams.config.base_fingerprint is not None:
        from .fingerprint import base_fingerprint

        found = base_fingerprint(path)
        if found != streams.config.base_fingerprint:
            raise ModelLoadError(
                f"{path / 'specstream.json'}: these streams were trained on base {streams.config.base_fingerprint}, "
                f"but this directory's base weights are {found}; refusing to attach them to a different base"
            )
    return LoadedModel(model, streams, path, config, load_tokenizer(path))
