"""Flax NNX layers: norms, short convolution, SwiGLU, the recurrent mixer and softmax attention."""

from gdn.layers.attention import Attention, KVCache
from gdn.layers.conv import ShortConv
from gdn.layers.mlp import SwiGLU
from gdn.layers.norms import GatedRMSNorm, RMSNorm
from gdn.layers.recurrent import RecurrentCache, RecurrentMixer

__all__ = ["Attention", "GatedRMSNorm", "KVCache", "RMSNorm", "RecurrentCache", "RecurrentMixer", "ShortConv",
           "SwiGLU"]
