import os
import sys

import pytest

# The float64 oracle lives beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
  import jax

  if jax.default_backend() != "gpu":
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device machine)")
    for item in items:
      if "gpu" in item.keywords:
        item.add_marker(skip)
