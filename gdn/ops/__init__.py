"""The gated delta rule as pure functions of arrays (no Flax). `gdn.ops.stages`: the chunk pipeline's public stages."""

from gdn.ops.api import gated_delta_rule
from gdn.ops.context_parallel import context_parallel_gated_delta_rule
from gdn.ops.recurrent import gated_delta_rule_step

__all__ = ["gated_delta_rule", "gated_delta_rule_step", "context_parallel_gated_delta_rule"]
