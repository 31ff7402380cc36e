"""Where the real datasets live, and the one message a task gives when they are missing.

Every task's ``config.task.data_dir`` is the *data root*: the folder that
``python scripts/download_data.py TASK... --data_dir DIR`` fills. "" means the environment
variable ``FASTPOS_DATA_DIR``, else ``~/fastpos_data``. Layout under the root::

    DIR/
      tfds/                      tfds data_dir (array_record): imdb_reviews, cifar10, mnist
      lra_release/               the LRA release archive (lra_release.gz), unpacked:
        listops-1000/            basic_{train,val,test}.tsv
        tsv_data/                new_aan_pairs.{train,eval,test}.tsv (Retrieval)
        pathfinder32/ ...        curv_baseline, curv_contour_length_9, curv_contour_length_14
        pathfinder128/ ...       (Path-X)
      wikitext-103/              wiki.{train,valid,test}.tokens

Preprocessing caches (tokenised arrays, vocabularies) never go into the data root, which may be
read-only or shared: they go to ``cache_dir(task)``, i.e. ``$FASTPOS_CACHE_DIR/<task>``, else
``$XDG_CACHE_HOME/fastpos/<task>``, else ``~/.cache/fastpos/<task>`` (a task's
``config.task.cache_dir`` overrides it).

Nothing is ever downloaded while training or testing: a task whose files are missing raises
``missing_data`` (a FileNotFoundError naming the missing path and the command that fetches it).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import Callable, Iterator, Mapping

import numpy as np

ENV_VAR = "FASTPOS_DATA_DIR"
DEFAULT_ROOT = "~/fastpos_data"

TFDS_SUBDIR = "tfds"
LRA_SUBDIR = "lra_release"
WIKITEXT_SUBDIR = "wikitext-103"
CACHE_ENV_VAR = "FASTPOS_CACHE_DIR"
# Small samples of three datasets, shipped with the package, each a data root in the layout
# above: samples/listops (ListOps tsv), samples/retrieval and samples/wikitext (a few hundred
# lines each). The ``tiny`` configs read them (configs/common.py); so do the tests.
SAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")


def data_root(data_dir: str | os.PathLike | None = None) -> str:
  """The data root: ``data_dir`` if given, else ``$FASTPOS_DATA_DIR``, else ``~/fastpos_data``."""
  root = os.fspath(data_dir) if data_dir else os.environ.get(ENV_VAR) or DEFAULT_ROOT
  return os.path.abspath(os.path.expanduser(root))


def task_path(data_dir: str | os.PathLike | None, *parts: str) -> str:
  """A path under the data root."""
  return os.path.join(data_root(data_dir), *parts)


def cache_root() -> str:
  """``$FASTPOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastpos``, else ``~/.cache/fastpos``."""
  root = os.environ.get(CACHE_ENV_VAR)
  if not root:
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says a relative $XDG_CACHE_HOME is invalid and must be ignored.
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join("~", ".cache")
    root = os.path.join(base, "fastpos")
  return os.path.abspath(os.path.expanduser(root))


def cache_dir(task: str) -> str:
  """The default cache folder of ``task`` (``cache_root()/<task>``, never under the data root;
  created by the writer when needed)."""
  return os.path.join(cache_root(), task)


def fetch_command(task: str, data_dir: str | os.PathLike | None) -> str:
  """The exact command that fetches ``task``'s data into the root of ``data_dir``."""
  return f"python scripts/download_data.py {task} --data_dir {data_root(data_dir)}"


def missing_data(
    task: str, path: str | os.PathLike, data_dir: str | os.PathLike | None, what: str = ""
) -> FileNotFoundError:
  """The error for missing data: names the path and the command that fetches it (or, when a
  file or a symlink loop stands where a folder on the way should be, that)."""
  blocked = _blocked(path)
  if blocked:
    return FileNotFoundError(
        f"task {task!r}: cannot read {os.fspath(path)!r}: {blocked}; point "
        f"config.task.data_dir / ${ENV_VAR} at the folder that holds the data."
    )
  what = f" ({what})" if what else ""
  return FileNotFoundError(
      f"task {task!r}: {os.fspath(path)!r} not found{what}. Fetch the data on a machine with "
      f"internet with `{fetch_command(task, data_dir)}` (or set config.task.data_dir / "
      f"${ENV_VAR} to the folder that holds it). Nothing is downloaded during training."
  )


def _blocked(path: str | os.PathLike) -> str:
  """Why ``path`` cannot exist: an ancestor that is a file or a symlink loop ("" if none)."""
  parts = os.path.abspath(os.fspath(path))
  chain = []
  while parts not in chain:
    chain.append(parts)
    parts = os.path.dirname(parts)
  for folder in reversed(chain[1:]):  # from the root down, the path itself excluded
    try:
      if not os.path.isdir(folder) and os.path.exists(folder):
        return f"{folder} is a file, not a folder"
      os.stat(folder)
    except FileNotFoundError:
      return ""
    except OSError as e:
      if e.errno == errno.ELOOP:
        return f"{folder} is a symlink loop"
      return ""
  return ""


def not_a_folder(path: str | os.PathLike) -> str:
  """Why ``path`` cannot be (or become) a folder: it or a folder above it is a file or a
  symlink loop ("" when it can)."""
  try:
    if os.path.exists(path) and not os.path.isdir(path):
      return f"{os.fspath(path)} is a file, not a folder"
    os.stat(path)
  except OSError as e:
    if e.errno == errno.ELOOP:
      return f"{os.fspath(path)} is a symlink loop"
  return _blocked(path)


_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_file(path: str | os.PathLike) -> str:
  """What ``path`` is when it exists but is neither a regular file nor a folder (a FIFO,
  ``/dev/zero``: reading it blocks or never ends), e.g. "a character device"; "" otherwise."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return ""
  return next((what for test, what in _SPECIAL_FILES if test(mode)), "")


def require(
    task: str, path: str | os.PathLike, data_dir: str | os.PathLike | None, what: str = ""
) -> str:
  """``path`` if it exists, else raises ``missing_data``."""
  if not os.path.exists(path):
    raise missing_data(task, path, data_dir, what)
  return os.fspath(path)


def save_atomic(path: str, write: Callable) -> None:
  """Writes a cache file atomically: ``write(f)`` fills a temporary file in the same folder,
  which then replaces ``path`` (a crash leaves the old file or none, never half of one)."""
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_" + os.path.basename(path) + ".")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared data root wants it readable
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def save_npz_atomic(path: str, arrays: Mapping[str, np.ndarray]) -> None:
  """``np.savez`` of ``arrays`` to ``path``, atomically (``save_atomic``)."""
  save_atomic(path, lambda f: np.savez(f, **arrays))


def read_lines(path: str) -> Iterator[tuple[int, bytes]]:
  """(line number from 1, the line's bytes without its end) of a text file; LF and CRLF ends
  are read alike. Bytes, so that a reader decodes (and names a bad line) itself."""
  with open(path, "rb") as f:
    for line_no, line in enumerate(f, start=1):
      if line.endswith(b"\n"):
        line = line[:-1]
      if line.endswith(b"\r"):
        line = line[:-1]
      yield line_no, line
