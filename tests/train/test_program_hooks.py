"""The programs' hooks for errors raised where nobody can catch them (``fastpos.train.program``):
one line per distinct error, and orbax's leftovers after a failed checkpoint read (abandoned
sibling reads, callbacks into its closed event loop) at debug level only."""

from __future__ import annotations

import logging
import types

import pytest

from fastpos.train import checkpoint, program


def _coroutine(filename: str, name: str):
  """A coroutine object whose code says it comes from ``filename``, function ``name``."""
  scope = {}
  exec(compile(f"async def {name}():\n  pass\n", filename, "exec"), scope)
  return scope[name]()


def _unraisable(obj, exc):
  return types.SimpleNamespace(object=obj, exc_type=type(exc), exc_value=exc, err_msg=None)


@pytest.fixture
def errors(monkeypatch, caplog):
  """The ERROR records the hook logs, from a fresh set of already-reported errors."""
  monkeypatch.setattr(program, "_SEEN_BACKGROUND", set())
  caplog.set_level(logging.DEBUG)
  return lambda: [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_orbax_leftovers_after_a_failed_read_are_not_errors(errors):
  read = _coroutine("/site-packages/orbax/checkpoint/serialization.py", "_read_shard")
  try:
    program._unraisable_hook(_unraisable(read, Exception("reading failed\n{'spec': 1}")))
  finally:
    read.close()
  program._unraisable_hook(_unraisable(None, RuntimeError("Event loop is closed")))
  assert errors() == []


def test_other_unraisable_errors_are_one_line_each_once(errors):
  other = _coroutine("/somewhere/else.py", "_read_shard")
  try:
    exc = Exception("it broke\n  'base': {\n  }")
    for _ in range(2):
      program._unraisable_hook(_unraisable(other, exc))
  finally:
    other.close()
  (record,) = errors()
  assert record.getMessage() == "ignored exception: Exception: it broke"


def test_tensorstore_details_are_cut_from_the_line():
  exc = Exception(
      "Encountered error while reading array index: (). See full TensorStore details: <x"
  )
  assert program._first_line(exc) == "Encountered error while reading array index: ()."


def test_asyncio_logs_of_abandoned_tensorstore_reads_are_dropped_and_others_kept(caplog):
  """A failed restore's sibling reads are logged by asyncio when collected, after the restore
  has returned: the filter that drops them stays installed (``drop_orbax_leftovers``)."""
  checkpoint.drop_orbax_leftovers()
  logger = logging.getLogger("asyncio")
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    logger.error(
        "Future exception was never retrieved\nfuture: <Future finished exception="
        "ValueError('Error opening \"zarr\" driver [tensorstore_spec=...]')>"
    )
    logger.error("Future exception was never retrieved\nfuture: <Future exception=KeyError(1)>")
    logger.error("Task was destroyed but it is pending! [tensorstore_spec=...]")
  kept = [r.getMessage() for r in caplog.records]
  assert len(kept) == 2 and "KeyError" in kept[0] and "destroyed" in kept[1], kept
