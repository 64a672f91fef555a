"""Training: optimizer, train step, checkpoints, evaluation, metrics and the loop."""

from gdn.train.config import ConfigError, ExperimentConfig, SweepConfig, TrainConfig, from_dict
from gdn.train.loop import NonFiniteLoss, train

__all__ = ["ConfigError", "ExperimentConfig", "NonFiniteLoss", "SweepConfig", "TrainConfig", "from_dict", "train"]
