"""Runs many ``train.py`` / ``eval.py`` command lines as a user does, for the price of one start.

A driver process imports the programs' libraries once (JAX, flax, orbax, fastpos: most of a
failed run's time), then forks one child per command line, in order. The child takes the
command's environment, stdout and stderr files, and runs the script as ``__main__`` (``runpy``)
with the command's ``argv``; it ends as the program does: its exit code, its one message, or
the traceback of a bug, through the interpreter's own exit. The driver forks only while JAX has
no backend and it runs no other thread (checked), so each child starts as a fresh program would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_DRIVER = r"""
import json, os, runpy, sys, threading
import absl.app, orbax.checkpoint  # noqa: F401
import fastpos.models, fastpos.tasks, fastpos.train  # noqa: F401
from fastpos.train import cli, config_files, distributed, errors, evaluate, program  # noqa: F401
from fastpos.train import workdir  # noqa: F401
from jax._src import xla_bridge

def listing(path):
  if path is None or not os.path.exists(path):
    return None
  if os.path.isfile(path):
    st = os.stat(path)
    return [[".", st.st_size, st.st_mtime_ns]]
  out = []
  for dirpath, dirs, files in os.walk(path):
    for name in sorted(dirs + files):
      p = os.path.join(dirpath, name)
      st = os.stat(p)
      size = st.st_size if os.path.isfile(p) else -1
      out.append([os.path.relpath(p, path), size, st.st_mtime_ns])
  return sorted(out)

cases = json.load(open(sys.argv[1]))
results = []
for case in cases:
  # A fork of a process with JAX threads could deadlock: the children start from no backend.
  assert not xla_bridge._backends and threading.active_count() == 1, "the driver started JAX"
  before = listing(case.get("watch"))
  sys.stdout.flush(); sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    os.environ.update(case["env"])
    for fd, name in ((1, case["stdout"]), (2, case["stderr"])):
      f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(f, fd)
      os.close(f)
    sys.argv = [case["script"], *case["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(case["script"]))  # as "python x.py" sets it
    runpy.run_path(case["script"], run_name="__main__")
    sys.exit(0)  # the script returned: exit 0, as the interpreter would
  _, status = os.waitpid(pid, 0)
  results.append({"returncode": os.waitstatus_to_exitcode(status), "before": before,
                  "after": listing(case.get("watch"))})
print("RESULT" + json.dumps(results))
"""


@dataclasses.dataclass
class Command:
  """One command line: ``python <script> <args>`` with ``env`` added to the environment.
  ``watch``: a path listed (names, sizes, mtimes) before and after the command."""

  script: str
  args: list[str]
  env: dict[str, str] = dataclasses.field(default_factory=dict)
  watch: Path | None = None


@dataclasses.dataclass
class Result:
  returncode: int
  stdout: str
  stderr: str
  before: list | None  # listing of ``watch`` before the command (None: it did not exist)
  after: list | None


def run_all(commands: list[Command], folder: Path, env: dict[str, str]) -> list[Result]:
  """Runs ``commands`` one after another from the repository root (the process environment
  plus ``env``, then each command's own); their outputs go to files under ``folder``."""
  folder.mkdir(parents=True, exist_ok=True)
  cases = []
  for i, c in enumerate(commands):
    cases.append(
        {
            "script": c.script,
            "args": [str(a) for a in c.args],
            "env": c.env,
            "stdout": str(folder / f"{i}.out"),
            "stderr": str(folder / f"{i}.err"),
            "watch": None if c.watch is None else str(c.watch),
        }
    )
  (folder / "cases.json").write_text(json.dumps(cases))
  proc = subprocess.run(
      [sys.executable, "-c", _DRIVER, str(folder / "cases.json")],
      cwd=ROOT,
      env={**os.environ, **env},
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
  out = []
  for case, r in zip(cases, json.loads(line[len("RESULT") :])):
    out.append(
        Result(
            r["returncode"],
            Path(case["stdout"]).read_text(),
            Path(case["stderr"]).read_text(),
            _tuples(r["before"]),
            _tuples(r["after"]),
        )
    )
  return out


def _tuples(listing):
  return None if listing is None else [tuple(x) for x in listing]
