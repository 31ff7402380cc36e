"""Every ``:tiny`` config runs as written: its task builds from the repository's fixtures (or
is generated), or its docstring names the download and the task's error names the missing data;
a few of them train two steps in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from configs import common
from fastpos import tasks
from fastpos.train import cli, config_files, train_and_evaluate

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_") and p.stem != "common"
)


def _tiny_specs() -> list[str]:
  """``path:tiny`` of every config, once per task choice where the file takes ``task=``."""
  out = []
  for path in CONFIGS:
    module = config_files.load_module(str(path))
    choices = getattr(module, "CHOICES", {}).get("task")
    args = [f"tiny,task={t}" for t in choices] if choices else ["tiny"]
    out += [f"{path}:{a}" for a in args]
  return out


SPECS = _tiny_specs()


def _id(spec: str) -> str:
  return Path(spec).name.replace(".py", "")


@pytest.fixture
def no_real_data(tmp_path, monkeypatch):
  """An empty default data root, so that no test reads data this machine happens to hold."""
  monkeypatch.setenv("FASTPOS_DATA_DIR", str(tmp_path / "no_data"))


def test_every_config_has_tiny_variants():
  assert len(SPECS) >= len(CONFIGS) and any("wikitext103" in s for s in SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_tiny_task_builds_from_the_fixtures(spec, no_real_data):
  cfg = cli.load_config(spec)
  task = tasks.make_task(cfg.task)
  name = cfg.task.name
  if task.generated or name in common.FIXTURES:
    if name in common.FIXTURES and cfg.task.get("source") != "generated":
      assert Path(cfg.task.data_dir) == Path(common.FIXTURES_ROOT) / common.FIXTURES[name]
    for split in ("train", "validation"):  # loading checks ids and shapes against TaskInfo
      assert len(task.source(split)) > 0
    words = task.vocabulary() if hasattr(task, "vocabulary") else None
    if words is not None:  # the fixtures fill the vocabulary: every id is a word
      assert len(words) == task.info.vocab_size and len(set(words)) == len(words)
  else:  # real data only: the docstring and the error both name the download
    doc = config_files.load_module(spec.split(":")[0]).__doc__
    assert "scripts/download_data.py" in doc and name in doc, (name, doc)
    with pytest.raises(FileNotFoundError, match=f"download_data.py {name}"):
      task.source("train")


def test_tiny_fixtures_are_overridable(no_real_data):
  cfg = cli.load_config(
      f"{ROOT / 'configs' / 'wikitext103_nprf_table2.py'}:tiny", [("task.data_dir", "")]
  )
  with pytest.raises(FileNotFoundError, match="download_data.py wikitext103"):
    tasks.make_task(cfg.task).source("train")


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        "wikitext103_nprf_table2.py:tiny",
        "fastrpb_table1.py:tiny,task=listops",
        "permuteformer_table1.py:tiny,task=retrieval",
        "text_lm.py:tiny",
    ],
)
def test_tiny_config_trains_two_steps(spec, tmp_path, no_real_data):
  cfg = cli.load_config(
      f"{ROOT / 'configs' / spec}",
      [
          ("num_train_steps", "2"),
          ("log_every_steps", "1"),
          ("eval_every_steps", "2"),
          ("checkpoint_every_steps", "2"),
      ],
  )
  r = train_and_evaluate(cfg, tmp_path / "work")
  assert r["step"] == 2 and np.isfinite(r["validation"]["loss"])
  assert not list((ROOT / "tests" / "testdata").rglob("cache"))  # nothing cached there
