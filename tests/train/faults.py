"""Ways to damage a checkpoint on disk, for the tests of checkpoint verification.

``flip`` XORs one byte of a file with a non-zero value (the size stays the same, so nothing
is missing); ``fault_sites`` lists, for each kind of file in a checkpoint, the byte ranges a
flip may land in; ``rewrite_state`` / ``edit_json`` make well-formed checkpoints whose contents
differ from what was saved (what a flip that orbax cannot see does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from fastpos.train import digest as digest_lib

# The kinds of file in a checkpoint folder <step>/ (best/ has no data/).
KINDS = ("array_data", "state_index", "orbax_metadata", "data_iterator", "meta", "digests")


def _spans_of_meta(meta_file: Path) -> tuple[tuple[int, int], tuple[int, int]]:
  """(the meta record without the digests, the digest record): byte ranges of the file."""
  text = meta_file.read_bytes()
  start = text.index(b'"digests"')
  return (0, start), (start, len(text))


def fault_sites(step_dir: Path, kind: str) -> list[tuple[Path, int, int]]:
  """``[(file, lo, hi)]``: where a flip of ``kind`` may land (offsets ``lo <= o < hi``).

  array_data: orbax's OCDBT data and B-tree files (``state/**/d/*``); state_index: the
  OCDBT manifests and orbax's tree, sharding and array metadata; orbax_metadata: the
  checkpoint's and items' commit files; data_iterator: grain's position files; meta: the meta
  record outside its digests; digests: the digest record.
  """
  state = step_dir / "state"
  files: list[Path]
  if kind == "array_data":
    files = [f for f in state.rglob("*") if f.is_file() and f.parent.name == "d"]
  elif kind == "state_index":
    files = [
        f
        for f in state.rglob("*")
        if f.is_file()
        and (
            f.name in ("manifest.ocdbt", "_METADATA", "_sharding")
            or f.parent.name == "array_metadatas"
        )
    ]
  elif kind == "orbax_metadata":
    files = [
        f
        for f in step_dir.rglob("*")
        if f.is_file() and f.name in ("_CHECKPOINT_METADATA", "commit_success.txt")
    ]
  elif kind == "data_iterator":
    files = sorted((step_dir / "data").glob("process_*.json"))
  elif kind in ("meta", "digests"):
    meta_file = step_dir / "meta" / "metadata"
    lo, hi = _spans_of_meta(meta_file)[0 if kind == "meta" else 1]
    return [(meta_file, lo, hi)]
  else:
    raise ValueError(f"unknown fault kind {kind!r}; valid: {', '.join(KINDS)}")
  return [(f, 0, f.stat().st_size) for f in sorted(files) if f.stat().st_size]


def flip(step_dir: Path, kind: str, rng: np.random.Generator) -> tuple[Path, int, int]:
  """XORs one byte of the files of ``kind``, at a random offset (uniform over their bytes),
  with a random non-zero value; returns (file, offset, value). The files are taken largest
  first (orbax names data files by random hashes; their sizes are what repeats)."""
  sites = sorted(fault_sites(step_dir, kind), key=lambda s: (s[1] - s[2], s[0].name))
  if not sites:
    raise ValueError(f"{step_dir} has no file of kind {kind!r}")
  pick = int(rng.integers(sum(hi - lo for _, lo, hi in sites)))
  for f, lo, hi in sites:  # noqa: B007 (f, the file picked, is read after the loop)
    if pick < hi - lo:
      break
    pick -= hi - lo
  offset = lo + pick
  value = int(rng.integers(1, 256))
  data = bytearray(f.read_bytes())
  data[offset] ^= value
  f.write_bytes(bytes(data))
  return f, offset, value


def rewrite_state(
    step_dir: Path, change: Callable[[dict], None], *, redigest: bool = False
) -> None:
  """Rewrites ``step_dir/state`` through orbax (well formed, so orbax sees nothing wrong) with
  ``change(tree)`` applied in place to the saved tree (nested dicts of numpy arrays). The
  meta keeps the digests of the old contents unless ``redigest`` (then the checkpoint is
  consistent again, as a checkpoint saved from the changed state would be)."""
  with ocp.StandardCheckpointer() as c:
    raw = jax.tree.map(np.array, c.restore(step_dir / "state"))
  change(raw)
  shutil.rmtree(step_dir / "state")
  with ocp.StandardCheckpointer() as c:
    c.save(step_dir / "state", raw)
  if redigest:

    def update(meta):
      meta["digests"]["arrays"] = digest_lib.array_digests(raw)
      meta["digests"]["meta"] = digest_lib.meta_digest(meta)

    edit_json(step_dir / "meta" / "metadata", update)


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
  """Rewrites a JSON file with ``change(value)`` applied to its value in place."""
  value = json.loads(path.read_text())
  change(value)
  path.write_text(json.dumps(value))
