"""Test-wide settings, and a guard that keeps every test from seeing what another one left.

* JAX: float64 available, implicit rank promotion is an error.
* ``_process_state_guard`` (autouse): snapshots the process state that a test can change by
  accident (the logging tree: levels, handlers, filters, propagation of every logger, absl's
  verbosity; ``os.environ``; the working directory; ``jax.config``) and, after the test,
  restores it and fails the test naming what it left changed. A test that must change one of
  them restores it itself (``monkeypatch``, ``caplog``, try / finally) or uses a fixture of a
  wider scope, whose changes are part of the snapshot. Loggers that first appear during a test
  are a library's own set-up at its first import, and are left alone.
* ``_cache_in_tmp`` (autouse, session): tasks' default cache folder (``$FASTPOS_CACHE_DIR``) is
  a temporary folder, so no test writes caches into the repository or the user's home.
* ``_programs_compilation_cache`` (autouse, session): the programs the tests start (train.py,
  eval.py, examples, scripts) share one persistent JAX compilation cache, so a step that several
  of them compile is compiled once per run (the cached executable is the one XLA would build).
* Under pytest-xdist (``-n 2`` without ``--dist``), ``pytest_xdist_make_scheduler`` deals the
  tests one at a time as workers free up, except that a module with a module-scoped fixture (or
  an ``xdist_group`` mark) goes to one worker as a whole: its fixture is built once (plain
  ``load`` could build it on both workers), and such modules are dealt before the single tests,
  so the expensive ones start first instead of ending the run on one worker.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
from pathlib import Path

import jax
import pytest

# tensorboardX sets os.environ["CRC32C_SW_MODE"] when first imported: import it before the
# state guard takes its snapshot, so that no test is blamed for the first import.
import tensorboardX  # noqa: F401
from absl import flags
from absl import logging as absl_logging  # noqa: F401  (defines the verbosity flag)

from fastpos import interrupts  # standard library only: imports no JAX
from tests.helpers import FAST_COMPILE_FLAGS

# Pallas's first interpret-mode call (the fused kernels' tests, mode="fused" anywhere) imports
# Mosaic GPU, which sets os.environ["MOSAIC_GPU_CUDA_ROOT"]: likewise imported up front.
try:
  import jax.experimental.mosaic.gpu  # noqa: F401
except ImportError:  # a jaxlib without Mosaic GPU: nothing to set
  pass

# The first checkpoint read installs a filter that stays on asyncio's logger (abandoned reads
# of a failed restore are logged seconds later): installed up front, so no test is blamed.
from fastpos.train import checkpoint as _checkpoint  # noqa: E402  (after the imports above)

_checkpoint.drop_orbax_leftovers()

_ROOT = Path(__file__).resolve().parents[1]

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

# The tests' programs are tiny: compiling them is most of the suite's time, and XLA's CPU
# backend compiles about a quarter faster without its LLVM optimisations (same results up to
# round-off, which every comparison allows for). Only this process: XLA reads XLA_FLAGS once,
# at its first compile, so the variable is set for that compile and restored at once, and the
# programs the tests start (train.py, sweeps, benchmarks) compile as users' do.
_FAST_COMPILE_FLAGS = FAST_COMPILE_FLAGS


def _compile_fast() -> None:
  before = os.environ.get("XLA_FLAGS")
  os.environ["XLA_FLAGS"] = f"{before or ''} {_FAST_COMPILE_FLAGS}".strip()
  try:
    jax.jit(lambda x: x + 1)(0).block_until_ready()
  finally:
    if before is None:
      del os.environ["XLA_FLAGS"]
    else:
      os.environ["XLA_FLAGS"] = before


_compile_fast()


def _loggers() -> dict[str, logging.Logger]:
  out = {"": logging.getLogger()}
  for name, logger in list(logging.Logger.manager.loggerDict.items()):
    if isinstance(logger, logging.Logger):
      out[name] = logger
  return out


def _logger_state(logger: logging.Logger) -> tuple:
  return (
      logger.level,
      logger.propagate,
      logger.disabled,
      tuple(logger.handlers),
      tuple(logger.filters),
  )


# pytest's own: the phase of the running test.
_ENV_IGNORED = ("PYTEST_CURRENT_TEST",)


def _environ() -> dict[str, str]:
  return {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED}


def _snapshot() -> dict:
  return {
      "loggers": {name: _logger_state(lg) for name, lg in _loggers().items()},
      "absl_verbosity": flags.FLAGS["verbosity"].value,
      "environ": _environ(),
      "cwd": os.getcwd(),
      "jax_config": jax.config.values,
      "signals": _signal_state(),
  }


def _signal_state() -> tuple:
  """SIGINT's and SIGTERM's handlers, and whether ``fastpos.interrupts`` has taken them over
  (only a program does: an import of train.py or a script as a module must not)."""
  handlers = tuple(signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM))
  return handlers, interrupts.installed()


def _restore_logger(logger: logging.Logger, state: tuple) -> None:
  level, propagate, disabled, handlers, filters = state
  logger.setLevel(level)
  logger.propagate, logger.disabled = propagate, disabled
  logger.handlers[:] = list(handlers)
  logger.filters[:] = list(filters)


def _restore(before: dict) -> list[str]:
  """Puts back what changed since ``before``; returns a line per change."""
  changed, loggers = [], []
  verbosity = flags.FLAGS["verbosity"].value
  if verbosity != before["absl_verbosity"]:
    changed.append(
        f"absl verbosity {before['absl_verbosity']} -> {verbosity} " "(absl.logging.set_verbosity)"
    )
  for name, logger in _loggers().items():
    if name not in before["loggers"]:
      # Created during the test: a library imported for the first time set up its own
      # logger (e.g. a NullHandler); that is the library's state, whichever test imports it.
      continue
    old, new = before["loggers"][name], _logger_state(logger)
    if new != old:
      fields = ("level", "propagate", "disabled", "handlers", "filters")
      diff = ", ".join(f"{f} {o!r} -> {n!r}" for f, o, n in zip(fields, old, new) if o != n)
      changed.append(f"logger {name or 'root'!r}: {diff}")
      loggers.append((logger, old))
  if verbosity != before["absl_verbosity"]:
    # Through the flag, as set_verbosity does (it sets logger levels: restored next).
    flags.FLAGS.verbosity = before["absl_verbosity"]
    loggers = [(lg, before["loggers"][n]) for n, lg in _loggers().items() if n in before["loggers"]]
  for logger, old in loggers:
    _restore_logger(logger, old)
  env = os.environ
  if _environ() != before["environ"]:
    for key in sorted(set(_environ()) | set(before["environ"])):
      old, new = before["environ"].get(key), env.get(key)
      if old != new:
        changed.append(f"os.environ[{key!r}]: {old!r} -> {new!r}")
        if old is None:
          del env[key]
        else:
          env[key] = old
  if os.getcwd() != before["cwd"]:
    changed.append(f"working directory {before['cwd']} -> {os.getcwd()}")
    os.chdir(before["cwd"])
  now = jax.config.values
  for key, old in before["jax_config"].items():
    if now.get(key) != old:
      changed.append(f"jax.config {key}: {old!r} -> {now.get(key)!r}")
      jax.config.update(key, old)
  signals = _signal_state()
  if signals != before["signals"]:
    changed.append(
        f"signal handlers (SIGINT, SIGTERM), interrupts installed: {before['signals']} -> {signals}"
    )
    _restore_signals(before["signals"])
  return changed


def _restore_signals(state: tuple) -> None:
  (sigint, sigterm), installed = state
  if interrupts.installed() and not installed:
    signal.set_wakeup_fd(-1)
    interrupts._WATCH = None  # pylint: disable=protected-access
  signal.signal(signal.SIGINT, sigint)
  signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture(autouse=True, scope="session")
def _cache_in_tmp(tmp_path_factory):
  # Session scope: set before the state guard's first snapshot, so it is part of every one;
  # programs the tests start inherit it.
  mp = pytest.MonkeyPatch()
  mp.setenv("FASTPOS_CACHE_DIR", str(tmp_path_factory.mktemp("fastpos_cache")))
  yield
  mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _programs_compilation_cache(tmp_path_factory):
  # The environment only: this process read JAX's settings at import, so its own compiles are
  # unaffected. One folder per run, for both xdist workers (their base temps share a parent).
  run = tmp_path_factory.getbasetemp()
  cache = (run.parent if os.environ.get("PYTEST_XDIST_WORKER") else run) / "programs_jax_cache"
  cache.mkdir(exist_ok=True)
  mp = pytest.MonkeyPatch()
  mp.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
  mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  mp.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  yield
  mp.undo()


# A test module is dealt to one xdist worker as a whole when it has a module-scoped fixture or an
# ``xdist_group`` mark: its fixture is then built once.
_GROUPED = re.compile(r'scope="module"|pytest\.mark\.xdist_group\(')


@functools.cache
def _grouped_module(path: str) -> bool:
  try:
    return bool(_GROUPED.search((_ROOT / path).read_text(encoding="utf-8")))
  except OSError:
    return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """``-n N`` without ``--dist``: load balancing, one test at a time, except that the tests of a
  grouped module go to one worker together, and before any single test. (xdist's own
  ``loadgroup`` cannot mark tests under this pytest: it renames ``item._nodeid``, which pytest
  no longer reads.)"""
  given = " ".join([*config.invocation_params.args, os.environ.get("PYTEST_ADDOPTS", "")])
  if config.option.dist != "load" or "--dist" in given:
    return None
  from xdist.scheduler import LoadScopeScheduling  # only under xdist

  class SharedFixtureScheduling(LoadScopeScheduling):

    def _split_scope(self, nodeid: str) -> str:
      path = nodeid.split("::", 1)[0]
      return path if _grouped_module(path) else nodeid

  return SharedFixtureScheduling(config, log)


@pytest.fixture(autouse=True)
def _process_state_guard():
  before = _snapshot()
  yield
  changed = _restore(before)
  if changed:
    pytest.fail(
        "the test left process state changed (restored now; restore it in the test "
        "or its fixture):\n  " + "\n  ".join(changed),
        pytrace=False,
    )


def pytest_collection_finish(session):
  """No test module may take over the process's signals when it is imported (a program's
  ``interrupts.install`` runs only under ``__main__``): every later test would inherit it."""
  del session
  if interrupts.installed():
    raise pytest.UsageError(
        "a test module's import ran fastpos.interrupts.install(): guard it with "
        "if __name__ == '__main__'."
    )
