"""`gdn.bench.autotune_cache`: Triton's autotuning choices carried between benchmark processes."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from gdn.bench import autotune_cache


def _write(path, text="{}"):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_copy_choices_copies_autotune_files_alone_and_keeps_what_is_there(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  _write(src / "k1" / "chunk_fwd.autotune.json", '{"a": 1}')
  _write(src / "k2" / "chunk_bwd.autotune.json", '{"b": 2}')
  _write(src / "k1" / "chunk_fwd.cubin", "binary")  # compiled kernels stay behind
  _write(dst / "k2" / "chunk_bwd.autotune.json", '{"b": "kept"}')
  assert autotune_cache.copy_choices(src, dst) == 1
  assert json.loads((dst / "k1" / "chunk_fwd.autotune.json").read_text()) == {"a": 1}
  assert json.loads((dst / "k2" / "chunk_bwd.autotune.json").read_text()) == {"b": "kept"}
  assert not (dst / "k1" / "chunk_fwd.cubin").exists()
  assert autotune_cache.copy_choices(src, dst) == 0


def test_a_process_cut_by_sigterm_keeps_its_new_choices(tmp_path):
  """The store's choices reach the process's TRITON_CACHE_DIR (with autotune caching asked for), and a choice
  made there is in the store after the process is terminated as `timeout` would."""
  store = tmp_path / "store"
  _write(store / "old" / "kernel_a.autotune.json")
  code = textwrap.dedent(f"""
      import os, pathlib, signal, time
      from gdn.bench import autotune_cache
      autotune_cache.use({str(store)!r})
      cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
      assert (cache / "old" / "kernel_a.autotune.json").exists()
      assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1" and os.environ["FLA_CACHE_RESULTS"] == "1"
      (cache / "new").mkdir()
      (cache / "new" / "kernel_b.autotune.json").write_text('{{"configs_timings": []}}')
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(30)
  """)
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     env=dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[1])))
  assert p.returncode == 128 + 15, p.stderr
  assert (store / "new" / "kernel_b.autotune.json").exists()


def test_refuses_once_fla_is_imported(tmp_path, monkeypatch):
  assert autotune_cache.use(None)() == 0  # no store: nothing set
  monkeypatch.setitem(sys.modules, "fla", object())
  with pytest.raises(RuntimeError, match="fla is imported already"):
    autotune_cache.use(tmp_path)
