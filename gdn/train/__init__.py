"""Training: optimizer, train step, checkpoints, evaluation, metrics and the loop."""

from gdn.train.config import ConfigError, ExperimentConfig, SweepConfig, TrainConfig, from_dict
from gdn.train.loop import train

__all__ = ["ConfigError", "ExperimentConfig", "SweepConfig", "TrainConfig", "from_dict", "train"]
