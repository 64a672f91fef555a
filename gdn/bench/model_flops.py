"""The FLOP count of a whole model's training step, per token, and the peak that MFU divides by.

Shapes: B batch, T sequence length, D d_model, Vocab vocabulary size, H heads, E attention head dim, K / V the
recurrent key / value head dims, C chunk size.
"""

from __future__ import annotations

import collections

import jax
from flax import nnx

from gdn.config import ModelConfig
from gdn.model import Block

# The H200's dense bfloat16 peak (the H100 / H200 SXM data sheet figure), the denominator of MFU here.
H200_BF16_TFLOPS = 989.0


def _params(module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def param_count(cfg: ModelConfig) -> int:
  """Parameters of `LanguageModel(cfg)`, from abstract inits (nothing is allocated): the embedding, the final norm
  and an untied head, and one block of each (layer kind, MLP kind), since every such block has the same parameters
  wherever it stands (tests/test_lm_configs.py checks the sum against the whole model's)."""
  n = cfg.vocab_size * cfg.d_model + cfg.d_model + (0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size)
  for (kind, mlp_kind), m in collections.Counter(zip(cfg.layer_kinds, cfg.mlp_kinds)).items():
    n += m * _params(nnx.eval_shape(lambda: Block(cfg, kind, rngs=nnx.Rngs(0), mlp_kind=mlp_kind)))
  return n


def train_flops_per_token(cfg: ModelConfig, seq_len: int, *, chunk_size: int = 64) -> dict:
  """FLOP of one training step (forward + backward) per token, counted as follows.

  matmul: 6 N, N the parameters that multiply activations: all of them but the input embedding table (the
    tied head multiplies by it once more), norms, biases, convs and decay parameters included (a few 0.1%).
  attention: causal QK^T and PV, 2 T H E per token forward (half of the full 4 T H E), x3 for the backward.
    A sliding window W counts 2 min(W, T) H E.
  recurrent (the chunked gated delta rule, per head and token, forward): 2 C (3 K + 2 V) inside the chunk
    (K K^T, Q K^T, W, U, P U), 6 K V across chunks (W S, Q S, the state update), 2 C^2 / 3 for the triangular
    inverse; x3 for the backward, as gdn's op benchmark counts it.
  """
  D, Vocab, T = cfg.d_model, cfg.vocab_size, seq_len
  embed = Vocab * D
  n = param_count(cfg) - embed + (embed if cfg.tie_embeddings else 0)
  a, C = cfg.attention, chunk_size
  mixing = 0.0
  for kind in cfg.layer_kinds:
    if kind in ("recurrent", "mamba2"):
      r = cfg.mixer_config(kind)
      K, V = r.head_dim, r.V
      mixing += 3 * r.HV * (2 * C * (3 * K + 2 * V) + 6 * K * V + 2 * C * C / 3)
    else:
      span = min(a.window, T) if kind == "sliding_window" else T
      mixing += 3 * 2 * span * a.num_heads * a.head_dim
  return dict(matmul=6.0 * n, mixing=mixing, total=6.0 * n + mixing, params=n + embed * (not cfg.tie_embeddings))
