"""Every config file loads, converts to typed configs and builds its models and data; bad keys and values
fail with the key's name."""

import glob
import os

import pytest
from flax import nnx

from gdn.data import make_task
from gdn.model import LanguageModel
from gdn.sweep import expand, shard_cells
from gdn.train import ConfigError, from_dict
from gdn.train.config import to_dict
from gdn.train.config_file import apply_overrides, base_config, load, resolve, split_argv

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                      if os.path.basename(p) not in ("__init__.py", "base.py"))


LM_CONFIGS = ("lm_ablations.py", "lm_hybrids.py")


def _specs():
  for path in CONFIG_FILES:
    with open(path) as f:
      sized = "def get_config(size" in f.read()
    yield from ([f"{path}:small", path] if sized else [path])


@pytest.mark.parametrize("spec", list(_specs()), ids=lambda s: os.path.relpath(s, ROOT))
def test_config_file_builds(spec):
  config = load(spec)
  cells = expand(config, results="/nonexistent")
  assert cells
  # The language-model configs' models are built already by loading them (abstract inits of each block kind, to
  # match their parameter counts; tests/test_lm_configs.py checks that count against whole models); the rest here.
  built = set() if os.path.basename(spec.partition(":")[0]) not in LM_CONFIGS else {c.config.model for c in cells}
  for cell in cells:
    cfg = cell.config
    if cfg.model not in built:  # abstract init: checks every shape without allocating
      nnx.eval_shape(lambda: LanguageModel(cfg.model, rngs=nnx.Rngs(0)))
      built.add(cfg.model)
  data = cells[0].config.data
  # Token files are the user's to give, or gdn-corpus's to build (tests/test_lm_configs.py builds them)
  no_files = data.task == "tokens" and not os.path.isfile(data.text.train_file)
  if (spec.endswith(":small") or ":" not in os.path.basename(spec)) and not no_files:
    task = make_task(cells[0].config.data, 0, 2)
    batch = task.train[0]
    assert batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape
    assert task.vocab_size <= cells[0].config.model.vocab_size
    assert batch["inputs"].max() < cells[0].config.model.vocab_size


def test_base_declares_every_typed_field():
  cfg = from_dict(base_config().to_dict())
  assert cfg.model.pattern == "RRRA" and cfg.train.steps > 0


@pytest.mark.parametrize("override, needle", [
    ("model.d_modl=3", "config.model.d_modl"),
    ("train.stepz=3", "config.train.stepz"),
    ("nonsense.key=1", "config.nonsense"),
    ("model.d_model=abc", "config.model.d_model"),
    ("train.learning_rate=fast", "config.train.learning_rate"),
    ("model.tie_embeddings=maybe", "config.model.tie_embeddings"),
    ("data.mqar.train_settings=7", "config.data.mqar.train_settings"),
    ("model=3", "config.model"),
])
def test_unknown_key_or_unparsable_value_names_the_key(override, needle):
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
    apply_overrides(base_config(), [override])


@pytest.mark.parametrize("override, needle", [
    ("model.recurrent.decay=sometimes", "config.model.recurrent.decay"),
    ("model.pattern=RXA", "config.model.pattern"),
    ("train.steps=0", "config.train.steps"),
    ("train.warmup_steps=5000", "config.train.warmup_steps"),
    ("data.task=images", "config.data.task"),
    ("data.mqar.power_a=2.0", "config.data.mqar.power_a"),
    ("data.state.task=sorting", "config.data.state.task"),
    ("train.learning_rate=inf", "config.train.learning_rate"),
    ("train.learning_rate=nan", "config.train.learning_rate"),
    ("train.b2=1.0", "config.train.b2"),
    ("train.eps=0.0", "config.train.eps"),
    ("train.weight_decay=nan", "config.train.weight_decay"),
    ("model.init_std=0.0", "config.model.init_std"),
    ("model.norm_eps=-1e-6", "config.model.norm_eps"),
    ("model.recurrent.dropout=nan", "config.model.recurrent.dropout"),
    ("model.attention.rope_theta=inf", "config.model.attention.rope_theta"),
    ("model.recurrent.num_v_heads=abc", "config.model.recurrent.num_v_heads: expects an int or None"),
    ("model.mlp_hidden=wide", "config.model.mlp_hidden"),
    ("seed=-1", "config.seed"),
    ("name=", "config.name"),
    ("data.mqar.eval_examples=0", "config.data.mqar.eval_examples"),
    ("data.niah.eval_examples=0", "config.data.niah.eval_examples"),
    ("data.text.eval_examples=0", "config.data.text.eval_examples"),
])
def test_bad_value_names_the_key(override, needle):
  config = apply_overrides(base_config(), [override])
  with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
    from_dict(config.to_dict())


def test_command_line_error_is_clear(capsys):
  from experiments.train import main
  assert main(["--config", os.path.join(ROOT, "configs", "quickstart.py"), "--config.model.d_modle=64"]) == 2
  err = capsys.readouterr().err
  assert "unknown config key config.model.d_modle (did you mean config.model.d_model?)" in err


def test_overrides_parse_by_type():
  spec, overrides, rest = split_argv(["--config", "x.py:small", "--config.model.d_model=96", "--config.seed", "3",
                                      "--config.model.tie_embeddings=false", "--shard", "0/2"])
  assert (spec, rest) == ("x.py:small", ["--shard", "0/2"])
  cfg = resolve(os.path.join(ROOT, "configs", "quickstart.py"),
                overrides + ["data.mqar.eval_settings=((64, 4),)", "model.recurrent.num_v_heads=4"])
  assert cfg.model.d_model == 96 and cfg.seed == 3 and cfg.model.tie_embeddings is False
  assert cfg.data.mqar.eval_settings == ((64, 4),) and cfg.model.recurrent.num_v_heads == 4


def test_unknown_config_argument():
  with pytest.raises(ConfigError, match="small"):
    load(os.path.join(ROOT, "configs", "mqar.py") + ":tiny")


def test_a_config_file_that_cannot_be_read_is_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="cannot be read"):
    load(str(tmp_path / "missing.json"))
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ConfigError, match="not valid JSON"):
    load(str(tmp_path / "bad.json"))
  with pytest.raises(ConfigError, match="takes no argument"):
    load(os.path.join(ROOT, "configs", "quickstart.py") + ":small")


def test_sweep_models_do_not_inherit_the_base_models_switches():
  cells = expand(load(os.path.join(ROOT, "configs", "state_tracking.py") + ":small"), results="/nonexistent")
  assert {c.model for c in cells} == {"deltanet_beta01", "deltanet_beta02", "gated_deltanet_beta01",
                                      "gated_deltanet_beta02"}
  for c in cells:
    assert c.config.model.recurrent.allow_neg_eigval == c.model.endswith("beta02"), c.id
  by_model = {c.model: c.config.model for c in expand(load(os.path.join(ROOT, "configs", "mqar.py")),
                                                      results="/nonexistent")}
  assert by_model["linear_attention"].recurrent.decay == "none" and by_model["linear_attention"].recurrent.beta == "none"
  assert by_model["kda"].recurrent.decay == "channel" and by_model["attention"].pattern == "A"
  assert by_model["hybrid_3to1"].pattern == "RRRA" and by_model["hybrid_3to1"].num_layers == 4


def test_niah_has_the_hybrid_with_global_and_with_sliding_window_attention():
  """The S-NIAH grids have the 3:1 hybrid twice: global attention (RRRA) and the paper's kind, a window of half
  the training length (RRRW): 512 tokens in the full config, 32 in the small one."""
  by_model = {c.model: c.config.model for c in expand(load(os.path.join(ROOT, "configs", "niah.py")),
                                                      results="/nonexistent")}
  assert set(by_model) == {"attention", "deltanet", "mamba2", "gated_deltanet", "hybrid_3to1", "hybrid_3to1_swa"}
  assert by_model["hybrid_3to1"].pattern == "RRRA" and by_model["hybrid_3to1"].attention.window == 0
  swa = by_model["hybrid_3to1_swa"]
  assert swa.pattern == "RRRW" and swa.attention.window == 512 and swa.num_layers == 4
  assert swa.recurrent == by_model["hybrid_3to1"].recurrent
  small = {c.model: c.config.model for c in expand(load(os.path.join(ROOT, "configs", "niah.py") + ":small"),
                                                   results="/nonexistent")}
  assert set(small) == set(by_model)
  assert small["hybrid_3to1_swa"].pattern == "RRRW" and small["hybrid_3to1_swa"].attention.window == 32


def test_niah_sets_the_papers_numbers_beside_its_own_eval_splits():
  """The full config's published S-NIAH numbers name its eval splits (so the report's table beside the paper is
  not empty) and models of its grid, as fractions; the small config, at other lengths, has none."""
  from gdn.data.niah import NIAHConfig, eval_splits  # noqa: PLC0415

  config = load(os.path.join(ROOT, "configs", "niah.py"))
  by_split = config.sweep.published["gdn_sniah"]["by_split"]
  n = config.data.niah
  names = {s.name for s in eval_splits(NIAHConfig(**{k: n[k] for k in ("tasks", "eval_lengths")}), 0)}
  assert set(by_split) <= set(config.sweep.models) and set(by_split) == {"deltanet", "mamba2", "gated_deltanet"}
  assert all(set(v) <= names and all(0 <= x <= 1 for x in v.values()) for v in by_split.values())
  assert len(by_split["deltanet"]) == 11 and by_split["mamba2"]["sniah1_T8192"] == pytest.approx(0.304)
  assert not load(os.path.join(ROOT, "configs", "niah.py") + ":small").sweep.published


def test_a_presets_hyperparameter_and_the_sweeps_own_overrides():
  """The mamba2 preset's output-norm eps (1e-12) reaches its cells; a base-config eps reaches the other models'
  cells (the presets that do not set it leave it to the config) but not mamba2's; config.sweep.overrides, applied
  after each model's, reaches every cell."""
  spec = os.path.join(ROOT, "configs", "niah.py") + ":small"
  eps = lambda config: {c.model: c.config.model.recurrent.norm_eps for c in expand(config, results="/nonexistent")}
  assert eps(load(spec)) == {"attention": 1e-6, "deltanet": 1e-6, "mamba2": 1e-12, "gated_deltanet": 1e-6,
                             "hybrid_3to1": 1e-6, "hybrid_3to1_swa": 1e-6}
  on_base = eps(apply_overrides(load(spec), ["model.recurrent.norm_eps=1e-9"]))
  assert on_base.pop("mamba2") == 1e-12 and set(on_base.values()) == {1e-9}
  everywhere = eps(apply_overrides(load(spec), ["sweep.overrides=('model.recurrent.norm_eps=1e-6',)"]))
  assert set(everywhere.values()) == {1e-6}
  with pytest.raises(ConfigError, match="overrides"):
    from_dict(apply_overrides(load(spec), ["sweep.overrides=('model.recurrent.norm_eps',)"]).to_dict())


def test_shards_keep_seed_and_learning_rate_siblings_together():
  """--shard deals out (model, setting) groups, so the cells that share compiled programs run in one process;
  the shards together hold every cell exactly once."""
  cells = expand(load(os.path.join(ROOT, "configs", "state_tracking.py")), results="/nonexistent")
  shards = [shard_cells(cells, i, 5) for i in range(5)]
  assert sorted(c.id for s in shards for c in s) == sorted(c.id for c in cells)
  owner = {c.id: i for i, s in enumerate(shards) for c in s}
  for c in cells:  # 4 models x 3 tasks = 12 groups of 3 seeds x 4 learning rates
    siblings = [d for d in cells if (d.model, d.setting) == (c.model, c.setting)]
    assert len(siblings) == 12 and {owner[d.id] for d in siblings} == {owner[c.id]}
  assert [len(s) for s in shards] == [36, 36, 24, 24, 24]


def test_state_tracking_follows_grazzi_et_al():
  """Their appendix E.1: lengths 3-40 for training and 40-256 for testing, 2 layers for parity and 3 with
  clipping for modular arithmetic, d_model 128 in 4 heads, batch 1024, 100k steps, 3 seeds x 4 rates."""
  cells = expand(load(os.path.join(ROOT, "configs", "state_tracking.py")), results="/nonexistent")
  assert len(cells) == 4 * 3 * 3 * 4
  for c in cells:
    cfg = c.config
    assert cfg.data.state.task == c.setting and cfg.data.state.train_lengths == (3, 40)
    assert cfg.data.state.eval_lengths[0] == 40 and cfg.data.state.eval_lengths[-1] == 256
    assert (cfg.model.num_layers, cfg.train.grad_clip) == ((2, 0.0) if c.setting == "parity" else (3, 1.0))
    assert (cfg.model.d_model, cfg.model.recurrent.num_heads, cfg.model.recurrent.head_dim) == (128, 4, 32)
    assert (cfg.data.batch_size, cfg.train.steps, cfg.train.warmup_steps) == (1024, 100_000, 10_000)
    assert cfg.sweep.metric == "scaled_accuracy"
    assert cfg.model.dtype == "bfloat16"  # their run files: bfloat16 autocast over float32 weights
    assert cfg.model.recurrent.chunk_size == 16  # lengths 3-40 pad to 48, not to one chunk of 64
  assert {c.lr for c in cells} == {1e-2, 1e-3, 5e-4, 1e-4} and {c.seed for c in cells} == {0, 1, 2}
  small = expand(load(os.path.join(ROOT, "configs", "state_tracking.py") + ":small"), results="/nonexistent")
  assert {c.config.model.dtype for c in small} == {"float32"}  # as its committed CPU runs


def test_mqar_ablations_each_change_one_thing_from_the_zoology_control():
  def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
      out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out

  cells = {c.setting: c.config for c in expand(load(os.path.join(ROOT, "configs/mqar_zoology.py:ablate")),
                                                results="/nonexistent") if c.seed == 0 and c.lr == 2.2e-3}
  control = flat(to_dict(cells.pop("zoology")))
  assert control["model.mlp_ratio"] == 0.0 and control["model.attention.num_heads"] == 1

  def changes(cfg):
    return {k: v for k, v in flat(to_dict(cfg)).items() if control.get(k) != v and k not in ("name", "workdir")}

  single = {name: changes(cfg) for name, cfg in cells.items() if not name.startswith("all")}
  assert len(single) == 6
  union = {k: v for d in single.values() for k, v in d.items()}
  assert len(union) == sum(len(d) for d in single.values())  # no two differences touch the same field
  assert changes(cells.pop("all")) == union
  for name in single:  # all six but one: exactly the other five's changes
    assert changes(cells.pop(f"all_but_{name}")) == {k: v for k, v in union.items() if k not in single[name]}, name
  for name, cfg in cells.items():
    changed = set(changes(cfg))
    want = {"swiglu_mlp": {"model.mlp_ratio"}, "batch_128": {"data.batch_size"},
            "random_tokens": {"data.mqar.random_non_queries"}, "length_mixture": {"data.mqar.train_settings"}}
    if name in want:
      assert changed == want[name], name
    elif name == "two_heads":
      assert changed and all("num_heads" in k or "head_dim" in k for k in changed)
    else:
      assert name == "optimizer" and changed and all(k.startswith("train.") for k in changed)
