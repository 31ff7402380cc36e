"""Where tasks cache their preprocessing: a cache folder (``$FASTPOS_CACHE_DIR``, else
``$XDG_CACHE_HOME/fastpos``, else ``~/.cache/fastpos``), never the data root."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from fastpos import tasks
from fastpos.tasks import paths

TESTDATA = paths.SAMPLES


def test_cache_root_order(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("FASTPOS_CACHE_DIR", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  assert paths.cache_dir("wikitext103") == str(
      tmp_path / "home" / ".cache" / "fastpos" / "wikitext103"
  )
  monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG spec: ignored
  assert paths.cache_root() == str(tmp_path / "home" / ".cache" / "fastpos")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert paths.cache_dir("lra_text") == str(tmp_path / "xdg" / "fastpos" / "lra_text")
  monkeypatch.setenv("FASTPOS_CACHE_DIR", str(tmp_path / "mine"))
  assert paths.cache_dir("lra_text") == str(tmp_path / "mine" / "lra_text")


def _tree(root) -> dict[str, tuple[int, int]]:
  """relative path -> (size, mtime_ns) of everything under ``root``."""
  out = {}
  for folder, dirs, files in os.walk(root):
    for name in dirs + files:
      p = os.path.join(folder, name)
      st = os.stat(p)
      out[os.path.relpath(p, root)] = (st.st_size if name in files else 0, st.st_mtime_ns)
  return out


def _read_only(root) -> None:
  for folder, _, files in os.walk(root):
    for name in files:
      os.chmod(os.path.join(folder, name), stat.S_IRUSR | stat.S_IRGRP)
    os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)


def _writable(root) -> None:
  for folder, _, files in os.walk(root):
    os.chmod(folder, 0o755)
    for name in files:
      os.chmod(os.path.join(folder, name), 0o644)


@pytest.mark.parametrize(
    "name, fixture, fields",
    [
        ("wikitext103", "wikitext", dict(segment_length=16, vocab_size=50)),
        ("lra_retrieval", "retrieval", dict(max_length=64)),
        (
            "text_lm",
            "wikitext",
            dict(level="word", vocab_size=50, include="*.tokens", segment_length=16),
        ),
    ],
)
def test_a_read_only_data_root_is_left_untouched(tmp_path, monkeypatch, name, fixture, fields):
  """The default cache goes to $XDG_CACHE_HOME/fastpos/<task>; the data folder gets nothing."""
  monkeypatch.delenv("FASTPOS_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  data = tmp_path / "data"
  shutil.copytree(os.path.join(TESTDATA, fixture), data)
  _read_only(data)
  before = _tree(data)
  try:
    cfg = tasks.task_config(name)
    where = {"paths": str(data)} if name == "text_lm" else {"data_dir": str(data)}
    cfg.update({**where, **fields})
    task = tasks.make_task(cfg)
    for split in ("train", "validation"):
      assert len(task.source(split)) > 0
    assert _tree(data) == before
  finally:
    _writable(data)  # so that pytest can remove tmp_path
  assert os.listdir(tmp_path / "xdg" / "fastpos" / name)
