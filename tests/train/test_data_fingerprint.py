"""A run's data are part of it (Task.fingerprint, fastpos.train.identity): a text_lm run whose
file changed (a word changed, the lines reversed, a line appended; at word level the
vocabulary with it) is refused at resume, naming the file, and resumes with
--allow_config_change, the change recorded; the same file reached twice, or two files with the
same text, is refused before anything is read twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastpos import tasks
from fastpos.tasks.paths import SAMPLES
from fastpos.train import cli, config_record, identity, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over the lazy dog"
TEXT = "".join(f"{WORDS} {i % 7} and {i % 3}\n" for i in range(80))
EDITS = {
    "content": lambda t: t.replace("fox", "cow"),
    "reversed": lambda t: "".join(reversed(t.splitlines(keepends=True))),
    "appended": lambda t: t + f"{WORDS} once more\n",
}


def _config(path: Path, cache: Path, level: str, steps: int):
  cfg = cli.load_config(f"{ROOT}/configs/text_lm.py:tiny,paths={path},level={level}", lock=False)
  cfg.task.update(cache_dir=str(cache), segment_length=16, include="*.txt")
  if level == "word":
    cfg.task.vocab_size = 12  # TEXT has 16 word types: ids depend on which 9 are kept
  cfg.schedule.name = "constant"  # more steps on resume change nothing else
  cfg.num_train_steps = steps
  cfg.log_every_steps = cfg.eval_every_steps = cfg.checkpoint_every_steps = 2
  cfg.num_eval_batches = 1
  cfg.data.num_threads = 1
  return cfg


# The default run: the word level (its vocabulary changes with the text) with a word changed
# and the lines reversed (the same bytes in another order); the byte level and an appended
# line run with `-m slow`.
@pytest.fixture(scope="module", params=[pytest.param("byte", marks=pytest.mark.slow), "word"])
def trained(request, tmp_path_factory):
  """(workdir, text file, cache, level): 2 steps of the tiny text_lm config on TEXT."""
  root = tmp_path_factory.mktemp(f"data_{request.param}")
  text = root / "text" / "corpus.txt"
  text.parent.mkdir()
  text.write_text(TEXT)
  cache = root / "cache"
  train_and_evaluate(_config(text, cache, request.param, 2), root / "run")
  return root / "run", text, cache, request.param


@pytest.mark.parametrize(
    "edit", [e if e != "appended" else pytest.param(e, marks=pytest.mark.slow) for e in EDITS]
)
def test_changed_data_are_refused_then_accepted_and_recorded(trained, tmp_path, edit):
  src, text, cache, level = trained
  workdir = tmp_path / "run"
  shutil.copytree(src, workdir)
  text.write_text(EDITS[edit](TEXT))
  try:
    cfg = _config(text, cache, level, 4)
    with pytest.raises(RunError) as info:
      train_and_evaluate(cfg, workdir)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"the data of the run in {workdir} changed")
    assert f"{text} changed" in line and "--allow_config_change" in line
    if level == "word" and edit == "content":  # fox -> cow: another word at fox's id
      assert "the vocabulary differs" in line, line
    assert not (workdir / workdir_lib.CHANGES_NAME).exists()
    result = train_and_evaluate(cfg, workdir, allow_config_change=True)
    assert result["step"] == 4
    (entry,) = config_record.read_changes(workdir)
    assert not any(c["affects_results"] for c in entry["changes"])  # num_train_steps only
    assert entry["data"]["what"].startswith(f"{text} changed")
    fingerprint = entry["data"]["new"]
    assert fingerprint["files"][0][0] == str(text)
    meta = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["run"]["data"] == identity.data_digest(fingerprint)
    assert "data (" in config_record.describe([entry])
    train_and_evaluate(_config(text, cache, level, 6), workdir)  # the new data: no change
    assert "data" not in config_record.read_changes(workdir)[-1]
  finally:
    text.write_text(TEXT)


def _task(paths: str, tmp_path: Path):
  c = tasks.task_config("text_lm")
  c.update(paths=paths, cache_dir=str(tmp_path / "cache"), segment_length=16)
  return tasks.make_task(c)


def test_a_file_reached_twice_or_the_same_text_twice_is_refused(tmp_path):
  folder = tmp_path / "books"
  folder.mkdir()
  (folder / "a.txt").write_text(TEXT)
  (folder / "b.txt").write_text("another text\n" * 20)
  a = folder / "a.txt"
  for paths in (f"{a},{a}", f"{folder},{a}", f"{a},{tmp_path}/books/../books/a.txt"):
    with pytest.raises(ValueError, match=rf"reaches '{a}' twice"):
      _task(paths, tmp_path).source("train")
  (folder / "copy.txt").write_text(TEXT)
  with pytest.raises(ValueError, match=r"a.txt' and '.*copy.txt' \(config.task.paths\) hold"):
    _task(str(folder), tmp_path).source("train")


def test_the_fingerprint_holds_each_files_bytes_and_the_settings(tmp_path):
  a = tmp_path / "a.txt"
  a.write_text(TEXT)
  task = _task(str(a), tmp_path)
  task.source("train")
  fp = task.fingerprint()
  assert fp["task"] == "text_lm" and fp["settings"]["level"] == "byte"
  assert "cache_dir" not in fp["settings"]  # where the cache lives changes nothing
  path, sha = fp["files"][0]
  assert path == str(a) and len(sha) == 64
  a.write_text(EDITS["content"](TEXT))
  again = _task(str(a), tmp_path)
  again.source("train")
  assert identity.data_differences(fp, again.fingerprint()) == f"{a} changed"


def test_listops_fingerprints_the_release_files_it_trains_on(tmp_path):
  root = tmp_path / "data"
  shutil.copytree(Path(SAMPLES) / "listops", root)
  c = tasks.task_config("listops")
  c.update(source="tsv", data_dir=str(root), max_length=64, min_length=1)
  fp = tasks.make_task(c).fingerprint()
  train = root / "lra_release" / "listops-1000" / "basic_train.tsv"
  assert [p for p, _ in fp["files"]] == [str(train), str(train.with_name("basic_val.tsv"))]
  train.write_text(train.read_text().replace("MAX", "MIN", 1))
  again = tasks.make_task(c).fingerprint()
  assert identity.data_differences(fp, again) == f"{train} changed"
  # Generated: the generator's settings alone (a change of them is a config change).
  generated = tasks.make_task(tasks.task_config("listops")).fingerprint()
  assert "files" not in generated and generated["settings"]["seed"] == 0
