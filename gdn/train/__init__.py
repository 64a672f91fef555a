"""Training: optimizer, train step, checkpoints, evaluation, metrics, the loop, and stacked cells."""

from gdn.train.config import ConfigError, ExperimentConfig, SweepConfig, TrainConfig, from_dict
from gdn.train.load import load_run
from gdn.train.loop import NonFiniteLoss, train
from gdn.train.stacked import train_stacked

__all__ = ["ConfigError", "ExperimentConfig", "NonFiniteLoss", "SweepConfig", "TrainConfig", "from_dict", "load_run",
           "train", "train_stacked"]
