"""fastpos.tasks.download (scripts/download_data.py) without network: arguments, the plan
(--dry_run / --list), checksum verification, resumable .part files, unpacking of tiny tar.gz /
zip fixtures served by file:// URLs, and the tasks reading what it unpacked (with a 2-step
ListOps run on it).

The LRA fixture archive nests its folders as ``lra_release/lra_release/<folder>/`` (one of the
prefixes reported for the real archive) and holds a folder no task asks for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import numpy as np
import pytest

from fastpos.tasks import download as dd
from fastpos.tasks.paths import SAMPLES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")

TESTDATA = SAMPLES
LISTOPS_TSV = os.path.join(TESTDATA, "listops", "lra_release", "listops-1000")
AAN_TSV = os.path.join(TESTDATA, "retrieval", "lra_release", "tsv_data")


def _add(tar, name, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def _read(path):
  with open(path, "rb") as f:
    return f.read()


def make_lra_archive(path, *, prefix="lra_release/lra_release", skip=(), extra=()):
  """A tiny tar.gz in the release's layout; returns its sha256."""
  with tarfile.open(path, "w:gz") as tar:
    for name in sorted(os.listdir(LISTOPS_TSV)):
      if "listops-1000" not in skip:
        _add(tar, f"{prefix}/listops-1000/{name}", _read(os.path.join(LISTOPS_TSV, name)))
    for name in sorted(os.listdir(AAN_TSV)):
      if "tsv_data" not in skip:
        _add(tar, f"{prefix}/tsv_data/{name}", _read(os.path.join(AAN_TSV, name)))
    for res in (32, 64, 128):
      for d in dd.PATHFINDER_FOLDERS:
        base = f"{prefix}/pathfinder{res}/{d}"
        _add(tar, f"{base}/metadata/0.npy", b"imgs/0 sample_0.png 0 1\n")
        _add(tar, f"{base}/imgs/0/sample_0.png", b"")
    _add(tar, f"{prefix}/other_task/readme.txt", b"not asked for")
    for name, data in extra:
      _add(tar, name, data)
  return hashlib.sha256(_read(path)).hexdigest()


def _resources(url, checksums, **archives):
  res = dict(dd.RESOURCES)
  res["lra_release"] = dataclasses.replace(dd.LRA, url=url, checksums=checksums)
  res.update(archives)
  return res


def _refuse(url, part):
  raise AssertionError(f"nothing should be fetched, got {url}")


# ----------------------------------------------------------------------- arguments / plan


def test_unknown_task_lists_the_valid_ones(tmp_path, capsys):
  assert dd.main(["listopz", "mnist", "--data_dir", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert "unknown task(s) 'listopz'; valid tasks: listops, lra_retrieval, pathfinder" in err
  assert dd.main(["--data_dir", str(tmp_path)]) == 2
  assert "no task given; valid tasks:" in capsys.readouterr().err
  assert dd.main(["pathfinder", "--pathfinder", "32,100", "--data_dir", str(tmp_path)]) == 2
  assert "--pathfinder '32,100'" in capsys.readouterr().err
  assert not os.listdir(tmp_path)


def test_list_names_every_task_and_source(capsys):
  assert dd.main(["--list"]) == 0
  out = capsys.readouterr().out
  for task in dd.TASKS:
    assert f"\n{task} " in out
  assert "lra_release.gz" in out and "wikitext-103-v1.zip" in out and "tfds cifar10" in out


def test_every_registered_task_can_be_fetched():
  from fastpos import tasks  # pylint: disable=import-outside-toplevel

  downloaded = {n for n in tasks.task_names() if not tasks.get_task_class(n).generated}
  assert {"synthetic", "mqar"}.isdisjoint(downloaded) and len(downloaded) >= 6
  assert downloaded <= set(dd.TASKS), "a registered task has no fetch entry"


def test_dry_run_plan(tmp_path, capsys):
  root = str(tmp_path / "root")
  steps = dd.run(
      ["pathfinder", "listops", "lra_retrieval", "wikitext103", "mnist", "listops"],
      root,
      dry_run=True,
      fetch=_refuse,
  )
  assert [s.resource for s in steps] == ["lra_release", "wikitext103", "mnist"]
  lra, wiki, mnist = steps
  assert lra.tasks == ["pathfinder", "listops", "lra_retrieval"]  # one archive, one fetch
  lra_dir = os.path.join(root, "lra_release")
  assert lra.outputs == [
      os.path.join(lra_dir, f)
      for f in ("pathfinder32", "pathfinder128", "listops-1000", "tsv_data")
  ]
  assert "UNVERIFIED" in lra.checksum and not lra.present
  assert "md5 9ddaacaf6af0710eda8c456decff7832" in wiki.checksum
  assert wiki.outputs == [os.path.join(root, "wikitext-103")]
  assert mnist.outputs == [os.path.join(root, "tfds", "mnist")]
  out = capsys.readouterr().out
  assert "[lra_release] for pathfinder, listops, lra_retrieval: to fetch" in out
  assert "https://storage.googleapis.com/long-range-arena/lra_release.gz" in out
  assert not os.path.exists(root)  # a dry run writes nothing
  # Other resolutions on request.
  steps = dd.plan(["pathfinder"], root, pathfinder=dd.parse_resolutions("256,64"))
  assert [os.path.basename(o) for o in steps[0].outputs] == ["pathfinder64", "pathfinder256"]


def test_dry_run_alone_plans_every_task(tmp_path):
  # The README's way to see the plan: no task named. Run as a user would (no traceback).
  root = tmp_path / "root"
  proc = subprocess.run(
      [
          sys.executable,
          os.path.join(SCRIPTS, "download_data.py"),
          "--dry_run",
          "--data_dir",
          str(root),
      ],
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  for task in dd.TASKS:
    assert task in proc.stdout
  assert "wikitext-103-v1.zip" in proc.stdout and "lra_release.gz" in proc.stdout
  assert proc.stderr == "" and not root.exists()


def test_no_network_is_one_message_and_leaves_nothing(tmp_path, monkeypatch, capsys):
  # A closed port on loopback stands for a machine without network: the connection is refused
  # at once, and no host outside this machine is contacted.
  url = "http://127.0.0.1:9/wikitext-103-v1.zip"
  monkeypatch.setitem(dd.RESOURCES, "wikitext103", dataclasses.replace(dd.WIKITEXT, url=url))
  root = tmp_path / "data" / "root"
  assert dd.main(["wikitext103", "--data_dir", str(root)]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: cannot fetch {url}: ") and err.count("\n") == 1, err
  assert "refused" in err and "Traceback" not in err
  assert f"place the file wikitext-103-v1.zip at {root}/downloads/wikitext-103-v1.zip" in err
  assert "on one that has and copy" in err
  assert os.listdir(tmp_path) == []  # no empty data root, downloads/ or .part left behind
  # Folders that were there before stay, even when empty.
  (root / "downloads").mkdir(parents=True)
  assert dd.main(["wikitext103", "--data_dir", str(root)]) == 2
  assert os.listdir(root / "downloads") == []


def test_urlopen_failure_names_the_http_status(tmp_path, monkeypatch, capsys):
  import urllib.error  # pylint: disable=import-outside-toplevel

  def not_found(req, timeout):
    raise urllib.error.HTTPError(req.full_url, 404, "Not Found", {}, None)

  monkeypatch.setattr(dd.urllib.request, "urlopen", not_found)
  assert dd.main(["wikitext103", "--data_dir", str(tmp_path / "root")]) == 2
  err = capsys.readouterr().err
  assert f"cannot fetch {dd.WIKITEXT.url}: HTTP 404 Not Found." in err
  assert os.listdir(tmp_path) == []


def test_data_dir_defaults_to_the_env_var(tmp_path, monkeypatch):
  monkeypatch.setenv("FASTPOS_DATA_DIR", str(tmp_path / "env"))
  (step,) = dd.plan(["wikitext103"], "")
  assert step.outputs == [os.path.join(str(tmp_path / "env"), "wikitext-103")]


# ------------------------------------------------------------------- fetch, verify, unpack


def test_lra_fetch_verify_unpack_and_skip(tmp_path, capsys):
  archive = str(tmp_path / "served" / "lra_release.gz")
  os.makedirs(os.path.dirname(archive))
  sha = make_lra_archive(archive)
  root = str(tmp_path / "root")
  resources = _resources("file://" + archive, {"sha256": sha})
  dd.run(["listops", "lra_retrieval", "pathfinder"], root, resources=resources)
  out = capsys.readouterr().out
  assert "verified sha256" in out and sha in out
  lra = os.path.join(root, "lra_release")
  assert sorted(os.listdir(lra)) == ["listops-1000", "pathfinder128", "pathfinder32", "tsv_data"]
  for name in os.listdir(LISTOPS_TSV):
    assert _read(os.path.join(lra, "listops-1000", name)) == _read(os.path.join(LISTOPS_TSV, name))
  for name in os.listdir(AAN_TSV):
    assert _read(os.path.join(lra, "tsv_data", name)) == _read(os.path.join(AAN_TSV, name))
  meta = os.path.join(lra, "pathfinder128", "curv_contour_length_14", "metadata", "0.npy")
  assert _read(meta) == b"imgs/0 sample_0.png 0 1\n"
  for f in os.listdir(lra):
    assert os.path.exists(os.path.join(lra, f, dd.MARKER))
  downloads = os.listdir(os.path.join(root, "downloads"))
  assert downloads == ["lra_release.gz"]  # kept, no .part left
  # Everything present: a second run fetches nothing.
  steps = dd.run(["listops", "pathfinder"], root, resources=resources, fetch=_refuse)
  assert all(s.done for s in steps)
  # Another resolution later: unpacked from the kept archive, no fetch.
  dd.run(
      ["pathfinder"],
      root,
      resources=resources,
      fetch=_refuse,
      pathfinder=(64,),
      delete_archives=True,
  )
  assert os.path.exists(os.path.join(lra, "pathfinder64", dd.MARKER))
  assert os.listdir(os.path.join(root, "downloads")) == []


def test_unpacked_files_are_what_the_tasks_read(tmp_path):
  from fastpos import tasks  # pylint: disable=import-outside-toplevel
  from fastpos.tasks import listops, retrieval  # pylint: disable=import-outside-toplevel

  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive, prefix="lra_release")  # the other reported prefix
  root = str(tmp_path / "root")
  dd.run(["listops", "lra_retrieval"], root, resources=_resources("file://" + archive, {}))
  cfg = tasks.task_config("listops")
  cfg.update(source="tsv", data_dir=root, max_length=512, parens=True)
  src = tasks.make_task(cfg).source("validation")
  rows = listops.read_tsv(os.path.join(LISTOPS_TSV, "basic_val.tsv"))
  assert [listops.decode(x) for x in src.arrays["inputs"]] == [e for e, _ in rows]
  data = retrieval.load_split("test", data_dir=root, max_length=512)
  assert data["targets"].shape == (5,)


def test_unverified_archive_prints_its_sha256(tmp_path, capsys):
  archive = str(tmp_path / "lra.tar.gz")
  sha = make_lra_archive(archive)
  dd.run(["listops"], str(tmp_path / "root"), resources=_resources("file://" + archive, {}))
  out = capsys.readouterr().out
  assert f"UNVERIFIED: no published checksum for lra_release.gz; its sha256 is {sha}" in out


def test_checksum_mismatch_stops_before_unpacking(tmp_path, capsys):
  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive)
  root = str(tmp_path / "root")
  resources = _resources("file://" + archive, {"md5": "0" * 32})
  with pytest.raises(
      dd.DownloadError, match=r"md5 of .*lra_release\.gz\.part is [0-9a-f]{32}, " r"expected 0{32}"
  ):
    dd.run(["listops"], root, resources=resources)
  assert os.listdir(os.path.join(root, "downloads")) == ["lra_release.gz.part.bad"]
  assert not os.path.exists(os.path.join(root, "lra_release", "listops-1000"))
  # A corrupt archive already in place is caught too (and main turns it into exit code 2).
  os.replace(
      os.path.join(root, "downloads", "lra_release.gz.part.bad"),
      os.path.join(root, "downloads", "lra_release.gz"),
  )
  with pytest.raises(dd.DownloadError, match="md5 of"):
    dd.run(["listops"], root, resources=resources, fetch=_refuse)


def test_resume_extends_the_part_file(tmp_path):
  archive = str(tmp_path / "lra.tar.gz")
  sha = make_lra_archive(archive)
  data = _read(archive)
  root = str(tmp_path / "root")
  resources = _resources("https://example.invalid/lra_release.gz", {"sha256": sha})
  calls = []

  def flaky(url, part):  # the first call dies half way
    calls.append(os.path.getsize(part) if os.path.exists(part) else 0)
    with open(part, "ab") as f:
      f.write(data[calls[-1] : len(data) // 2] if len(calls) == 1 else data[calls[-1] :])
    if len(calls) == 1:
      raise ConnectionError("connection reset")

  with pytest.raises(dd.DownloadError, match=f"The {len(data) // 2} bytes received are kept"):
    dd.run(["listops"], root, resources=resources, fetch=flaky)
  assert os.path.getsize(os.path.join(root, "downloads", "lra_release.gz.part")) == len(data) // 2
  dd.run(["listops"], root, resources=resources, fetch=flaky)
  assert calls == [0, len(data) // 2]
  assert os.path.exists(os.path.join(root, "lra_release", "listops-1000", "basic_val.tsv"))


def test_urllib_fetch_restarts_when_the_server_cannot_resume(tmp_path):
  src = tmp_path / "blob.bin"
  src.write_bytes(bytes(range(256)) * 10)
  part = tmp_path / "blob.bin.part"
  part.write_bytes(b"stale bytes")  # file:// answers without 206: the download restarts
  dd.urllib_fetch("file://" + str(src), str(part))
  assert part.read_bytes() == src.read_bytes()


def test_archive_without_a_needed_folder(tmp_path):
  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive, skip=("tsv_data",))
  root = str(tmp_path / "root")
  with pytest.raises(
      dd.DownloadError,
      match=r"holds no folder tsv_data; its entries start "
      r"with: lra_release/lra_release/listops-1000",
  ):
    dd.run(["lra_retrieval"], root, resources=_resources("file://" + archive, {}))
  # No staging folder is left, nor the lra_release/ folder the failed run created; the
  # verified archive stays for the next run.
  assert os.listdir(root) == ["downloads"]
  assert os.listdir(os.path.join(root, "downloads")) == ["lra_release.gz"]


def test_unsafe_member_is_refused(tmp_path):
  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive, extra=[("lra_release/../../evil.txt", b"x")])
  with pytest.raises(dd.DownloadError, match="unsafe member path"):
    dd.run(["listops"], str(tmp_path / "root"), resources=_resources("file://" + archive, {}))
  assert not (tmp_path / "evil.txt").exists()


def test_foreign_folder_is_not_overwritten(tmp_path):
  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive)
  root = tmp_path / "root"
  (root / "lra_release" / "tsv_data").mkdir(parents=True)
  (root / "lra_release" / "tsv_data" / "mine.txt").write_text("keep")
  with pytest.raises(
      dd.DownloadError, match=r"tsv_data exists but was not completed by this " r"script"
  ):
    dd.run(["lra_retrieval"], str(root), resources=_resources("file://" + archive, {}))
  assert (root / "lra_release" / "tsv_data" / "mine.txt").read_text() == "keep"


def _wikitext_zip(path, *, texts):
  with zipfile.ZipFile(path, "w") as z:
    for name, text in texts.items():
      z.writestr(f"wikitext-103/{name}", text)
  data = _read(path)
  return {"md5": hashlib.md5(data).hexdigest(), "sha1": hashlib.sha1(data).hexdigest()}


def test_wikitext_zip_with_file_checksums(tmp_path):
  texts = {
      f"wiki.{s}.tokens": f" = Title {s} = \n the cat sat \n" for s in ("train", "valid", "test")
  }
  archive = str(tmp_path / "wikitext-103-v1.zip")
  checksums = _wikitext_zip(archive, texts=texts)
  files = {
      f"wikitext-103/{n}": ("sha1", hashlib.sha1(t.encode()).hexdigest()) for n, t in texts.items()
  }
  wiki = dataclasses.replace(
      dd.WIKITEXT, url="file://" + archive, checksums=checksums, file_checksums=files
  )
  root = str(tmp_path / "root")
  dd.run(["wikitext103"], root, resources={**dd.RESOURCES, "wikitext103": wiki})
  for name, text in texts.items():
    assert _read(os.path.join(root, "wikitext-103", name)).decode() == text
  # A wrong file digest is caught after unpacking.
  bad = dataclasses.replace(
      wiki, file_checksums={**files, "wikitext-103/wiki.test.tokens": ("sha1", "0" * 40)}
  )
  root2 = str(tmp_path / "root2")
  with pytest.raises(dd.DownloadError, match=r"sha1 of unpacked wiki\.test\.tokens"):
    dd.run(["wikitext103"], root2, resources={**dd.RESOURCES, "wikitext103": bad})
  assert not os.path.exists(os.path.join(root2, "wikitext-103"))


def test_tfds_without_tensorflow_says_how_to_install(tmp_path, monkeypatch):
  real = dd.importlib.util.find_spec
  monkeypatch.setattr(
      dd.importlib.util,
      "find_spec",
      lambda name, *a: None if name == "tensorflow" else real(name, *a),
  )
  with pytest.raises(dd.DownloadError) as e:
    dd.run(["lra_image"], str(tmp_path / "root"), fetch=_refuse)
  msg = str(e.value)
  assert "preparing tfds 'cifar10'" in msg and "tensorflow" in msg
  assert "pip install tensorflow-datasets==4.9.10 tensorflow" in msg
  assert f"--data_dir {tmp_path / 'root'}" in msg


def test_module_imports_no_jax(tmp_path):
  # The downloader must run in the separate tfds environment (numpy, no jax / flax /
  # ml_collections): --help, --list, the plan and a real fetch + unpack import only
  # fastpos.tasks.download, fastpos.tasks.paths and what they need.
  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive)
  code = f"""
import contextlib, dataclasses, io, json, sys
sys.path.insert(0, {ROOT!r})
from fastpos.tasks import download as dd
with contextlib.redirect_stdout(io.StringIO()):
  try:
    dd.main(["--help"])
  except SystemExit:
    pass
  assert dd.main(["--list"]) == 0
  assert dd.main(["--dry_run", "--data_dir", {str(tmp_path / "plan")!r}]) == 0
  lra = dataclasses.replace(dd.LRA, url="file://" + {archive!r}, checksums={{}})
  dd.run(["listops"], {str(tmp_path / "root")!r}, resources={{**dd.RESOURCES, "lra_release": lra}})
print(json.dumps(sorted(sys.modules)))
"""
  proc = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=120
  )
  assert proc.returncode == 0, proc.stderr
  modules = json.loads(proc.stdout)
  assert os.path.exists(tmp_path / "root" / "lra_release" / "listops-1000" / dd.MARKER)
  heavy = {m.split(".")[0] for m in modules} & {
      "jax",
      "jaxlib",
      "flax",
      "ml_collections",
      "absl",
      "grain",
      "orbax",
      "optax",
  }
  assert not heavy, f"download_data.py imported {sorted(heavy)}"
  assert [m for m in modules if m.startswith("fastpos")] == [
      "fastpos",
      "fastpos.fields",  # how the tasks declare their fields: the standard library only
      "fastpos.tasks",
      "fastpos.tasks.base",
      "fastpos.tasks.download",
      "fastpos.tasks.info",
      "fastpos.tasks.paths",
  ]


# ---------------------------------------------------------------------------- end to end


# Slow (a training run); the default run keeps a tiny run end to end (tests/train/test_exits.py)
# and this task's batches (the tests above).
@pytest.mark.slow
def test_train_two_steps_on_fetched_listops(tmp_path):
  from fastpos.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  from fastpos.train.config import base_config  # pylint: disable=import-outside-toplevel

  archive = str(tmp_path / "lra.tar.gz")
  make_lra_archive(archive)
  root = str(tmp_path / "root")
  dd.run(["listops"], root, resources=_resources("file://" + archive, {}))
  c = base_config("listops")
  c.task.update(source="tsv", data_dir=root, max_length=64)
  c.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=16, dropout_rate=0.0)
  c.batch_size = 4
  c.num_train_steps = 2
  c.schedule.update(name="constant", warmup_steps=1)
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  c.async_checkpoints = False
  c.data.num_threads = 1
  result = train_and_evaluate(c, tmp_path / "workdir")
  assert result["step"] == 2 and np.isfinite(result["validation"]["loss"])
  assert result["validation"]["num_examples"] == 4  # rows of basic_val.tsv
