import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# The float64 oracle lives beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
# XLA:CPU's older fusion code generator: it compiles the suite's programs about 1.6x faster than the fusion emitters
# that are the default (tests/test_ops.py -k all_variants_float32, one process: 49 s against 30 s). The tests check
# math, not XLA's code generation; a benchmark or a user's run keeps the default.
_CPU_CODEGEN_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _cpu_codegen_flag_known(flags: str) -> bool:
  """Whether this jaxlib's XLA accepts the flag (it aborts at start-up on a flag it does not know)."""
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  code = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0


def pytest_configure(config):
  """One persistent compilation cache for the whole run: the pytest-xdist workers, which start after this hook and
  inherit its environment, and every child process they start. Most of the suite's time is XLA:CPU compiling,
  and the same programs recur across modules (`_drop_compiled_programs` empties the in-memory caches between
  them), across parametrised cases and in the training processes that tests start. Programs that compile in
  under 0.2 s are not worth the write. A directory set by the caller is used as it is and kept; set empty
  (`JAX_COMPILATION_CACHE_DIR= python -m pytest ...`), the suite runs without a persistent cache."""
  if hasattr(config, "workerinput"):
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_use_fusion_emitters" not in flags and _cpu_codegen_flag_known(f"{flags} {_CPU_CODEGEN_FLAG}".strip()):
    os.environ["XLA_FLAGS"] = f"{flags} {_CPU_CODEGEN_FLAG}".strip()
  if _CACHE_ENV in os.environ:
    return
  config._gdn_jax_cache = tempfile.mkdtemp(prefix="gdn-tests-jax-cache-")
  os.environ[_CACHE_ENV] = config._gdn_jax_cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_unconfigure(config):
  path = getattr(config, "_gdn_jax_cache", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  import jax

  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device machine)")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
  # The modules that hold the longest tests first (each module kept together, for its module-scoped fixtures and
  # compiled programs), so that neither pytest-xdist worker is left with one of them at the end.
  slow = {item.module.__name__ for item in items if "slow" in item.keywords}
  items.sort(key=lambda item: item.module.__name__ not in slow)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Frees every compiled program after each test module. A worker that has compiled a few hundred programs has
  crashed inside XLA:CPU's compiler (the suite's later modules then died with it); no test reuses another
  module's programs."""
  yield
  import jax

  jax.clear_caches()


@pytest.fixture(scope="module")
def fast_compile():
  """For modules that check math, not XLA's fusions: fewer optimisations compile 2-3x faster (child processes
  get the same through JAX_DISABLE_MOST_OPTIMIZATIONS=1, as tests/devices.py's run_child does). Use it with
  `pytestmark = pytest.mark.usefixtures("fast_compile")`."""
  import jax

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True)
def _full_optimizations(request):
  """A test marked `full_optimizations` compiles with XLA's optimisations in a module that uses fast_compile (the
  op against the oracle under the compiler as users run it)."""
  if request.node.get_closest_marker("full_optimizations") is None:
    yield
    return
  import jax

  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
