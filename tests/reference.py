"""The float64 oracle: the seed's token loop in NumPy, one value head at a time.

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim.
"""

import numpy as np


def gated_delta_rule_ref(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None):
  """Returns (o [B, T, HV, V], final state [B, HV, K, V]) in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, K = q.shape
  HV, V = v.shape[2:]
  G = HV // H
  scale = K**-0.5 if scale is None else scale
  o = np.zeros((B, T, HV, V))
  S_all = np.zeros((B, HV, K, V)) if initial_state is None else np.array(initial_state, np.float64)
  for b in range(B):
    for h in range(HV):
      S = S_all[b, h].copy()
      for t in range(T):
        if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
          S = np.zeros_like(S)
        q_t, k_t, v_t = q[b, t, h // G], k[b, t, h // G], v[b, t, h]
        if g is not None:
          a = np.exp(np.asarray(g[b, t, h], np.float64))
          S = S * (a[:, None] if np.ndim(a) == 1 else a)
        if beta is None:
          u = v_t
        else:
          u = np.asarray(beta[b, t, h], np.float64) * (v_t - S.T @ k_t)
        S = S + np.outer(k_t, u)
        o[b, t, h] = S.T @ (scale * q_t)
      S_all[b, h] = S
  return o, S_all
