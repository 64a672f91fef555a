"""The language-model ablation and hybrid configs: parameter-matched, the published layer arrangements, and a
budget that the no-repeat check holds to the corpus it is given."""

import collections
import copy
import functools
import json
import shutil

import pytest

from configs import base, lm_ablations, lm_hybrids
from gdn.bench.model_flops import param_count
from gdn.data import corpus, make_task
from gdn.sweep import expand
from gdn.train.config_file import apply_overrides

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


@functools.lru_cache(maxsize=None)
def _models(module, size):
  c = module.get_config(size)
  return c, {name: base.model_config(c, o) for name, o in c.sweep.models.items()}


@pytest.mark.parametrize("module, size, reference", [
    (lm_ablations, "small", "baseline"), (lm_ablations, "full", "baseline"),
    (lm_hybrids, "small", "gdn"), (lm_hybrids, "full", "gdn")])
def test_models_have_the_parameters_of_the_reference_within_half_a_rounding_step(module, size, reference):
  _, cfgs = _models(module, size)
  counts = {name: param_count(cfg) for name, cfg in cfgs.items()}  # one abstract init each (the slow part)
  target = counts[reference]
  for name, cfg in cfgs.items():
    # The MLP width moves in steps of 8, each 3 x d_model x 8 parameters per dense layer.
    step = 3 * cfg.d_model * cfg.num_layers * 8
    assert abs(counts[name] - target) <= step / 2, name
    if size == "full":
      assert abs(counts[name] - target) <= 0.005 * target, name


@pytest.mark.parametrize("overrides", [
    dict(pattern="RRRA"), dict(pattern="RWA", tie_embeddings=False), dict(pattern="MRW", scan_layers=True),
    dict(pattern="RA", mlp_pattern="DM", moe=dict(num_experts=4, top_k=2, hidden=24, shared_hidden=16))])
def test_param_count_is_the_whole_models(overrides):
  """`param_count` (one block per kind) equals the leaves of the whole model's abstract init: tied and untied
  heads, every layer kind, stacked layers, MoE and dense MLPs."""
  from flax import nnx

  from gdn.bench.model_flops import _params
  from gdn.config import ModelConfig
  from gdn.model import LanguageModel

  from gdn.config import AttentionConfig

  kw = dict(vocab_size=50, d_model=16, num_layers=6, mlp_ratio=2.0,
            attention=AttentionConfig(num_heads=2, head_dim=8, window=4))
  kw.update(overrides)
  if "moe" in kw:
    from gdn.config import MoEConfig
    kw["moe"] = MoEConfig(**kw["moe"])
  cfg = ModelConfig(**kw)
  assert param_count(cfg) == _params(nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0))))


def test_ablations_change_one_switch_each_from_the_baseline():
  _, cfgs = _models(lm_ablations, "small")
  b = cfgs["baseline"].recurrent
  assert (b.decay, b.beta, b.short_conv, b.output_gate, b.output_norm) == ("head", "head", True, "silu", True)
  assert cfgs["naive_delta_rule"].recurrent.decay == "none"
  assert not cfgs["no_short_conv"].recurrent.short_conv and cfgs["no_short_conv"].recurrent.silu_without_conv
  assert cfgs["no_output_gate"].recurrent.output_gate == "none"
  assert not cfgs["no_output_norm"].recurrent.output_norm
  for name, cfg in cfgs.items():
    r = cfg.recurrent
    assert r.num_heads * r.head_dim == cfg.d_model, name


def test_hybrids_have_the_published_layer_arrangements():
  _, cfgs = _models(lm_hybrids, "small")
  kinds = {n: collections.Counter(c.layer_kinds) for n, c in cfgs.items()}
  assert kinds["transformer"] == {"attention": 16} and kinds["gdn"] == {"recurrent": 16}
  assert kinds["gdn_h1"] == {"recurrent": 8, "sliding_window": 8}
  assert cfgs["gdn_h2"].layer_kinds[:3] == ("mamba2", "recurrent", "sliding_window")
  assert kinds["gdn_h2"] == {"mamba2": 5, "recurrent": 5, "sliding_window": 5}
  assert cfgs["gdn_h2"].mamba2.beta == "none" and cfgs["gdn_h2"].recurrent.beta == "head"
  for name, ratio in (("kda_1to1", 1), ("kda_3to1", 3), ("kda_7to1", 7), ("kda_15to1", 15)):
    assert kinds[name] == {"recurrent": 16 * ratio // (ratio + 1), "attention": 16 // (ratio + 1)}, name
    assert cfgs[name].recurrent.decay == "channel", name  # KDA
  assert cfgs["gdn_h1"].attention.window == 64  # half the training length, as the paper's 2K of 4K


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
  out = tmp_path_factory.mktemp("pycode_small")
  corpus.build(str(out), roots=("stdlib",), max_bytes=4_000_000)  # as configs.base.CORPUS["small"]
  return out


def _with_corpus(config, out):
  return apply_overrides(copy.deepcopy(config), (f"data.text.train_file={out}/train.bin", f"data.text.val_file={out}/val.bin"))


def test_small_configs_fit_the_small_corpus_and_report_bits_per_byte(small_corpus):
  for module in (lm_ablations, lm_hybrids):
    cell = expand(_with_corpus(_models(module, "small")[0], small_corpus), results="/nonexistent")[0]
    task = make_task(cell.config.data, cell.config.seed, cell.config.train.steps)
    assert task.bits_per_token and cell.config.sweep.metric == "bits_per_byte"


def test_the_full_budget_is_refused_on_a_corpus_too_small_for_it(small_corpus):
  cell = expand(_with_corpus(_models(lm_ablations, "full")[0], small_corpus), results="/nonexistent")[0]
  with pytest.raises(ValueError, match=r"config.train.steps \(or stop_step\) 2000 x config.data.batch_size 64"):
    make_task(cell.config.data, cell.config.seed, cell.config.train.steps)


def test_a_run_records_the_corpus_digests_and_resumes_on_that_corpus_only(small_corpus, tmp_path):
  """The summary names the corpus build; the checkpoints remember it, and a relaunch whose train file is now
  another build (gdn-corpus rerun in a changed installation) is refused before anything is trained."""
  from gdn.train import from_dict, train  # noqa: PLC0415
  from gdn.train.checkpoint import ConfigMismatch  # noqa: PLC0415
  data = tmp_path / "pycode"
  shutil.copytree(small_corpus, data)
  c = _with_corpus(_models(lm_ablations, "small")[0], data)
  apply_overrides(c, ("train.steps=3", "train.warmup_steps=1", "train.eval_every=0", "train.checkpoint_every=3",
                      "train.progress_bar=false", "data.text.eval_examples=4", f"workdir={tmp_path / 'run'}"))
  summary = train(from_dict(c.to_dict()), log=lambda *a: None)
  manifest = (data / "manifest.json").read_text()
  sha = summary["corpus"]["train"]["sha256"]
  assert sha in manifest and summary["eval"]["bits_per_byte"] > 0
  assert json.loads((tmp_path / "run" / "corpus.json").read_text())["train"]["sha256"] == sha

  (tmp_path / "run" / "summary.json").unlink()  # as if stopped after its last checkpoint
  (data / "manifest.json").write_text(manifest.replace(sha, "0" * 64))
  with pytest.raises(ConfigMismatch, match=f"trained on the corpus whose train.bin has SHA-256 {sha[:12]} .* is "
                                           "now 000000000000"):
    train(from_dict(c.to_dict()), log=lambda *a: None)


def test_published_table_marks_agreement_ties_and_disagreement():
  from gdn.sweep import published  # noqa: PLC0415
  spec = dict(source="S", metric="ppl", reference="a", values=dict(a=10.0, b=11.0, c=9.0, d=10.01))
  around = lambda m: [m - 0.01, m, m + 0.01]  # seeds with a standard deviation of 0.01 (ddof 1)
  ours = dict(a=around(1.00), b=around(1.10), c=around(1.10), d=around(1.005))
  rows = {line.split(" | ")[0][2:]: line for line in published.table(spec, ours, "bits_per_byte")[4:]}
  assert rows["a"].endswith("(reference) |")
  assert "worse" in rows["b"] and rows["b"].endswith("| agrees |")
  assert "better" in rows["c"] and rows["c"].endswith("| **disagrees** |")
  assert "≈" in rows["d"] and rows["d"].endswith("| agrees |")  # 0.1% there, within two standard errors here


def test_published_table_gives_a_one_seed_model_the_pooled_noise_of_the_others():
  """A model with one seed is compared with the noise level pooled over the models with several (ddof 1):
  +0.01 against a per-seed spread of 0.01 is a tie, +0.05 a direction; with no model at two seeds there is no
  noise estimate and the table says so."""
  from gdn.sweep import published  # noqa: PLC0415
  spec = dict(source="S", metric="ppl", reference="a", values=dict(a=10.0, b=11.0, c=11.0))
  ours = dict(a=[0.99, 1.00, 1.01], b=[1.01], c=[1.05])
  assert published.pooled_std(ours) == pytest.approx((0.01, 2))
  rows = {line.split(" | ")[0][2:]: line for line in published.table(spec, ours, "bits_per_byte")[4:]}
  assert "+0.010 ≈" in rows["b"] and rows["b"].endswith("| tie on one side (one seed) |")
  assert "+0.050 worse" in rows["c"] and rows["c"].endswith("| agrees (one seed) |")
  lines = published.table(spec, dict(a=[1.0], b=[1.01], c=[1.05]), "bits_per_byte")
  assert "no noise estimate" in lines[0] and lines[-1].endswith("| agrees (no noise estimate) |")
