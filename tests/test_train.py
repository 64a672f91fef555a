"""Training end to end on a tiny model: it learns and writes its files; a run killed with SIGKILL and resumed
repeats the uninterrupted run's losses exactly; a corrupt or partial checkpoint is detected and skipped.

The run checks live in one test so that pytest-xdist never starts the three training processes twice."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gdn.generate import generate
from gdn.train import checkpoint, load_run, optimizer, step
from gdn.train.config_file import resolve
from gdn.train.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart.py")
# Orbax's async checkpointer may leave its event loop to close after a test ends.
# The checks are math and files, not XLA's fusions: fewer optimisations compile faster (conftest.py; the
# training processes get the same through the environment).
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.usefixtures("fast_compile")]
STEPS = 60  # stop_step: the schedule spans 1000 steps so that every run stops mid-schedule, like a preemption
TINY = [
    "model.d_model=32", "model.num_layers=2", "model.pattern=RA", "model.vocab_size=64",
    "model.recurrent.num_heads=2", "model.recurrent.head_dim=16", "model.attention.num_heads=2",
    "model.attention.head_dim=16", "model.recurrent.method=recurrent", "data.batch_size=8",
    "data.mqar.vocab_size=64", "data.mqar.train_settings=((32,4),)", "data.mqar.eval_settings=((32,4),)",
    "data.mqar.eval_examples=16", "train.steps=1000", "train.warmup_steps=10", "train.learning_rate=3e-3",
    "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=10", "train.keep_checkpoints=3",
    "train.progress_bar=false", f"train.stop_step={STEPS}",
]


def _launch(workdir, env):
  args = [sys.executable, "-m", "experiments.train", "--config", CONFIG, *(f"--config.{o}" for o in TINY),
          f"--config.workdir={workdir}"]
  return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(workdir):
  return {r["step"]: r["train/loss"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if "train/loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """An uninterrupted run, and one killed part-way then resumed, as separate processes."""
  tmp = tmp_path_factory.mktemp("runs")
  # The three processes compile the same programs: a shared persistent cache compiles them once.
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  full, killed = str(tmp / "full"), str(tmp / "killed")

  proc = _launch(killed, env)
  deadline = time.time() + 240
  metrics = os.path.join(killed, "metrics.jsonl")
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and max(_losses(killed), default=0) >= 25:
      break
    time.sleep(0.02)
  was_running = proc.poll() is None
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  killed_at = max(_losses(killed), default=0)

  procs = [_launch(full, env), _launch(killed, env)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out
  return dict(full=full, killed=killed, was_running=was_running, killed_at=killed_at, resumed_output=outputs[1])


@pytest.mark.slow
def test_run_learns_writes_its_files_and_resumes_exactly_after_sigkill(runs):
  full = runs["full"]
  losses = _losses(full)
  assert sorted(losses) == list(range(1, STEPS + 1))
  first, last = np.mean([losses[s] for s in range(1, 11)]), np.mean([losses[s] for s in range(STEPS - 9, STEPS + 1)])
  assert last < first - 0.2, (first, last)
  records = read_jsonl(os.path.join(full, "metrics.jsonl"))
  assert any("eval/accuracy" in r and r["step"] == STEPS for r in records)
  assert all(np.isfinite(r["train/tokens_per_s"]) for r in records if "train/tokens_per_s" in r)
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(full, "tb")))
  with open(os.path.join(full, "config.json")) as f:
    written = json.load(f)
  assert written["model"]["d_model"] == 32 and written["train"]["stop_step"] == STEPS
  with open(os.path.join(full, "summary.json")) as f:
    assert json.load(f)["steps"] == STEPS
  kept = sorted(int(d) for d in os.listdir(os.path.join(full, "checkpoints")) if d.isdigit())
  assert kept == [STEPS - 20, STEPS - 10, STEPS]

  # The killed run, resumed from its last checkpoint, logs exactly the uninterrupted run's losses.
  assert runs["was_running"] and 0 < runs["killed_at"] < STEPS, "the run was not killed part-way"
  assert "resumed from step" in runs["resumed_output"]
  resumed = _losses(runs["killed"])
  assert sorted(resumed) == sorted(losses)
  for s in sorted(losses):
    assert resumed[s] == losses[s], f"step {s}: {resumed[s]} != {losses[s]}"
  # Its summary counts both launches' seconds: the killed one's up to its last checkpoint, then the resumed one's.
  with open(os.path.join(runs["killed"], "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(runs["killed"], "launches.json")) as f:
    spans = [(e["from_step"], e["to_step"]) for e in json.load(f)]
  assert summary["launches"] == 2 and summary["seconds_total"] > summary["seconds"] > 0
  assert spans[0][0] == 0 and spans[0][1] == spans[1][0] <= runs["killed_at"] and spans[1][1] == STEPS

  # The trained model back from the run's directory, as a user loads it to evaluate, generate or export.
  model, at, cfg = load_run(full)
  assert at == STEPS and cfg.model.d_model == 32
  ck = checkpoint.Checkpoints(os.path.join(full, "checkpoints"), keep=3)
  state = ck.restore_latest(_template())[0]
  ck.close()
  for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)), jax.tree_util.tree_leaves(state.params)):
    np.testing.assert_array_equal(a, b)
  assert generate(model, jnp.zeros((1, 4), jnp.int32), 3, rng=None, temperature=0.0).shape == (1, 7)
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_run(os.path.join(full, "checkpoints"))


def _template():
  cfg = resolve(CONFIG, TINY)
  tx = optimizer.make_optimizer(cfg.train)
  return step.init(cfg.model, tx, cfg.seed)[1]


def _files(d):
  return sorted((os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs), key=os.path.getsize)


def test_corrupt_or_partial_checkpoint_is_detected_and_skipped(tmp_path):
  template = _template()
  ckdir = tmp_path / "checkpoints"
  ck = checkpoint.Checkpoints(str(ckdir), keep=3)
  oldest, middle, newest = 10, 20, 30
  for s in (oldest, middle, newest):
    ck.save(s, template.replace(step=template.step + s), {"next_index": s})
  ck.close()
  # Corrupt: change bytes inside the largest array file of the newest checkpoint, keeping its size.
  victim = _files(ckdir / str(newest) / "state")[-1]
  with open(victim, "r+b") as f:
    data = bytearray(f.read())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes((b + 1) % 256 for b in data[mid:mid + 64])
    f.seek(0)
    f.write(data)
  # Partial: the middle checkpoint lost its array data.
  for path in _files(ckdir / str(middle) / "state"):
    if os.path.getsize(path) > 1000:
      os.remove(path)
  ck = checkpoint.Checkpoints(str(ckdir), keep=3)
  with pytest.warns(UserWarning, match="corrupt or partial") as caught:
    state, data_state, restored_step = ck.restore_latest(template)
  ck.close()
  assert restored_step == oldest
  assert len([w for w in caught if "corrupt or partial" in str(w.message)]) == 2
  assert int(state.step) == oldest and data_state["next_index"] == oldest
  for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(template.params)):
    np.testing.assert_array_equal(a, b)
  assert sorted(os.listdir(tmp_path / "corrupt_checkpoints")) == sorted([str(newest), str(middle)])


def test_a_changed_data_position_is_corrupt_and_corrupt_copies_are_never_overwritten(tmp_path):
  template = _template()
  ckdir = tmp_path / "checkpoints"
  aside = tmp_path / "corrupt_checkpoints"
  at = lambda s: template.replace(step=template.step + s)

  def save(*steps):
    ck = checkpoint.Checkpoints(str(ckdir), keep=5)
    for s in steps:
      ck.save(s, at(s), {"next_index": s})
    ck.close()

  def position(s, text):
    (ckdir / str(s) / "data" / "metadata").write_text(text)

  def restore():
    ck = checkpoint.Checkpoints(str(ckdir), keep=5)
    try:
      return ck.restore_latest(template)
    finally:
      ck.close()

  save(10, 20, 30)
  position(30, '{"next_index": 38}')  # moved: would train on other batches
  position(20, '{"next_idx": 20}')  # misspelt: the iterator could not read it
  # Written before the digest covered the data position: its arrays alone are checked.
  (ckdir / "10" / "meta" / "metadata").write_text(
      json.dumps({"step": 10, "digest": checkpoint.digest(checkpoint.to_arrays(at(10)))}))
  ck = checkpoint.Checkpoints(str(ckdir), keep=5)
  with pytest.warns(UserWarning, match="corrupt or partial"):  # train.resume=params_only reads the same way
    assert ck.restore_params(template.params)[1] == 10
  ck.close()
  with pytest.warns(UserWarning, match="corrupt or partial"):
    state, data_state, restored_step = restore()
  assert restored_step == 10 and int(state.step) == 10 and data_state == {"next_index": 10}
  assert sorted(os.listdir(aside)) == ["20", "30"]

  # The same steps written and damaged again, the old one's metadata too: every copy is kept, and with nothing
  # left to resume from the restore stops, listing each checkpoint, why it failed and where it went.
  save(20, 30)
  position(20, '{"next_index": 1}')
  position(30, '{"next_index": 1}')
  (ckdir / "10" / "meta" / "metadata").write_text("{")
  with pytest.warns(UserWarning, match="corrupt or partial"), \
      pytest.raises(checkpoint.NoUsableCheckpoint) as e:
    restore()
  assert sorted(os.listdir(aside)) == ["10", "20", "20.1", "30", "30.1"]
  assert (aside / "30" / "data" / "metadata").read_text() == '{"next_index": 38}'
  for s, where in ((30, "30.1"), (20, "20.1"), (10, "10")):
    assert f"step {s} (" in str(e.value) and f"moved to {aside / where})" in str(e.value)
  assert "train.resume=fresh" in str(e.value) and not [d for d in os.listdir(ckdir) if d.isdigit()]


def test_weight_decay_skips_decay_parameters_norms_and_embeddings():
  params = _template().params
  def named(mask):
    return {"/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path): m
            for path, m in jax.tree_util.tree_leaves_with_path(mask)}

  mask = named(optimizer.decay_mask(params))
  for name, decays in mask.items():
    if any(k in name for k in ("A_log", "dt_bias", "norm", "embed")):
      assert not decays, name
    elif "proj" in name and "kernel" in name:
      assert decays, name
  with_embeddings = named(optimizer.decay_mask(params, decay_embeddings=True))
  assert with_embeddings["embed/embedding/value"] and not mask["embed/embedding/value"]


def test_optimizer_matches_plain_adamw():
  """make_optimizer (peak rate in the state, the schedule's shape after AdamW) updates as optax.adamw with the
  whole schedule does, clipping included."""
  from gdn.train.config import TrainConfig

  cfg = TrainConfig(steps=20, warmup_steps=3, learning_rate=3e-3, weight_decay=0.1, grad_clip=0.5)
  params = {"w": jnp.ones((4, 3)), "A_log": jnp.zeros((3,))}
  full = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps,
                                            cfg.learning_rate * cfg.min_lr_ratio)
  ref = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                    optax.adamw(full, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                mask=optimizer.decay_mask))
  tx = optimizer.make_optimizer(cfg)
  p_ref, p, s_ref, s = params, params, ref.init(params), tx.init(params)
  rng = np.random.default_rng(0)
  for t in range(6):
    g = {n: jnp.asarray(rng.normal(size=x.shape), jnp.float32) for n, x in params.items()}
    u_ref, s_ref = ref.update(g, s_ref, p_ref)
    u, s = tx.update(g, s, p)
    p_ref, p = optax.apply_updates(p_ref, u_ref), optax.apply_updates(p, u)
    for n in params:
      np.testing.assert_allclose(np.asarray(p[n]), np.asarray(p_ref[n]), rtol=1e-6, atol=1e-7)
  assert float(optimizer.peak_lr(s)) == pytest.approx(cfg.learning_rate)
  assert float(optimizer.lr_shape(cfg)(cfg.warmup_steps)) == pytest.approx(1.0)


def test_train_step_matches_a_plain_loop_on_mqar():
  """gdn-train's step (its loss, weights, clipping, AdamW, schedule, mask) gives the losses of a plain optax loop
  written here from scratch, on the same MQAR batches and the same initial attention model: the training path
  is not why a model fails to learn."""
  from flax import nnx

  from gdn.data import make_task
  from gdn.model import LanguageModel

  cfg = resolve("configs/mqar_probe.py", ("model.d_model=32", "model.attention.head_dim=16", "data.batch_size=8",
                                          "model.vocab_size=64", "data.mqar.vocab_size=64", "train.steps=20",
                                          "train.warmup_steps=2", "train.learning_rate=3e-3"))
  tc, n = cfg.train, 6
  batches = [make_task(cfg.data, 0, n).train[i] for i in range(n)]
  tx = optimizer.make_optimizer(tc)
  graphdef, state = step.init(cfg.model, tx, 0)
  train_step = step.make_train_step(graphdef, tx, optimizer.lr_shape(tc))
  ours = []
  for b in batches:
    state, m = train_step(state, b)
    ours.append(float(m["loss"]))

  graph, params, rest = nnx.split(LanguageModel(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
  sched = optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps, tc.steps,
                                             tc.learning_rate * tc.min_lr_ratio)
  matrices = lambda p: jax.tree_util.tree_map_with_path(lambda path, x: x.ndim > 1 and "embed" not in str(path), p)
  plain = optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                      optax.adamw(sched, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay,
                                  mask=matrices))

  def loss_fn(p, b):
    logits = nnx.merge(graph, p, rest)(jnp.asarray(b["inputs"]))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(b["targets"]))
    return (nll * b["weights"]).sum() / b["weights"].sum()

  @jax.jit
  def plain_step(params, opt, b):
    loss, g = jax.value_and_grad(loss_fn)(params, b)
    u, opt = plain.update(g, opt, params)
    return optax.apply_updates(params, u), opt, loss

  opt, theirs = plain.init(params), []
  for b in batches:
    params, opt, loss = plain_step(params, opt, b)
    theirs.append(float(loss))
  np.testing.assert_allclose(ours, theirs, rtol=2e-5)
  assert ours[-1] < ours[0]


def assert_same_loss(got, ref):
  """Two ((loss, stats), grads) of `jax.value_and_grad(..., has_aux=True)` agree to float32 rounding."""
  ((value, stats), g), ((ref_value, ref_stats), ref_g) = got, ref
  np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
  for k in ref_stats:
    np.testing.assert_allclose(float(stats[k]), float(ref_stats[k]), rtol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [False, True])
def test_chunked_loss_equals_the_whole_logits_loss(scan_layers):
  """train.loss_chunk applies the head a few positions at a time (with padding where T is not a multiple):
  the same statistics, loss, gradients and step as the whole [B, T, Vocab] logits, tied head or not."""
  from flax import nnx

  from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
  from gdn.model import LanguageModel

  cfg = ModelConfig(vocab_size=61, d_model=32, num_layers=2, pattern="RA", scan_layers=scan_layers,
                    tie_embeddings=not scan_layers,
                    recurrent=RecurrentConfig(num_heads=2, head_dim=16, method="recurrent"),  # the head is the subject
                    attention=AttentionConfig(num_heads=2, head_dim=16))
  r = np.random.default_rng(0)
  B, T = 3, 13
  batch = dict(inputs=r.integers(0, 61, (B, T)).astype(np.int32), targets=r.integers(0, 61, (B, T)).astype(np.int32),
               weights=(r.random((B, T)) > 0.3).astype(np.float32))
  batch["weights"][1] = 0.0  # a row without supervised positions
  graph, params, rest = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(p, chunk):
    stats = step.model_stats(nnx.merge(graph, p, rest), batch, chunk)
    return stats["nll"] / stats["weight"], stats

  chunks = (1, 5, 20)  # one position at a time, a chunk that pads the last, one longer than T

  @jax.jit  # every chunk size in one program: one compile instead of op-by-op gradients of the model
  def values_and_grads(p):
    return [jax.value_and_grad(loss, has_aux=True)(p, chunk) for chunk in (0, *chunks)]

  ref, *chunked = values_and_grads(params)
  for got in chunked:
    assert_same_loss(got, ref)

  tc = resolve(CONFIG, ("train.steps=10", "train.warmup_steps=1")).train
  tx = optimizer.make_optimizer(tc)
  graphdef, state = step.init(cfg, tx, 0)
  _, m0 = step.make_train_step(graphdef, tx, optimizer.lr_shape(tc))(state, batch)
  graphdef, state = step.init(cfg, tx, 0)
  _, m1 = step.make_train_step(graphdef, tx, optimizer.lr_shape(tc), loss_chunk=4)(state, batch)
  for k in ("loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, err_msg=k)


def test_early_stop_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path):
  from gdn.sweep.grid import Cell, done
  from gdn.train.loop import train

  cfg = resolve("configs/mqar_probe.py", ("model.d_model=32", "model.attention.head_dim=16", "data.batch_size=8",
                                          "model.vocab_size=64", "data.mqar.vocab_size=64", "train.steps=40",
                                          "train.warmup_steps=2", "train.eval_every=10", "data.mqar.eval_examples=8",
                                          "train.early_stop=0.5", "train.early_stop_metric=loss",
                                          f"workdir={tmp_path}"))
  summary = train(cfg, log=lambda *a: None)  # the loss is above 0.5 at the first evaluation
  assert summary["steps"] == 10 and summary["stopped_early"]
  assert max(r["step"] for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))) == 10
  assert done(Cell("m", "s", 0, 1e-3, cfg))


def test_state_tracking_small_config_trains_on_mixed_lengths_and_evaluates_per_length(tmp_path):
  """A few steps of configs/state_tracking.py:small: batches of lengths 3-40 padded to 40, eval splits of
  other widths, the per-length scaled accuracy in the summary."""
  from gdn.train.loop import train
  cfg = resolve(os.path.join(ROOT, "configs", "state_tracking.py") + ":small", [
      "data.batch_size=4", "data.eval_batch_size=4", "data.state.eval_lengths=(40,64)", "data.state.eval_examples=4",
      "model.d_model=16", "model.recurrent.head_dim=8", "train.steps=3", "train.warmup_steps=1", "train.eval_every=0",
      "train.checkpoint_every=0", f"workdir={tmp_path}", "compilation_cache="])
  train(cfg, log=lambda *a: None)
  with open(os.path.join(str(tmp_path), "summary.json")) as f:
    ev = json.load(f)["eval"]
  assert {"T40/scaled_accuracy", "T64/scaled_accuracy", "scaled_accuracy"} <= set(ev)
  assert all(-1.0 <= ev[k] <= 1.0 for k in ev if k.endswith("scaled_accuracy"))
