"""gdn: Gated DeltaNet in JAX/Flax."""

from gdn import ops

__version__ = "0.1.0"
