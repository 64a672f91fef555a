"""The corpus builder: deterministic, duplicates kept once, no file on both sides of the split, the cap holds,
and the `tokens` task reads what it writes in bits per byte."""

import hashlib
import json

import numpy as np
import pytest

from gdn.data import DataConfig, corpus, make_task, text

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _tree(tmp_path, n=60):
  """Two fake roots: distinct files, a vendored copy of one, an empty file and one holding a NUL byte."""
  a, b = tmp_path / "lib", tmp_path / "site"
  for i in range(n):
    (a / f"pkg{i % 5}").mkdir(parents=True, exist_ok=True)
    (a / f"pkg{i % 5}" / f"m{i}.py").write_text(f"def f{i}(x):\n  return x * {i}\n" * (1 + i % 7))
  (b / "vendor").mkdir(parents=True)
  (b / "vendor" / "m3.py").write_bytes((a / "pkg3" / "m3.py").read_bytes())
  (b / "empty.py").write_text("")
  (b / "nul.py").write_bytes(b"x = 1\0")
  (b / "notes.txt").write_text("not python")
  return {"stdlib": [str(a)], "site-packages": [str(b)]}


@pytest.fixture
def fake_roots(tmp_path, monkeypatch):
  roots = _tree(tmp_path)
  monkeypatch.setattr(corpus, "root_dirs", lambda name: roots[name])
  return roots


def _lines(out, key):
  return [line.split(" ", 1) for line in (out / f"{key}_files.txt").read_text().splitlines()]


def test_two_builds_give_identical_bytes_and_manifests(tmp_path):
  outs = [tmp_path / "a", tmp_path / "b"]
  for out in outs:
    corpus.build(str(out), roots=("stdlib",), max_bytes=1 << 20)
  for name in ("train.bin", "val.bin", "manifest.json", "train_files.txt", "val_files.txt"):
    assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
  m = json.loads((outs[0] / "manifest.json").read_text())
  assert m["train"]["sha256"] == hashlib.sha256((outs[0] / "train.bin").read_bytes()).hexdigest()


def test_duplicates_are_kept_once_and_the_split_is_disjoint(fake_roots, tmp_path):
  out = tmp_path / "c"
  m = corpus.build(str(out), val_fraction=0.3)
  assert m["files_found"] == 62  # 60 + the copy + the NUL file; the empty and .txt files are not listed
  assert m["duplicates_removed"] == 1 and m["with_nul_skipped"] == 1
  train, val = _lines(out, "train"), _lines(out, "val")
  assert len(train) + len(val) == 60 and train and val
  assert not {d for d, _ in train} & {d for d, _ in val}
  assert not {n for _, n in train} & {n for _, n in val}
  # Every byte of each split is its files' contents joined by NUL, so no file is in both streams either.
  for key, lines in (("train", train), ("val", val)):
    data = (out / f"{key}.bin").read_bytes()
    assert data.count(b"\0") == len(lines) - 1 and m[key]["bytes"] == len(data)


def test_the_cap_bounds_the_bytes_and_keeps_a_subset(fake_roots, tmp_path):
  full = corpus.build(str(tmp_path / "full"), val_fraction=0.3)
  total = full["train"]["bytes"] + full["val"]["bytes"]
  m = corpus.build(str(tmp_path / "cap"), val_fraction=0.3, max_bytes=total // 2)
  assert m["train"]["bytes"] + m["val"]["bytes"] + 2 <= total // 2
  small = {d for key in ("train", "val") for d, _ in _lines(tmp_path / "cap", key)}
  big = {d for key in ("train", "val") for d, _ in _lines(tmp_path / "full", key)}
  assert small < big


def test_a_cap_too_small_for_both_splits_is_refused(fake_roots, tmp_path):
  with pytest.raises(ValueError, match="max_bytes=30"):
    corpus.build(str(tmp_path / "x"), max_bytes=30)


def test_token_files_of_bytes_report_bits_per_byte(fake_roots, tmp_path):
  out = tmp_path / "c"
  corpus.build(str(out), val_fraction=0.3)
  cfg = DataConfig(task="tokens", batch_size=2, text=text.TextConfig(
      seq_len=16, train_file=str(out / "train.bin"), val_file=str(out / "val.bin"), token_dtype="uint8",
      vocab_size=256))
  task = make_task(cfg, seed=0, num_batches=2)
  assert task.bits_per_token and task.vocab_size == 256
  want = np.frombuffer((out / "train.bin").read_bytes(), np.uint8)
  assert set(np.asarray(task.train[0]["inputs"]).ravel()) <= set(want.tolist())


def _tokens(out, batch, seq_len=16):
  return DataConfig(task="tokens", batch_size=batch, text=text.TextConfig(
      seq_len=seq_len, train_file=str(out / "train.bin"), val_file=str(out / "val.bin"), token_dtype="uint8",
      vocab_size=256, single_pass=True))


def test_single_pass_refuses_a_run_that_would_see_tokens_twice(fake_roots, tmp_path):
  out = tmp_path / "c"
  m = corpus.build(str(out), val_fraction=0.3)
  windows = (m["train"]["bytes"] - 1) // 16
  make_task(_tokens(out, windows), seed=0, num_batches=1)  # exactly one pass: allowed
  with pytest.raises(ValueError, match=r"config.train.steps .* 2 x config.data.batch_size") as e:
    make_task(_tokens(out, windows), seed=0, num_batches=2)
  assert f"has {windows:,}" in str(e.value)


def test_a_text_run_logs_how_many_epochs_it_trains(fake_roots, tmp_path):
  from gdn.train import ExperimentConfig, TrainConfig, train  # noqa: PLC0415
  from gdn.config import ModelConfig, RecurrentConfig  # noqa: PLC0415
  out = tmp_path / "c"
  m = corpus.build(str(out), val_fraction=0.3)
  data = _tokens(out, 2)
  cfg = ExperimentConfig(workdir=str(tmp_path / "run"), data=data, train=TrainConfig(
      steps=3, warmup_steps=1, eval_every=0, checkpoint_every=0, progress_bar=False),
      model=ModelConfig(d_model=16, num_layers=1, pattern="R", recurrent=RecurrentConfig(
          num_heads=1, head_dim=16, method="recurrent")))
  lines = []
  train(cfg, log=lines.append)
  windows = (m["train"]["bytes"] - 1) // 16
  assert f"data: 6 training windows of {windows:,} in the train split ({6 / windows:.2f} epochs)" in lines
