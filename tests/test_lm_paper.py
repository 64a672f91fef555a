"""The paper-size configs build at their real size (abstract init only) with the expected parameter counts,
and read token files. (Training through them is the scanned model's training: tests/test_scan_layers.py.)"""

import jax
import numpy as np
import pytest
from flax import nnx

from gdn.model import LanguageModel
from gdn.train.config_file import resolve

# Gated DeltaNet: equal to fla's GatedDeltaNetForCausalLM at the same config (hidden 1024 / 2048, 21 layers,
# 6 heads x 256, expand_v 2, hidden_ratio 4, untied, vocab 32000), counted with torch on the meta device.
PARAMS = {"gdn-340m": 512_272_124, "hybrid-340m": 470_142_144, "transformer-340m": 373_867_520,
          "gdn-1.3b": 1_387_348_732, "hybrid-1.3b": 1_345_157_312, "transformer-1.3b": 1_364_297_728}


@pytest.mark.parametrize("spec", sorted(PARAMS))
def test_builds_at_paper_size(spec):
  cfg = resolve(f"configs/lm_paper.py:{spec}")
  model = nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"{spec}: {n:,} parameters (the paper's {spec.split('-')[1].upper()} class)")
  assert n == PARAMS[spec]
  assert cfg.model.scan_layers and cfg.data.text.seq_len == 4096 and cfg.model.vocab_size == 32000
  assert cfg.data.batch_size * cfg.data.text.seq_len == 2**19  # 0.5M tokens a step


def test_bad_argument_names_the_choices():
  with pytest.raises(ValueError, match="MODEL-SIZE"):
    resolve("configs/lm_paper.py:gdn-7b")


def test_reads_token_files(tmp_path):
  from gdn.data import make_task

  tokens = np.random.default_rng(0).integers(0, 32000, size=50000).astype(np.uint16)
  for name in ("train", "val"):
    tokens.tofile(tmp_path / f"{name}.bin")
  cfg = resolve("configs/lm_paper.py:hybrid-1.3b", [f"data.text.train_file={tmp_path / 'train.bin'}",
                                                    f"data.text.val_file={tmp_path / 'val.bin'}",
                                                    "data.batch_size=2", "data.text.eval_examples=2"])
  batch = make_task(cfg.data, 0, 1).train[0]
  assert batch["inputs"].shape == (2, 4096) and batch["inputs"].max() < cfg.model.vocab_size
