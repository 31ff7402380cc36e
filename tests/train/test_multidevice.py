"""4 simulated CPU devices give the loss and parameters of 1 device (a subprocess, since the
device count is fixed when JAX starts); a batch that does not split over them is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from fastpos.train import train_and_evaluate
from tests.helpers import FAST_COMPILE_FLAGS
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]
# Adam's eps is raised from 1e-9: biases that feed a BatchNorm or a softmax have a zero
# gradient, i.e. round-off that differs with the reduction order, and a tiny eps would turn
# that noise into full-size (and device-count dependent) updates.
OVERRIDES = {
    "batch_size": 8,
    "num_train_steps": 3,
    "eval_every_steps": 3,
    "checkpoint_every_steps": 3,
    "optimizer.eps": 1e-4,
}
MESHES = {
    "data4": {},  # 4-way data parallel
    "data2_model2": {"mesh.model": 2, "mesh.rules": (("kernel$", (None, "model")),)},
}

_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
import numpy as np
from fastpos.train import train_and_evaluate
from tests.train.common import tiny_config

out, overrides = sys.argv[1], json.loads(sys.argv[2])
assert jax.device_count() == 4, jax.devices()
result = {}
# JSON made the rules lists: tuples again, before either run.
overrides["mesh.rules"] = tuple((r, tuple(s)) for r, s in overrides.get("mesh.rules", ()))
try:
  train_and_evaluate(tiny_config(**{**overrides, "batch_size": 7}), out + "/bad")
except ValueError as e:
  result["bad_batch"] = str(e)
r = train_and_evaluate(tiny_config(**overrides), out + "/run")
leaves = jax.tree_util.tree_leaves_with_path(r["state"].params)
np.savez(out + "/params.npz", *[np.asarray(x) for _, x in leaves])
result.update(train=r["train"], validation=r["validation"],
              specs={jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in leaves})
print("RESULT" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  assert jax.device_count() == 1
  return train_and_evaluate(tiny_config(**OVERRIDES), tmp_path_factory.mktemp("one"))


# Slow (training runs); the default run keeps 4 devices against 1 in test_multiprocess.py
# (test_two_processes_log_what_one_process_logs).
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["data4", pytest.param("data2_model2", marks=pytest.mark.slow)])
def test_four_devices_match_one(tmp_path, one_device, mesh):
  # The fast compile flags, as this process compiles the 1-device run with (tests/conftest.py).
  env = dict(
      os.environ,
      XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_FLAGS}",
      PYTHONPATH=str(ROOT),
  )
  env.pop("JAX_PLATFORMS", None)
  overrides = {**OVERRIDES, **MESHES[mesh]}
  proc = subprocess.run(
      [sys.executable, "-c", _SCRIPT, str(tmp_path), json.dumps(overrides)],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  result = json.loads(line[len("RESULT") :])
  data = 4 // overrides.get("mesh.model", 1)
  assert f"config.batch_size=7 is not divisible by the {data} device(s)" in result["bad_batch"]

  for split in ("train", "validation"):
    for metric in ("loss", "accuracy"):
      want = one_device[split][metric]
      assert abs(result[split][metric] - want) <= 1e-5 * max(1.0, abs(want)), (split, metric)
  ref = [np.asarray(x) for x in jax.tree.leaves(one_device["state"].params)]
  got = np.load(tmp_path / "params.npz")
  assert len(got.files) == len(ref)
  scale = max(np.max(np.abs(r)) for r in ref)
  for i, r in enumerate(ref):
    assert np.max(np.abs(got[f"arr_{i}"] - r)) < 1e-5 * scale, i
  specs = result["specs"]
  if mesh == "data2_model2":
    assert any(s == "P(None, 'model')" for s in specs.values()), specs
  assert any(s == "P()" for s in specs.values()), specs
