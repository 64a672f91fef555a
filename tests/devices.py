"""Running a test file as a child process on forced host CPU devices.

jax fixes the CPU backend's device count when it first initialises, which the rest of the suite does before a
multi-device test runs; such tests therefore run their checks in a child process (the test file itself, run as
a script) started with `XLA_FLAGS=--xla_force_host_platform_device_count=N`, which prints its results as JSON on
its last line for the test to judge.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def device_count_flags(devices: int) -> str:
  """The caller's XLA_FLAGS (the suite's code-generation flag among them: conftest.py) with `devices` host CPU
  devices forced."""
  return (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()


def run_child(script: str, *args: str, devices: int = 8, fast_compile: bool = True, timeout: int = 600):
  """Runs `python script *args` on `devices` CPU devices; returns the JSON of its last stdout line.

  fast_compile: compile with fewer optimisations (2-3x faster here; the tests check math, not XLA's fusions).
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = device_count_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  if fast_compile:
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
