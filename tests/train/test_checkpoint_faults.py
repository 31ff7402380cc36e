"""Fault injection: one byte flipped (XOR with a random non-zero value, at a seeded random
offset) in each kind of file of the newest checkpoint and of ``best/``, then restored as a
resumed run (``checkpoints/``: damaged ones moved aside) or as ``eval.py`` / ``generate.py``
(``best/``, read-only) do. Every flip must be detected (the checkpoint is reported and the
older one used, or none loads) or provably harmless: the restored state, meta and data
position are bit for bit those of the intact checkpoint. Nothing may restore different
contents silently.

The model is width 32, so that some arrays are larger than the 1 KiB orbax stores inside its
(checksummed) B-tree nodes: their chunks sit in OCDBT data files that carry no checksum, the
case the digests exist for. The default run flips a few bytes per kind; ``-m slow`` runs the
exhaustive table (``-s`` prints it).
"""

from __future__ import annotations

import collections
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.train import resume as resume_lib
from fastpos.train import run as run_lib
from fastpos.train.checkpoint import CheckpointLoadError, Checkpoints, config_meta
from fastpos.train.state import checkpoint_tree
from tests.train.common import assert_trees_equal, tiny_config
from tests.train.faults import KINDS, flip

BEST_KINDS = tuple(k for k in KINDS if k != "data_iterator")


def _config():
  return tiny_config(**{"model.embed_dim": 32, "model.mlp_dim": 32})


def _restore(trained, workdir: Path, which: str):
  """(state, meta, data iterator state or None) as the trainer (latest, moving damaged
  checkpoints aside) or eval.py (best, read-only) restore them."""
  run, src = trained["run"], trained["train_src"]
  ckpts = Checkpoints(workdir, run.cfg, read_only=which == "best")
  try:
    found = ckpts.restore_newest(run.checkpoint_abstract, which, expect=run.expect)
  finally:
    ckpts.close()
  if which == "best":
    return found.state, found.meta, None
  it, _ = resume_lib.resume_data(run, src, found)
  return found.state, found.meta, it.get_state()


def _write_checkpoints(run, src, workdir: Path) -> None:
  """checkpoints/{2, 4} and best/4 as the trainer writes them (``Checkpoints.save``), of
  random states (no training: nothing to compile but the initialization)."""
  state, carry = run.init_state()
  rng = np.random.default_rng(0)
  ckpts = Checkpoints(workdir, run.cfg)
  ckpts.open_for_writing()
  it = run.feed.train(src, 0)
  try:
    for step in (2, 4):
      state = jax.tree.map(
          lambda x: jax.device_put(rng.normal(size=x.shape).astype(x.dtype), x.sharding)
          if jnp.issubdtype(x.dtype, jnp.floating)
          else x,
          state,
      ).replace(step=jnp.int32(step))
      for _ in range(2):
        next(it)
      meta = {
          "rng": [1, step],
          "config": config_meta(run.cfg, run.info),
          "step": step,
          "data": resume_lib.DataPosition().meta(run.cfg, len(src), step),
          "log_window": None,
      }
      ckpts.save(step, checkpoint_tree(state, carry), it, meta)
    best_meta = {**meta, "metrics": {"loss": 1.0, "accuracy": 0.5}}
    ckpts.save_best(4, checkpoint_tree(state, carry), best_meta)
    ckpts.wait()
  finally:
    ckpts.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("faults") / "run"
  run = run_lib.build_run(_config(), root)
  trained = {"root": root, "run": run, "train_src": run.task.source("train")}
  _write_checkpoints(run, trained["train_src"], root)
  trained["intact"] = {w: _restore(trained, root, w) for w in ("latest", "best")}
  assert trained["intact"]["latest"][1]["step"] == 4
  assert trained["intact"]["best"][1]["step"] == 4
  return trained


class _Warnings(logging.Handler):

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _caught_by(text: str) -> str:
  """Who noticed the damage, from the report: the digests or orbax / tensorstore / JSON."""
  return "digests" if "DigestMismatch" in text else "orbax"


def inject(trained, tmp: Path, which: str, kind: str, seed: int) -> tuple[str, str]:
  """Flips one byte of ``kind`` in the newest checkpoint of ``which`` in a copy of the
  workdir and restores it: ("detected", by whom) or ("harmless", ""); an AssertionError for a
  silent change or an unexpected error."""
  workdir = tmp / f"{which}-{kind}-{seed}"  # a fresh path: tensorstore caches by path
  shutil.copytree(trained["root"], workdir)
  step_dir = workdir / ("checkpoints" if which == "latest" else "best") / "4"
  f, offset, value = flip(step_dir, kind, np.random.default_rng(seed))
  where = f"{f.relative_to(workdir)} offset {offset} ^ {value:#04x}"
  warnings = _Warnings()
  logger = logging.getLogger("absl")
  logger.addHandler(warnings)
  try:
    state, meta, data = _restore(trained, workdir, which)
  except CheckpointLoadError as e:  # best/ keeps one checkpoint: none loads
    assert which == "best", f"{where}: the older checkpoint did not load either: {e}"
    assert f"{step_dir} (" in str(e), (where, str(e))
    return "detected", _caught_by(str(e))
  except Exception as e:  # pylint: disable=broad-except
    raise AssertionError(f"{where}: {type(e).__name__}: {e}") from None
  finally:
    logger.removeHandler(warnings)
  if meta["step"] != 4:
    assert meta["step"] == 2, where
    assert step_dir.with_name("4.corrupt").is_dir(), where
    report = [m for m in warnings.messages if f"{step_dir} does not load (" in m]
    assert report, (where, warnings.messages)
    return "detected", _caught_by(report[0])
  intact_state, intact_meta, intact_data = trained["intact"][which]
  try:
    assert_trees_equal(intact_state, state)
    assert meta == intact_meta and data == intact_data
  except AssertionError:
    raise AssertionError(f"{where}: restored silently with different contents") from None
  return "harmless", ""


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("kind", KINDS)
def test_a_flip_in_the_newest_checkpoint_is_detected_or_harmless(trained, tmp_path, kind, seed):
  inject(trained, tmp_path, "latest", kind, seed)


@pytest.mark.parametrize(
    "kind", ["array_data", *(pytest.param(k, marks=pytest.mark.slow) for k in ("meta", "digests"))]
)
def test_a_flip_in_best_is_detected_or_harmless(trained, tmp_path, kind):
  inject(trained, tmp_path, "best", kind, 0)


def test_flips_in_array_data_files_that_orbax_misses_are_caught_by_the_digests(trained, tmp_path):
  """The case the digests are for: chunks outside the B-tree carry no checksum. Seeds whose
  flip lands in such a chunk come back through orbax with changed values."""
  caught = collections.Counter(
      inject(trained, tmp_path, "latest", "array_data", seed) for seed in range(10, 14)
  )
  assert caught[("detected", "digests")] >= 1, caught


@pytest.mark.slow
def test_exhaustive_fault_table(trained, tmp_path):
  """40 flips per kind in checkpoints/ and 20 per kind in best/; prints the table."""
  rows = []
  for which, kinds, n in (("latest", KINDS, 40), ("best", BEST_KINDS, 20)):
    for kind in kinds:
      outcomes = collections.Counter(
          inject(trained, tmp_path, which, kind, 1000 + s) for s in range(n)
      )
      rows.append(
          (
              which,
              kind,
              n,
              outcomes[("detected", "digests")],
              outcomes[("detected", "orbax")],
              outcomes[("harmless", "")],
          )
      )
  print(
      "\n| checkpoint | file kind | flips | caught by digests | refused by orbax / JSON "
      "| harmless (bit-identical) | silent |"
  )
  print("|---|---|---|---|---|---|---|")
  for which, kind, n, digests, orbax, harmless in rows:
    print(f"| {which} | {kind} | {n} | {digests} | {orbax} | {harmless} | 0 |")
  total = sum(r[2] for r in rows)
  assert sum(r[3] + r[4] + r[5] for r in rows) == total  # inject raises on a silent change
  assert jax.tree.leaves(rows)


@pytest.mark.parametrize("which", ["latest", "best"])
def test_a_step_metadata_orbax_cannot_list_is_a_damaged_checkpoint(trained, tmp_path, which):
  """A flip that leaves _CHECKPOINT_METADATA valid JSON of the wrong type stops orbax from
  listing the folder at all: the step is reported (moved aside by a resume; eval.py stops with
  one message naming it)."""
  workdir = tmp_path / "w"
  shutil.copytree(trained["root"], workdir)
  step_dir = workdir / ("checkpoints" if which == "latest" else "best") / "4"
  f = step_dir / "_CHECKPOINT_METADATA"
  f.write_text(
      f.read_text().replace('"commit_timestamp_nsecs": 1', '"commit_timestamp_nsecs": 1.', 1)
  )
  if which == "best":
    with pytest.raises(
        CheckpointLoadError,
        match=rf"can be listed: {step_dir} \(ValueError: "
        r"Object must be of type .* in its _CHECKPOINT_METADATA\)",
    ):
      _restore(trained, workdir, which)
    return
  assert _restore(trained, workdir, which)[1]["step"] == 2
  assert step_dir.with_name("4.corrupt").is_dir()
