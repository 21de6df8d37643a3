"""Model architectures, looked up by ``config.json``'s ``model_type``."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple, Type

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")


class UnsupportedModelError(ValueError):
    pass


def get_model_classes(config: Dict[str, Any]) -> Tuple[Type, Type]:
    """(Model class, ModelArgs class) for a config dict."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    module = importlib.import_module(f"{__name__}.{model_type}")
    return module.Model, module.ModelArgs


def build_model(config: Dict[str, Any]):
    """Instantiate the (randomly initialised) model a config describes."""
    model_cls, args_cls = get_model_classes(config)
    return model_cls(args_cls.from_dict(config))
