"""Sweeps: a grid of runs from one config (models x settings x seeds x learning rates) and its report."""

from gdn.sweep import records
from gdn.sweep.grid import Cell, done, expand, groups, run_cells, shard_cells
from gdn.sweep.report import collect, write_report

__all__ = ["Cell", "collect", "done", "expand", "groups", "records", "run_cells", "shard_cells", "write_report"]
