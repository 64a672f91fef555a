"""Training throughput: the FLOP count of a model's train step, and the timing of any step function.

Shapes: B batch, T sequence length, D d_model, Vocab vocabulary size, H heads, E attention head dim, K / V the
recurrent key / value head dims, C chunk size.
"""

from __future__ import annotations

import statistics
import time

import jax
from flax import nnx

from gdn.config import ModelConfig

# The H200's dense bfloat16 peak (the H100 / H200 SXM data sheet figure), the denominator of MFU here.
H200_BF16_TFLOPS = 989.0


def param_count(cfg: ModelConfig) -> int:
  """Parameters of `LanguageModel(cfg)`, from an abstract init (nothing is allocated)."""
  from gdn.model import LanguageModel

  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


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
  a, r = cfg.attention, cfg.recurrent
  C, K, V = chunk_size, r.head_dim, r.V
  mixing = 0.0
  for kind in cfg.layer_kinds:
    if kind == "recurrent":
      mixing += 3 * r.HV * (2 * C * (3 * K + 2 * V) + 6 * K * V + 2 * C * C / 3)
    else:
      span = min(a.window, T) if kind == "sliding_window" else T
      mixing += 3 * 2 * span * a.num_heads * a.head_dim
  return dict(matmul=6.0 * n, mixing=mixing, total=6.0 * n + mixing, params=n + embed * (not cfg.tie_embeddings))


def time_steps(step, sync, *, warmup: int, steps: int) -> dict:
  """Runs `step()` warmup times untimed (the first may compile), then `steps` times, each followed by `sync()`
  (waiting until its results are ready). Returns first_s (the first call, compile included) and the median and
  all step times in ms."""
  if warmup < 1 or steps < 1:
    raise ValueError(f"warmup and steps must be >= 1, got warmup={warmup}, steps={steps}")
  t0 = time.perf_counter()
  step()
  sync()
  first_s = time.perf_counter() - t0
  for _ in range(warmup - 1):
    step()
  sync()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    step()
    sync()
    times.append(1e3 * (time.perf_counter() - t0))
  return dict(first_s=first_s, step_ms=statistics.median(times), times_ms=times)


def peak_bytes(device=None):
  """The allocator's peak bytes on a device since the process started, where the backend reports it (GPUs,
  not the CPU); None otherwise."""
  stats = (device or jax.devices()[0]).memory_stats() or {}
  return stats.get("peak_bytes_in_use")
