"""Sampling from a `LanguageModel`: a prefill over the prompt, then a `fori_loop` of decode steps, all in one jit.

Shapes: B batch, P prompt length, N new tokens, Vocab vocabulary size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def sample(logits, rng, *, temperature=1.0, top_k=0, top_p=1.0):
  """One token per row from logits [B, Vocab] -> int32 [B]. temperature 0 is greedy (argmax); top_k 0 and
  top_p 1 disable those filters. All three may be traced values, so changing them does not recompile."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  temperature = jnp.asarray(temperature, jnp.float32)
  # The division is kept finite at temperature 0; that row's sample is discarded for the argmax below.
  scaled = logits / jnp.maximum(temperature, 1e-6)
  B, Vocab = logits.shape
  # Filters by rank, not by value, so that tied logits at a cut-off do not all survive: top_k keeps exactly k
  # tokens (ties go to the lower id), top_p the smallest prefix of the sorted distribution whose mass reaches
  # top_p (at least one token).
  order = jnp.argsort(-scaled, axis=-1, stable=True)  # [B, Vocab]: token ids, most likely first
  sorted_desc = jnp.take_along_axis(scaled, order, axis=-1)
  position = jax.lax.broadcasted_iota(jnp.int32, (B, Vocab), 1)
  top_k = jnp.asarray(top_k, jnp.int32)
  in_k = position < jnp.where(top_k > 0, top_k, Vocab)
  probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  kept = jnp.sum(in_k & (mass_before < jnp.asarray(top_p, jnp.float32)), axis=-1, keepdims=True)  # a prefix
  rank = jnp.zeros((B, Vocab), jnp.int32).at[jnp.arange(B)[:, None], order].set(position)
  scaled = jnp.where(rank < kept, scaled, -jnp.inf)
  sampled = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)


@nnx.jit(static_argnames=("max_new_tokens",))
def _generate(model, prompt, rng, temperature, top_k, top_p, *, max_new_tokens: int):
  B, P = prompt.shape
  cache = model.init_cache(B, P + max_new_tokens)
  logits, cache = model.prefill(prompt, cache)
  rng, sub = jax.random.split(rng)
  tok = sample(logits[:, -1], sub, temperature=temperature, top_k=top_k, top_p=top_p)
  out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(tok)

  def body(i, carry):
    tok, cache, rng, out = carry
    logits, cache = model.decode_step(tok[:, None], cache)
    rng, sub = jax.random.split(rng)
    tok = sample(logits[:, -1], sub, temperature=temperature, top_k=top_k, top_p=top_p)
    return tok, cache, rng, out.at[:, i].set(tok)

  _, _, _, out = jax.lax.fori_loop(1, max_new_tokens, body, (tok, cache, rng, out))
  return jnp.concatenate([prompt.astype(jnp.int32), out], axis=1)


def generate(model, prompt, max_new_tokens: int, *, rng, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0):
  """prompt int [B, P] -> int32 [B, P + max_new_tokens]: the prompt followed by the sampled tokens.

  Compiles once per (model structure, B, P, max_new_tokens); the sampling settings are traced values.
  Dropout is off while decoding whatever the model's mode. rng may be None for greedy decoding.
  `gdn.model.for_decoding(model)` decodes with leaner steps (its logits equal the model's to float32 rounding).
  """
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must be an integer array [B, P] with P >= 1, got {prompt.dtype} {prompt.shape}")
  Vocab = model.cfg.vocab_size
  if not isinstance(prompt, jax.core.Tracer) and not bool(jnp.all((prompt >= 0) & (prompt < Vocab))):
    # Out of range, the embedding gather would read NaN and every sampled token would be 0, silently.
    raise ValueError(f"prompt holds token ids outside the model's vocabulary [0, {Vocab}): min "
                     f"{int(prompt.min())}, max {int(prompt.max())}")
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0, got {top_k}")
  if rng is None:
    if temperature > 0:
      raise ValueError("rng is required when temperature > 0 (sampling); pass jax.random.key(...)")
    rng = jax.random.key(0)
  return _generate(model, prompt, rng, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   max_new_tokens=max_new_tokens)
