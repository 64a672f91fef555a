"""Whole causal language models between PyTorch checkpoints and our `LanguageModel`: the glue every source
shares (config.json, embeddings, block norms, dense MLPs, the final norm, the head, tensors left over). Each
source's own layer mapping lives in its module (`fla`, `qwen3_next`).

A checkpoint is read layer by layer (only the shards holding that layer are opened) and written as one
safetensors file with its config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Mapping

import numpy as np
from flax import nnx

from gdn.config import ModelConfig
from gdn.interop.state_dict import Tensors, assign, linear, read_safetensors, source_keys
from gdn.layers.mlp import hidden_size
from gdn.model import LanguageModel, unstack_layers

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def read_config(source, config):
  """`config` when given (a config object or its config.json dict), else the config.json beside the checkpoint."""
  if config is not None:
    return config
  if isinstance(source, (str, os.PathLike)):
    folder = os.fspath(source)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    path = os.path.join(folder, CONFIG_FILE)
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
  raise ValueError(f"config is needed: pass the model's config (a config object or its config.json dict); "
                   f"no {CONFIG_FILE} was found beside the checkpoint")


class Parts:
  """One layer's tensors (names relative to the layer), handed out by sub-module prefix as `Tensors`, so that
  `check` can name a tensor that no sub-module took."""

  def __init__(self, arrays: Mapping, prefix: str):
    self.arrays, self.prefix, self.used, self.handed = dict(arrays), prefix, [], []

  def tensors(self, sub: str) -> Tensors:
    self.used.append(sub)
    t = Tensors(self.arrays, sub, name=f"checkpoint layer {self.prefix!r}")
    t.prefix = self.prefix + sub  # errors name the full checkpoint key
    self.handed.append(t)
    return t

  def check(self) -> None:
    for t in self.handed:
      t.check_consumed()
    left = sorted(k for k in self.arrays if not any(k.startswith(u) for u in self.used))
    if left:
      raise ValueError(f"checkpoint tensors with no counterpart in our model: {[self.prefix + k for k in left]}")


def norm_params(t: Tensors, dim: int, *, plus_one: bool) -> dict:
  """RMSNorm weight; plus_one: the source scales by (1 + w) (Qwen3-Next), stored as our weight 1 + w."""
  w = t.take("weight", (dim,))
  return {"weight": 1.0 + w if plus_one else w}


def swiglu_params(t: Tensors, d_model: int, hidden: int, *, prefix: str = "") -> dict:
  """Our SwiGLU from torch's gate_proj / up_proj / down_proj under `prefix`: down(silu(gate(x)) * up(x))."""
  return {n: linear(t, prefix + n, *((hidden, d_model) if n == "down_proj" else (d_model, hidden)))
          for n in ("gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a source keeps the pieces of a causal LM. layer: the prefix of layer i as a format string."""
  embed: str
  final_norm: str
  layer: str
  plus_one: bool  # its RMSNorms scale by (1 + w)
  head: str = "lm_head.weight"
  ignore: tuple = ()  # key prefixes outside the causal LM (Qwen3-Next's multi-token-prediction head "mtp.")


def load(source, cfg: ModelConfig, layout: Layout, layer_params: Callable[[Parts, int], dict]) -> LanguageModel:
  """Our LanguageModel(cfg) filled from `source` (a mapping or a safetensors path): `layer_params(parts, i)` gives
  block i's {"mixer_norm", "mixer", "mlp_norm", "mlp"}; every tensor must find its place."""
  keys = source_keys(source)
  known = (layout.embed, layout.final_norm) + layout.ignore  # prefixes; the head is one exact key
  layers = tuple(layout.layer.format(i) for i in range(cfg.num_layers))
  left = [k for k in keys if k != layout.head and not k.startswith(known + layers)]  # before reading: fail fast
  if left:
    raise ValueError(f"checkpoint tensors with no counterpart in our model: {left[:20]}"
                     + (f" and {len(left) - 20} more" if len(left) > 20 else ""))
  V, D = cfg.vocab_size, cfg.d_model
  read = (lambda prefix: read_safetensors(source, prefix)) if isinstance(source, (str, os.PathLike)) else (
      lambda prefix: {k[len(prefix):]: v for k, v in source.items() if isinstance(k, str) and k.startswith(prefix)})

  def part(prefix):
    arrays = read(prefix)
    if not arrays:
      raise KeyError(f"checkpoint has no tensor {prefix + ('' if prefix.endswith('weight') else 'weight')!r}")
    t = Tensors(arrays, name="checkpoint")
    t.prefix = prefix  # errors name the full checkpoint key
    return t

  embed, final = part(layout.embed), part(layout.final_norm)
  params = {"embed": {"embedding": embed.take("weight", (V, D))},
            "final_norm": norm_params(final, D, plus_one=layout.plus_one), "blocks": {}}
  embed.check_consumed()
  final.check_consumed()
  for i in range(cfg.num_layers):
    prefix = layout.layer.format(i)
    parts = Parts(read(prefix), prefix)
    params["blocks"][i] = layer_params(parts, i)
    parts.check()
  if cfg.tie_embeddings:
    if layout.head in keys:
      head = part(layout.head).take("", (V, D))
      if not np.array_equal(head, params["embed"]["embedding"]):
        raise ValueError(f"the config ties the embeddings but {layout.head!r} differs from {layout.embed}weight")
  else:
    if layout.head not in keys:
      raise KeyError(f"checkpoint is missing {layout.head!r} (the config does not tie the embeddings)")
    params["lm_head"] = {"kernel": part(layout.head).take("", (V, D)).T}
  return assign(LanguageModel(cfg, rngs=nnx.Rngs(0)), params)


# Export: our LanguageModel as a checkpoint folder that the source's own class loads.

# Settings that change neither a model's weights nor its outputs (rematerialisation only trades memory for
# recomputation).
FREE = {"init_std", "dtype", "mlp_ratio", "method", "chunk_size", "local_groups", "dropout", "dt_init",
        "implementation", "remat"}


def unrolled(model: LanguageModel) -> LanguageModel:
  """`model` with one Block per layer, as checkpoints hold them: a scanned model (`scan_layers=True`) unstacked."""
  return unstack_layers(model) if model.cfg.scan_layers else model


def _settings(cfg: ModelConfig) -> dict:
  """The settings of `cfg` that change a model's weights or outputs, flattened to "recurrent.head_dim" etc.; the
  mixer and MLP configs only where some layer uses them."""
  # Defaults resolved: None value heads mean num_heads, and so on.
  rec, att = cfg.recurrent, cfg.attention
  cfg = dataclasses.replace(cfg, mlp_hidden=cfg.mlp_hidden or hidden_size(cfg.d_model, cfg.mlp_ratio),
                            recurrent=dataclasses.replace(rec, num_v_heads=rec.HV, v_head_dim=rec.V),
                            attention=dataclasses.replace(att, num_kv_heads=att.KVH))
  out = {}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    used = {"recurrent": "recurrent" in cfg.layer_kinds, "mamba2": "mamba2" in cfg.layer_kinds,
            "moe": "moe" in cfg.mlp_kinds,
            "attention": set(cfg.layer_kinds) - {"recurrent", "mamba2"}}.get(f.name, True)
    if f.name in FREE or not used:
      continue
    if dataclasses.is_dataclass(value):
      out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in dataclasses.fields(value)
                  if g.name not in FREE})
    else:
      out[f.name] = value
  out["pattern"], out["mlp_pattern"] = cfg.layer_kinds, cfg.mlp_kinds  # as expanded per layer
  return out


def check_representable(ours: ModelConfig, theirs: ModelConfig, target: str) -> None:
  """Raise naming every setting of `ours` that `theirs` (our config read back from the written config) lost."""
  a, b = _settings(ours), _settings(theirs)
  diff = sorted(k for k in set(a) | set(b) if a.get(k, "unused") != b.get(k, "unused"))
  if diff:
    raise ValueError(f"{target} cannot represent this model's " + "; ".join(
        f"{k}={a.get(k, 'unused')!r} (it would be {b.get(k, 'unused')!r})" for k in diff))


def params(model: LanguageModel) -> dict:
  """Our parameters as float32 NumPy, keyed by path tuples: ("blocks", 0, "mixer", "q_proj", "kernel")."""
  return {tuple(p): np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def save(path, tensors: dict, config: dict) -> None:
  """`tensors` (name -> NumPy) as one model.safetensors and `config` as config.json in folder `path`."""
  try:
    from safetensors.numpy import save_file
  except ImportError as e:
    raise ImportError("writing safetensors files needs the 'safetensors' package: pip install -e '.[interop]'") from e
  os.makedirs(path, exist_ok=True)
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE),
            metadata={"format": "pt"})
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def common_tensors(model: LanguageModel, p: dict, layout: Layout) -> dict:
  """Embeddings, final norm and (untied) head under the source's names."""
  minus = (lambda w: w - 1.0) if layout.plus_one else (lambda w: w)
  out = {layout.embed + "weight": p[("embed", "embedding")],
         layout.final_norm + "weight": minus(p[("final_norm", "weight")])}
  if not model.cfg.tie_embeddings:
    out[layout.head] = p[("lm_head", "kernel")].T
  return out


def swiglu_tensors(p: dict, path: tuple, prefix: str) -> dict:
  """torch's gate_proj / up_proj / down_proj weights of our SwiGLU at `path`."""
  return {f"{prefix}{n}.weight": p[path + (n, "kernel")].T for n in ("gate_proj", "up_proj", "down_proj")}


def linear_tensors(p: dict, path: tuple, name: str) -> dict:
  """torch nn.Linear weight (and bias if we have one) of our nnx.Linear at `path`."""
  out = {f"{name}.weight": p[path + ("kernel",)].T}
  if path + ("bias",) in p:
    out[f"{name}.bias"] = p[path + ("bias",)]
  return out
