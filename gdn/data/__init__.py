"""Deterministic data, no downloads: synthetic recall and state-tracking tasks, local text."""

from gdn.data.pipeline import Split, Task, eval_batches, iterator
from gdn.data.tasks import DataConfig, make_task

__all__ = ["DataConfig", "Split", "Task", "eval_batches", "iterator", "make_task"]
