"""The public gated delta rule: one dispatcher (`method=`) over pure implementations.

Shapes: B batch, T time, H q/k heads, HV value heads (a multiple of H), K key dim, V value dim.
"""

from __future__ import annotations

import jax

from gdn.ops import checks, intra_chunk
from gdn.ops.associative import associative
from gdn.ops.chunk import chunk
from gdn.ops.pallas_chunk import pallas
from gdn.ops.recurrent import recurrent

_IMPLS = {"recurrent": recurrent, "chunk": chunk, "associative": associative, "pallas": pallas}


def pick_method(dims: checks.Dims, chunk_size: int) -> str:
  """`method="auto"`: the token scan for a handful of tokens (decode). On a GPU, for sequences: the
  associative scan when the Pallas state pass would run fewer than 32 programs (B HV ceil(V / 64): most of the
  GPU's multiprocessors idle while each program walks all N chunks), else `pallas`; `chunk` for
  per-value-channel beta (`associative` declines it; `pallas` takes it but has not been timed on a GPU). On TPU
  the associative scan for small states (B HV K V <= 2^19), else `chunk`; on CPU `chunk`. docs/benchmarks.md has
  the H200 measurements behind both thresholds."""
  if dims.T <= 8:
    return "recurrent"
  backend = jax.default_backend()
  if backend == "cpu" or dims.beta_kind == "channel" or dims.T <= chunk_size:
    return "chunk"
  if backend == "gpu":
    programs = dims.B * dims.HV * -(-dims.V // 64)
    return "associative" if programs < 32 else "pallas"
  return "associative" if dims.B * dims.HV * dims.K * dims.V <= 2**19 else "chunk"


@checks.scoped("gated_delta_rule")
def gated_delta_rule(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None,
                     method="auto", chunk_size=64, local_groups=None, g_lower_bound=None):
  """The gated delta rule over a sequence. Per value head and time step, exactly:

    S   <- Diag(exp(g_t)) S                        # decay first: scalar or one factor per key row
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T    # delta rule on the decayed state (S + k_t v_t^T if beta is None)
    o_t  = S^T (scale * q_t)                       # scale defaults to K ** -0.5

  Args:
    q, k: [B, T, H, K]. v: [B, T, HV, V]; value head i reads q/k head i // (HV // H).
    g: None (no decay), [B, T, HV] (per head) or [B, T, HV, K] (per key channel): log of the decay.
    beta: None (plain additive write), [B, T, HV] or [B, T, HV, V]; values in [0, 2] are legal.
    initial_state: None or [B, HV, K, V]. segment_ids: None or [B, T] integers; the state restarts
      from zero wherever the id differs from the previous position's.
    method: "auto", "recurrent", "chunk", "associative" (not per-value-channel beta) or "pallas" (the chunk
      form with its sequential part as Pallas kernels, every variant). chunk_size: tokens per chunk.
    local_groups: the chunked methods run the backward of their chunk-local work over this many groups of
      chunks in turn, recomputing each group's forward, so that its float32 intermediates exist for one group
      at a time (less memory, the same values to float32 rounding); 1 = all chunks at once (XLA's autodiff);
      None = `intra_chunk.LOCAL_GROUPS` (1). The token scan ignores it.
    g_lower_bound: None, or a float in [-5, 0): the op computes the rule with max(g, g_lower_bound) (exactly
      the rule where g never goes below it, as a gate that bounds its output, fla's KDA `safe_gate`, keeps it),
      and with a per-key-channel g the chunked methods factor each chunk's pairwise decays through its
      16-step sub-chunks as matmuls (`intra_chunk._pair_channel_bounded`: one anchor a sub-chunk, where the
      exact form, `_pair_channel_dyadic`, needs log2(chunk_size) levels): 16 x 5 = 80 keeps e^80 inside
      float32's range, hence the -5.
  Returns:
    o [B, T, HV, V] in v's dtype, and the final state [B, HV, K, V] in float32.
  """
  dims = checks.check_sequence(q, k, v, g, beta, initial_state, segment_ids, scale, method, chunk_size)
  groups = intra_chunk.check_groups(local_groups)
  g, bound = intra_chunk.clamp_to_bound(g, g_lower_bound)
  if method == "auto":
    method = pick_method(dims, chunk_size)
  impl = _IMPLS[method]
  chunked = {} if method == "recurrent" else dict(local_groups=groups, g_lower_bound=bound)
  o, S = impl(q, k, v, g, beta, scale=checks.default_scale(scale, dims.K), initial_state=initial_state,
              segment_ids=segment_ids, dims=dims, chunk_size=chunk_size, **chunked)
  return o.astype(v.dtype), S
