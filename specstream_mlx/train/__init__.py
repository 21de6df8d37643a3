"""Training speculative streams, in MLX: the objective (:mod:`.objective`), the
loop (:mod:`.trainer`), checkpoints and output (:mod:`.checkpoint`), data
(:mod:`.data`, :mod:`.sharegpt`). Depends on ``models``, ``method`` and ``io`` only."""

from .config import TrainConfig, TrainError, TrainResult
from .trainer import train

__all__ = ["TrainConfig", "TrainError", "TrainResult", "train"]
