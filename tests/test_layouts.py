"""What `method="pallas"`'s forward+backward moves between layouts, for bfloat16 inputs: no float32 array of o's size
or larger is transposed. (`chunk` moves its float32 per-chunk states to and from the front of its `lax.scan`.)

The chunked methods relayout q, k, v and o between [B, T, H, D] and per-chunk [B, H, N, C, D]; those transposes are
16-bit. Before the output was rounded where it is made (`chunk.outputs_in`) and the W/U products had their own
VJP (`intra_chunk._apply_lowp`), the op's VJP transposed float32 arrays of o's size and larger: the output, its
cotangent, dS_in and dP, and the solve's joint right-hand sides.
"""

import jax
import jax.numpy as jnp

from gdn import ops


def _transposes(jaxpr, acc):
  for e in jaxpr.eqns:
    if e.primitive.name == "transpose":
      acc.append(e.invars[0].aval)
    for p in e.params.values():
      inner = getattr(p, "jaxpr", None)
      if inner is not None:
        _transposes(inner if hasattr(inner, "eqns") else inner.jaxpr, acc)
  return acc


def test_no_float32_transposes():
  B, T, H, D = 1, 128, 2, 32
  ks = jax.random.split(jax.random.key(0), 5)
  q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in ks[:3])
  g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(jnp.bfloat16)

  def loss(q, k, v, g, beta):
    o, _ = ops.gated_delta_rule(q, k, v, g, beta, method="pallas", chunk_size=32)
    return jnp.sum(o.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta).jaxpr
  moved = _transposes(jaxpr, [])
  assert any(a.dtype == jnp.bfloat16 and a.size == B * T * H * D for a in moved)  # the relayouts are there
  big_f32 = [str(a) for a in moved if a.dtype == jnp.float32 and a.size >= B * T * H * D]
  assert not big_f32, big_f32
