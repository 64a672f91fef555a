"""The tasks: deterministic from the seed, correct answers, resumable streams, local text split by file."""

import itertools

import numpy as np
import pytest

from gdn.data import DataConfig, eval_batches, iterator, make_task, mqar, niah, state_tracking, text


def _rng(i=0):
  return np.random.default_rng(i)


def test_same_seed_same_batches_other_seed_other_batches():
  a = make_task(DataConfig(), seed=0, num_batches=4).train
  b = make_task(DataConfig(), seed=0, num_batches=4).train
  c = make_task(DataConfig(), seed=1, num_batches=4).train
  np.testing.assert_array_equal(a[3]["inputs"], b[3]["inputs"])
  assert not np.array_equal(a[3]["inputs"], c[3]["inputs"])


def test_iterator_resumes_from_saved_state():
  ds = make_task(DataConfig(batch_size=4), seed=0, num_batches=10).train
  it = iterator(ds)
  for _ in range(3):
    next(it)
  state = it.get_state()
  rest = [next(it)["inputs"] for _ in range(4)]
  resumed = iterator(ds, state)
  for want in rest:
    np.testing.assert_array_equal(next(resumed)["inputs"], want)


@pytest.mark.parametrize("T, P", mqar.SETTINGS)
def test_mqar_answers_are_the_values_of_the_queried_keys(T, P):
  cfg = mqar.MQARConfig()
  b = mqar.batch(cfg, _rng(T), 8, T, P)
  assert b["inputs"].shape == (8, T) and b["weights"].sum(1).tolist() == [P] * 8
  for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
    keys, values = x[0:2 * P:2], x[1:2 * P:2]
    assert len(set(keys)) == P and keys.max() < cfg.vocab_size // 2 <= values.min()
    table = dict(zip(keys, values))
    positions = np.nonzero(w)[0]
    assert positions.min() >= 2 * P
    assert all(table[x[t]] == y[t] for t in positions)


def test_mqar_query_gaps_follow_a_power_law():
  cfg = mqar.MQARConfig()
  T, P = 256, 16
  b = mqar.batch(cfg, _rng(), 256, T, P)
  gaps = (np.nonzero(b["weights"])[1] - 2 * P) // 2
  # p(r) ~ r^-0.99: the first tenth of the query region holds most queries, far more than the uniform 10%.
  assert np.mean(gaps < (T - 2 * P) // 20) > 0.3


# RULER's three single-needle tasks and the unstructured haystack, with their value alphabets.
NIAH_VARIANTS = [("repeat", "number", 4), ("essay", "number", 7), ("essay", "uuid", 16), ("random", "word", 4)]


@pytest.mark.parametrize("haystack, value, Vl", NIAH_VARIANTS)
def test_niah_needle_once_query_matches_answer_supervised(haystack, value, Vl):
  c = niah.NIAHConfig(haystack=haystack, value=value, key_length=2, value_length=Vl, train_lengths=(96,),
                      eval_lengths=(96, 300))
  Kl, n = c.key_length, 2 + c.key_length + Vl
  low, high = {"number": (4, 14), "uuid": (4, 20), "word": (20, c.vocab_size)}[value]
  for T in (96, 300):
    b = niah.batch(c, _rng(T), 8, T, seed=0)
    assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (8, T)
    for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
      assert (x == niah.NEEDLE).sum() == 1 and (x == niah.QUERY).sum() == 1 and x[T - n] == niah.QUERY
      start = int(np.nonzero(x == niah.NEEDLE)[0][0])
      assert start + n <= T - n  # the needle lies wholly inside the haystack, before the query
      value_ = x[start + 2 + Kl:start + n]
      np.testing.assert_array_equal(x[T - n + 1:T - n + 1 + Kl], x[start + 1:start + 1 + Kl])  # the query key
      assert x[start + 1 + Kl] == x[T - Vl - 1] == niah.SEP
      assert ((value_ >= low) & (value_ < high)).all() and (x[start + 1:start + 1 + Kl] >= 20).all()
      # Weight only on the answer: the positions that predict the query's value tokens.
      np.testing.assert_array_equal(np.nonzero(w)[0], np.arange(T - Vl - 1, T - 1))
      np.testing.assert_array_equal(y[w > 0], value_)
      np.testing.assert_array_equal(x[T - Vl:], value_)


def test_niah_essay_windows_and_repeated_phrases():
  c = niah.NIAHConfig(haystack="essay", value="number", key_length=2, train_lengths=(128,), eval_lengths=(128,))
  stream = niah.essay(c.vocab_size, 3)
  np.testing.assert_array_equal(stream, niah.essay(c.vocab_size, 3))
  assert not np.array_equal(stream[:1000], niah.essay(c.vocab_size, 4)[:1000])
  windows = np.lib.stride_tricks.sliding_window_view(stream, 8)
  starts = set()
  for x in niah.batch(c, _rng(), 16, 128, seed=3)["inputs"]:
    first = int(np.nonzero(x == niah.NEEDLE)[0][0])
    if first >= 8:  # the haystack before the needle is a window of the run's essay
      (start,) = np.nonzero((windows == x[:8]).all(1))[0][:1]
      np.testing.assert_array_equal(x[:first], stream[start:start + first])
      starts.add(int(start))
  assert len(starts) > 1  # each example its own window
  r = niah.NIAHConfig(haystack="repeat", train_lengths=(128,), eval_lengths=(128,))
  phrases = set()
  for h in niah.haystack(r, _rng(), 8, 128, seed=3):
    periods = [p for p in range(8, 25) if np.array_equal(h[p:], h[:-p])]
    assert periods  # one phrase of 8-24 tokens, repeated
    phrases.add(tuple(h[:periods[0]]))
  assert len(phrases) == 8  # a phrase of its own in each example


def test_niah_lm_weight_supervises_the_haystack_in_training_only():
  c = niah.NIAHConfig(haystack="essay", value="number", key_length=2, train_lengths=(64,), eval_lengths=(64,),
                      lm_weight=0.1, eval_examples=4)
  a = 64 - c.value_length - 1  # the first answer position
  w = niah.train_batch(c, _rng(), 4, seed=0)["weights"]
  assert (w[:, a:63] == 1).all() and (w[:, :a] == np.float32(0.1)).all() and (w[:, 63] == 0).all()
  w = eval_batches(niah.eval_splits(c, 0)[0], 4, 0)[0]["weights"]
  np.testing.assert_array_equal(np.nonzero(w[0])[0], np.arange(a, 63))


def test_niah_mixture_trains_every_task_and_evaluates_each():
  c = niah.NIAHConfig(tasks=("sniah1", "sniah2", "sniah3"), key_length=2, value_length=4, uuid_length=8,
                      train_lengths=(64,), eval_lengths=(64, 512), eval_examples=4)
  splits = niah.eval_splits(c, 0)
  assert [s.name for s in splits] == [f"sniah{i}_T{T}" for i in (1, 2, 3) for T in (64, 512)]
  for s in splits:
    b = eval_batches(s, 4, 0)[0]
    T = int(s.name.split("_T")[1])
    Vl = 8 if s.name.startswith("sniah3") else 4
    assert b["inputs"].shape == (4, T) and (b["weights"].sum(1) == Vl).all()
    answer = b["targets"][b["weights"] > 0]
    assert answer.max() < (20 if Vl == 8 else 14)  # hex digits for the uuid, digits for the number
  seen = {int(niah.train_batch(c, _rng(i), 2, 0)["weights"][0].sum()) for i in range(30)}
  assert seen == {4, 8}


@pytest.mark.parametrize("kwargs, needle", [
    (dict(haystack="essays"), "haystack"), (dict(value="hex"), "value"), (dict(value_length=0), "value_length"),
    (dict(key_length=0), "key_length"), (dict(lm_weight=2.0), "lm_weight"), (dict(eval_lengths=(16,)), "length 16"),
    (dict(vocab_size=30), "vocab_size")])
def test_niah_config_errors_name_the_argument(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    niah.NIAHConfig(**{"train_lengths": (64,), **kwargs})


def _state(task, lengths=(3, 40)):
  cfg = state_tracking.StateConfig(task=task, train_lengths=lengths)
  b = state_tracking.train_batch(cfg, _rng(), 64)
  assert b["inputs"].shape == (64, lengths[1])
  return b


def test_parity_answers_once_at_the_last_bit():
  b = _state("parity")
  lengths = set()
  for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
    n = int((x != 2).sum())  # bits read; the length counts the answer too
    assert set(x[:n]) <= {0, 1} and (x[n:] == 2).all()
    assert w.sum() == 1 and w[n - 1] == 1 and y[n - 1] == x[:n].sum() % 2
    lengths.add(n + 1)
  assert min(lengths) >= 3 and max(lengths) <= 40 and len(lengths) > 10


def _text(x, m, symbols):
  return "".join(str(int(t)) if t < m else symbols[int(t) - m] for t in x)


def test_modular_arithmetic_has_precedence_and_one_answer_at_equals():
  m = 5
  b = _state("modular")
  lengths = set()
  for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
    n = int((x != m + 4).sum())
    expr = _text(x[:n - 1], m, "+-*")
    assert x[n - 1] == m + 3 and (x[n:] == m + 4).all()  # "=" last, padding after
    assert w.sum() == 1 and w[n - 1] == 1
    assert eval(expr) % m == y[n - 1], expr  # Python's own precedence: * before + and -
    lengths.add(n + 1)
  assert all(L % 2 == 1 for L in lengths) and min(lengths) >= 3 and max(lengths) <= 39 and len(lengths) > 8
  left_to_right = 0  # the batch must hold expressions where the two orders disagree, or the check proves little
  for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
    n = int((x != m + 4).sum())
    s = int(x[0])
    for i in range(2, n - 1, 2):
      s = (s + x[i], s - x[i], s * x[i])[x[i - 1] - m]
    left_to_right += s % m != y[n - 1]
  assert left_to_right > 10


def test_bracketed_expressions_evaluate_to_their_target():
  m = 5
  for lengths in ((3, 40), (40, 64)):
    b = _state("modular_brackets", lengths)
    for x, y, w in zip(b["inputs"], b["targets"], b["weights"]):
      n = int((x != m + 6).sum())
      assert x[n - 1] == m + 5 and (x[n:] == m + 6).all() and w.sum() == 1 and w[n - 1] == 1
      assert max(lengths[0], 5) <= n + 2 <= lengths[1]  # expression, "=", answer and one [PAD]
      expr = _text(x[:n - 1], m, "+-*()")
      assert eval(expr) % m == y[n - 1], expr  # unary minus included: Python reads "(3+-2)" the same way
  tokens = [set(x) for x in _state("modular_brackets")["inputs"]]
  assert any({m + 1, m + 3} <= t for t in tokens)  # some minus signs and brackets


def test_bracketed_expressions_are_drawn_as_the_generator_defines_them():
  """At n tokens (here 21) the top-level left operand's length is uniform in [1, n - 4] and the operator uniform
  in +, -, *; a leaf's digit is uniform in [0, m); short expressions take their one form per length."""
  m, n, N = 5, 21, 6000
  cfg = state_tracking.StateConfig(task="modular_brackets", train_lengths=(3, 40))
  b = state_tracking.batch(cfg, _rng(), N, n + 3)  # every example: n tokens, "=", the answer, one [PAD]
  x = b["inputs"][:, :n]
  left, ops = [], []
  for row in x:
    depth = 0
    for i, t in enumerate(row):
      depth += int(t == m + 3) - int(t == m + 4)
      if depth == 1 and m <= t <= m + 2 and i > 1 and (row[i - 1] < m or row[i - 1] == m + 4):
        left.append(i - 1)  # tokens of the left operand: between the first "(" and the top-level operator
        ops.append(t - m)
        break
  assert len(left) == N
  counts = np.bincount(left, minlength=n - 3)[1:]
  assert len(counts) == n - 4 and (np.abs(counts / (N / (n - 4)) - 1) < 0.2).all(), counts
  assert (np.abs(np.bincount(ops, minlength=3) / (N / 3) - 1) < 0.1).all()
  digits = x[x < m]
  assert (np.abs(np.bincount(digits, minlength=m) / (len(digits) / m) - 1) < 0.1).all()
  # The shortest compound, 5 tokens: "(" d op d ")".
  for r in state_tracking.batch(cfg, _rng(), 16, 8)["inputs"][:, :5]:
    assert r[0] == m + 3 and r[4] == m + 4 and r[1] < m and r[3] < m and m <= r[2] <= m + 2, r


def test_s5_targets_compose_the_permutations():
  perms = list(itertools.permutations(range(5)))
  b = state_tracking.batch(state_tracking.StateConfig(task="s5"), _rng(), 2, 12)
  for x, y in zip(b["inputs"], b["targets"]):
    state = tuple(range(5))
    for t in range(12):
      p = perms[x[t]]
      state = tuple(p[state[j]] for j in range(5))
      assert perms[y[t]] == state
  b = _state("s5", (3, 12))
  n = (b["inputs"] != 120).sum(1)
  np.testing.assert_array_equal(b["weights"].sum(1), n)
  assert n.min() >= 3 and n.max() <= 12


@pytest.mark.parametrize("kwargs, needle", [
    (dict(train_lengths=(40, 3)), "train_lengths"),
    (dict(train_lengths=(1, 40)), "train_lengths"),
    (dict(train_lengths=40), "train_lengths"),
    (dict(task="modular_brackets", train_lengths=(3, 4)), "train_lengths"),
    (dict(eval_lengths=()), "eval_lengths"),
    (dict(task="modular_brackets", eval_lengths=(4, 64)), "eval_lengths"),
    (dict(modulus=1), "modulus"),
    (dict(eval_examples=0), "eval_examples"),
])
def test_state_config_errors_name_the_argument(kwargs, needle):
  with pytest.raises(ValueError, match=needle):
    state_tracking.StateConfig(**kwargs)


def test_eval_splits_are_fixed_and_long():
  cfg = DataConfig(task="state", state=state_tracking.StateConfig(train_lengths=(3, 16), eval_lengths=(16, 64)))
  task = make_task(cfg, 0, 2)
  assert task.train[0]["inputs"].shape[1] == 16
  long = [s for s in task.evals if s.name == "T64"][0]
  a, b = eval_batches(long, 8, 0), eval_batches(long, 8, 0)
  assert a[0]["inputs"].shape == (8, 64)
  np.testing.assert_array_equal(a[-1]["inputs"], b[-1]["inputs"])


def test_last_eval_batch_is_padded_with_weightless_rows():
  cfg = DataConfig(task="state", state=state_tracking.StateConfig(train_lengths=(16, 16), eval_lengths=(16,),
                                                                   eval_examples=10))
  split = make_task(cfg, 0, 2).evals[0]
  batches = eval_batches(split, 4, 0)
  assert [b["inputs"].shape for b in batches] == [(4, 16)] * 3  # one shape: one compile of the eval step
  weighted = np.concatenate([b["weights"].sum(-1) > 0 for b in batches])
  np.testing.assert_array_equal(weighted, [True] * 10 + [False] * 2)
  first_two = eval_batches(split, 2, 0)[4]  # the same last two examples, unpadded
  for name, x in first_two.items():
    np.testing.assert_array_equal(batches[-1][name][:2], x)


def test_byte_corpus_splits_by_file(tmp_path):
  for i in range(40):
    (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 50)
  train, val = text.byte_streams(str(tmp_path), "**/*.py", 0.2)
  assert len(train) + len(val) == sum(len(f"x = {i}\n" * 50) + 1 for i in range(40)) - 2
  val_files = {bytes(f) for f in bytes(val).split(b"\0")}
  train_files = {bytes(f) for f in bytes(train).split(b"\0")}
  assert val_files and train_files and not val_files & train_files


def test_default_corpus_is_the_standard_library():
  files = text.corpus_files("", "**/*.py")
  names = {rel for rel, _ in files}
  assert "os.py" in names and not any("site-packages" in n for n in names)


def test_token_files_are_memory_mapped(tmp_path):
  tokens = np.arange(1000, dtype=np.uint16) % 300
  tokens.tofile(tmp_path / "train.bin")
  tokens[:500].tofile(tmp_path / "val.bin")
  cfg = DataConfig(task="tokens", batch_size=2,
                   text=text.TextConfig(seq_len=16, train_file=str(tmp_path / "train.bin"),
                                        val_file=str(tmp_path / "val.bin"), eval_examples=4, vocab_size=300))
  task = make_task(cfg, 0, 5)
  b = task.train[0]
  np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
  assert isinstance(text.token_stream(str(tmp_path / "train.bin"), "uint16"), np.memmap)
  assert eval_batches(task.evals[0], 3, 0)[0]["inputs"].shape == (3, 16)


def test_bad_token_files_fail_naming_the_config_key(tmp_path):
  good = tmp_path / "good.bin"
  (np.arange(100, dtype=np.uint16) % 50).tofile(good)

  def make(**kw):
    fields = dict(seq_len=8, train_file=str(good), val_file=str(good), eval_examples=2, vocab_size=50)
    return make_task(DataConfig(task="tokens", batch_size=2, text=text.TextConfig(**{**fields, **kw})), 0, 2)

  make()
  with pytest.raises(FileNotFoundError, match="config.data.text.val_file .*missing.bin"):
    make(val_file=str(tmp_path / "missing.bin"))
  with pytest.raises(FileNotFoundError, match="config.data.text.train_file is empty"):
    make(train_file="")
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"\x01\x02\x03")
  with pytest.raises(ValueError, match="train_file .* 3 bytes, not a non-zero multiple of 2"):
    make(train_file=str(odd))
  with pytest.raises(ValueError, match="token 40 at position 40, outside .*vocab_size=40"):
    make(vocab_size=40)
  with pytest.raises(ValueError, match="seq_len"):
    make(seq_len=200)
  short = tmp_path / "short.bin"
  (np.arange(20, dtype=np.uint16) % 50).tofile(short)
  with pytest.raises(ValueError, match=r"config.data.text.val_file .*short.bin.* of 20 tokens is shorter than one"):
    make(val_file=str(short), seq_len=32)
  with pytest.raises(FileNotFoundError, match="config.data.text.corpus_dir"):
    text.corpus_files(str(tmp_path / "nowhere"), "**/*.py")


def test_bench_data_times_each_setting(capsys):
  """experiments/bench_data.py: one row per sweep setting, its ms a batch and that times the cells."""
  from experiments import bench_data

  rows = bench_data.main(["--config", "configs/state_tracking.py:small", "--batches", "2", "--cells", "3"])
  assert [r["setting"] for r in rows] == ["parity"] and rows[0]["ms"] > 0
  assert "| parity | " in capsys.readouterr().out
