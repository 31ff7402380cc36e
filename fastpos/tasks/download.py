"""Fetches the data of fastpos tasks into one data root, on a machine with internet.

The library behind ``python scripts/download_data.py`` (``main`` is its command line):

  python scripts/download_data.py TASK... --data_dir DIR [--dry_run] [--delete_archives]
  python scripts/download_data.py --dry_run [--data_dir DIR]   # the plan for every task
  python scripts/download_data.py --list

Archives are fetched to ``<file>.part`` (resumed), checked against their published checksums
(``RESOURCES``), unpacked, and marked complete last; tfds datasets are prepared by tfds. A fetch
that cannot proceed stops with one message naming the URL or file, the reason and the fix,
exits 2, and leaves behind only the ``.part`` file for the next run to resume. The layout of the
data root is ``fastpos/tasks/paths.py``'s; README "Data" has the sources, sizes and the separate
environment that preparing tfds datasets needs. This module imports ``fastpos.tasks.paths``
(numpy only: no jax, no ml_collections), so it runs in that environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import http.client
import importlib.util
import json
import os
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from typing import IO, Callable, Iterable, Iterator, Sequence

from fastpos.tasks import paths  # numpy only: the tfds environment has no jax

MARKER = ".fastpos_complete"
DOWNLOADS = "downloads"
PATHFINDER_RESOLUTIONS = (32, 64, 128, 256)
DEFAULT_PATHFINDER = (32, 128)  # Pathfinder-32 and Path-X
PATHFINDER_FOLDERS = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")

Fetch = Callable[[str, str], None]  # (url, path of the .part file to write or extend)


@dataclasses.dataclass(frozen=True)
class Archive:
  """A downloadable archive and what is unpacked from it.

  Attributes:
    name: resource name (several tasks may share one).
    url: where it is fetched from.
    filename: its name under DIR/downloads.
    size: approximate size, for the plan.
    checksums: algorithm -> hex digest published for the archive ({} if none).
    checksum_source: where those digests come from.
    kind: "tar.gz" or "zip".
    dest: the folder under DIR that holds the unpacked folders.
    folders: unpacked folder name -> files (relative to it) that must exist afterwards.
    file_checksums: "folder/file" -> (algorithm, digest) checked after unpacking.
  """

  name: str
  url: str
  filename: str
  size: str
  checksums: dict
  checksum_source: str
  kind: str
  dest: str
  folders: dict
  file_checksums: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tfds:
  """A tfds dataset prepared as array_record under DIR/tfds."""

  name: str
  size: str
  checksum_source: str = "tfds' registered sha256 (url_checksums), checked by tfds itself"


def _pathfinder_files() -> tuple[str, ...]:
  return tuple(f"{d}/metadata" for d in PATHFINDER_FOLDERS)


LRA = Archive(
    name="lra_release",
    url="https://storage.googleapis.com/long-range-arena/lra_release.gz",
    filename="lra_release.gz",
    size="~7.7 GB (tar.gz)",
    checksums={},
    checksum_source="none published (google-research/long-range-arena README gives only the "
    "URL)",
    kind="tar.gz",
    dest=paths.LRA_SUBDIR,
    folders={
        "listops-1000": ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"),
        "tsv_data": ("new_aan_pairs.train.tsv", "new_aan_pairs.eval.tsv", "new_aan_pairs.test.tsv"),
        **{f"pathfinder{r}": _pathfinder_files() for r in PATHFINDER_RESOLUTIONS},
    },
)

WIKITEXT = Archive(
    name="wikitext103",
    url="https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    filename="wikitext-103-v1.zip",
    size="~181 MiB (zip), ~0.5 GB unpacked",
    checksums={
        "md5": "9ddaacaf6af0710eda8c456decff7832",
        "sha1": "0aec09a7537b58d4bb65362fee27650eeaba625a",
    },
    checksum_source="md5: pytorch/text torchtext/experimental/datasets/raw/wikitext103.py; "
    "sha1 (archive and files): GluonNLP data/language_model.py (WikiText103)",
    kind="zip",
    dest="",
    folders={paths.WIKITEXT_SUBDIR: ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")},
    file_checksums={
        "wikitext-103/wiki.train.tokens": ("sha1", "b7497e2dfe77e72cfef5e3dbc61b7b53712ac211"),
        "wikitext-103/wiki.valid.tokens": ("sha1", "c326ac59dc587676d58c422eb8a03e119582f92b"),
        "wikitext-103/wiki.test.tokens": ("sha1", "8a5befc548865cec54ed4273cf87dbbad60d1e47"),
    },
)

RESOURCES: dict = {
    "lra_release": LRA,
    "wikitext103": WIKITEXT,
    "imdb_reviews": Tfds("imdb_reviews", "~84 MB download (aclImdb_v1.tar.gz)"),
    "cifar10": Tfds("cifar10", "~170 MB download (cifar-10-binary.tar.gz)"),
    "mnist": Tfds("mnist", "~12 MB download (4 idx .gz files)"),
}

# task -> (resource, LRA folders it needs or ()).
TASKS: dict = {
    "listops": ("lra_release", ("listops-1000",)),
    "lra_retrieval": ("lra_release", ("tsv_data",)),
    "pathfinder": ("lra_release", ("pathfinder",)),  # resolutions from --pathfinder
    "lra_text": ("imdb_reviews", ()),
    "lra_image": ("cifar10", ()),
    "mnist": ("mnist", ()),
    "wikitext103": ("wikitext103", ()),
}


class DownloadError(RuntimeError):
  """A fetch, checksum, unpacking or environment problem (the message says what to do)."""


# --------------------------------------------------------------------------------- plan


@dataclasses.dataclass
class Step:
  """What one resource fetch does for the asked tasks."""

  resource: str
  tasks: list
  source: str
  size: str
  checksum: str
  outputs: list  # absolute paths it creates
  present: list  # of outputs, those already complete
  folders: tuple = ()

  @property
  def done(self) -> bool:
    return len(self.present) == len(self.outputs)


def _folder_complete(path: str, required: Sequence[str]) -> bool:
  if os.path.exists(os.path.join(path, MARKER)):
    return True
  return bool(required) and all(os.path.exists(os.path.join(path, f)) for f in required)


def _tfds_prepared(name: str, root: str) -> bool:
  """Whether DIR/tfds/<name> holds a prepared version (a dataset_info.json below it)."""
  folder = os.path.join(root, paths.TFDS_SUBDIR, name)
  return any("dataset_info.json" in files for _, _, files in os.walk(folder))


def parse_resolutions(text: str) -> tuple[int, ...]:
  try:
    values = tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    values = ()
  if not values or any(v not in PATHFINDER_RESOLUTIONS for v in values):
    raise DownloadError(
        f"--pathfinder {text!r}: give comma-separated resolutions from "
        f"{', '.join(map(str, PATHFINDER_RESOLUTIONS))}."
    )
  return tuple(sorted(set(values)))


def plan(
    task_names: Sequence[str],
    data_dir: str,
    *,
    pathfinder: Sequence[int] = DEFAULT_PATHFINDER,
    resources: dict | None = None,
    tasks: dict | None = None,
) -> list[Step]:
  """The steps that fetch ``task_names`` into ``data_dir`` (one per resource, in order)."""
  resources = RESOURCES if resources is None else resources
  tasks = TASKS if tasks is None else tasks
  unknown = [t for t in task_names if t not in tasks]
  if unknown:
    raise DownloadError(
        f"unknown task(s) {', '.join(map(repr, unknown))}; valid tasks: " f"{', '.join(tasks)}."
    )
  if not task_names:
    raise DownloadError(
        f"no task given; valid tasks: {', '.join(tasks)} (--dry_run alone "
        f"shows the plan for all of them, --list what each fetches)."
    )
  root = paths.data_root(data_dir)
  steps: dict[str, Step] = {}
  for task in dict.fromkeys(task_names):
    res_name, folders = tasks[task]
    res = resources[res_name]
    if "pathfinder" in folders:
      folders = tuple(f for f in folders if f != "pathfinder") + tuple(
          f"pathfinder{r}" for r in pathfinder
      )
    step = steps.setdefault(res_name, _new_step(res_name, res))
    step.tasks.append(task)
    if isinstance(res, Archive):
      _add_archive_outputs(step, res, folders or tuple(res.folders), root)
    else:
      _add_tfds_output(step, res, root)
  return list(steps.values())


def _new_step(res_name: str, res: Archive | Tfds) -> Step:
  """An empty step for one resource: its source, size and what its checksum is."""
  if isinstance(res, Archive):
    published = ", ".join(f"{k} {v}" for k, v in res.checksums.items())
    checksum = (
        f"{published} ({res.checksum_source})"
        if res.checksums
        else f"UNVERIFIED: {res.checksum_source}; its sha256 is printed"
    )
    return Step(res_name, [], res.url, res.size, checksum, [], [])
  return Step(
      res_name,
      [],
      f"tfds.builder({res.name!r}).download_and_prepare " f"(array_record)",
      res.size,
      res.checksum_source,
      [],
      [],
  )


def _add_archive_outputs(step: Step, res: Archive, wanted: Sequence[str], root: str) -> None:
  """Adds the folders ``wanted`` of an archive to ``step`` (once each), noting those present."""
  for f in wanted:
    out = os.path.join(root, res.dest, f)
    if out not in step.outputs:
      step.outputs.append(out)
      step.folders += (f,)
      if _folder_complete(out, res.folders.get(f, ())):
        step.present.append(out)


def _add_tfds_output(step: Step, res: Tfds, root: str) -> None:
  out = os.path.join(root, paths.TFDS_SUBDIR, res.name)
  if out not in step.outputs:
    step.outputs.append(out)
    if _tfds_prepared(res.name, root):
      step.present.append(out)


def describe(steps: Sequence[Step]) -> str:
  lines = []
  for s in steps:
    state = "present, skipped" if s.done else "to fetch"
    lines.append(f"[{s.resource}] for {', '.join(s.tasks)}: {state}")
    lines.append(f"  source:   {s.source}")
    lines.append(f"  size:     {s.size}")
    lines.append(f"  checksum: {s.checksum}")
    for out in s.outputs:
      lines.append(f"  -> {out}{'  (present)' if out in s.present else ''}")
  return "\n".join(lines)


def list_text() -> str:
  lines = ["task            fetches"]
  for task, (res_name, folders) in TASKS.items():
    res = RESOURCES[res_name]
    if isinstance(res, Archive):
      what = f"{res.url} ({res.size})"
      if folders:
        names = [
            "pathfinder{" + ",".join(map(str, DEFAULT_PATHFINDER)) + "}" if f == "pathfinder" else f
            for f in folders
        ]
        what += f" -> {res.dest}/{', '.join(names)}" if res.dest else ""
      else:
        what += f" -> {', '.join(res.folders)}"
    else:
      what = f"tfds {res.name} -> {paths.TFDS_SUBDIR}/{res.name} ({res.size}; needs tensorflow)"
    lines.append(f"{task:<15} {what}")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ fetching


def urllib_fetch(url: str, part: str) -> None:
  """Downloads ``url`` into ``part``, resuming from its current size when the server answers a
  Range request with 206 (anything else restarts the file)."""
  start = os.path.getsize(part) if os.path.exists(part) else 0
  headers = {"Range": f"bytes={start}-"} if start else {}
  req = urllib.request.Request(url, headers=headers)
  with urllib.request.urlopen(req, timeout=60) as resp:
    status = getattr(resp, "status", None)
    append = start > 0 and status == 206
    if start and not append:
      print(f"  server did not resume (status {status}); downloading from the start")
    total = resp.headers.get("Content-Length")
    total = int(total) + (start if append else 0) if total else None
    done = start if append else 0
    last = time.monotonic()
    with open(part, "ab" if append else "wb") as f:
      while True:
        chunk = resp.read(1 << 20)
        if not chunk:
          break
        f.write(chunk)
        done += len(chunk)
        if time.monotonic() - last > 10:
          pct = f" ({100 * done / total:.1f}%)" if total else ""
          print(f"  {done / 1e6:.0f} MB{pct}", flush=True)
          last = time.monotonic()


def file_digests(path: str, algorithms: Iterable[str]) -> dict[str, str]:
  hashes = {a: hashlib.new(a) for a in dict.fromkeys(algorithms)}
  with open(path, "rb") as f:
    while True:
      chunk = f.read(1 << 22)
      if not chunk:
        break
      for h in hashes.values():
        h.update(chunk)
  return {a: h.hexdigest() for a, h in hashes.items()}


def verify(path: str, checksums: dict, what: str) -> str:
  """Checks ``path`` against ``checksums``; returns its sha256. Raises DownloadError on a
  mismatch (naming the file, the algorithm and both digests)."""
  got = file_digests(path, ["sha256", *checksums])
  for algo, want in checksums.items():
    if got[algo] != want.lower():
      raise DownloadError(
          f"{what}: {algo} of {path} is {got[algo]}, expected {want}; the file is "
          f"corrupt or was changed upstream. Delete it and run again."
      )
  return got["sha256"]


def download(res: Archive, root: str, fetch: Fetch) -> str:
  """The verified archive under DIR/downloads (fetched to .part, then renamed)."""
  folder = os.path.join(root, DOWNLOADS)
  os.makedirs(folder, exist_ok=True)
  final = os.path.join(folder, res.filename)
  if os.path.exists(final):
    print(f"  {final} present; verifying")
    sha = verify(final, res.checksums, res.name)
  else:
    part = final + ".part"
    resume = f" (resuming {os.path.getsize(part)} bytes)" if os.path.exists(part) else ""
    print(f"  fetching {res.url} -> {part}{resume}")
    try:
      fetch(res.url, part)
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError, timeouts: OSError
      raise DownloadError(_fetch_failure(res, part, final, e)) from e
    try:
      sha = verify(part, res.checksums, res.name)
    except DownloadError:
      os.replace(part, part + ".bad")
      raise
    os.replace(part, final)
  if res.checksums:
    print(f"  verified {', '.join(res.checksums)} ({res.checksum_source}); sha256 {sha}")
  else:
    print(f"  UNVERIFIED: no published checksum for {res.filename}; its sha256 is {sha}")
  return final


def _fetch_failure(res: Archive, part: str, final: str, e: BaseException) -> str:
  """The message for a failed fetch: what failed, why, and how to get the file another way.
  An empty ``.part`` left by the failure is removed (one with bytes stays, to be resumed)."""
  kept = os.path.getsize(part) if os.path.exists(part) else 0
  if os.path.exists(part) and not kept:
    os.remove(part)
  if isinstance(e, urllib.error.HTTPError):
    reason = f"HTTP {e.code} {e.reason}"
  elif isinstance(e, urllib.error.URLError):
    reason = str(e.reason)
  else:
    reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
  if (
      isinstance(e, OSError)
      and not isinstance(e, urllib.error.URLError)
      and e.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT)
  ):
    return (
        f"cannot write {part}: {reason}. Free space or fix the permissions of that folder "
        f"(or choose another --data_dir), then run again."
    )
  resume = (
      f" The {kept} bytes received are kept in {part}; running the same command again "
      f"resumes the download."
      if kept
      else ""
  )
  return (
      f"cannot fetch {res.url}: {reason}.{resume} If this machine has no internet access, "
      f"run the same command on one that has and copy its data root's folder "
      f"{res.dest or ', '.join(res.folders)}/ into {os.path.dirname(os.path.dirname(final))}"
      f", or place the file {res.filename} at {final} and run again (it is verified, then "
      f"unpacked)."
  )


def _safe_parts(name: str) -> list[str] | None:
  parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
  if not parts or name.startswith("/") or ".." in parts:
    return None
  return parts


def _find_folder(parts: Sequence[str], wanted: Sequence[str]) -> int:
  for i, p in enumerate(parts):
    if p in wanted:
      return i
  return -1


def unpack(res: Archive, archive: str, root: str, folders: Sequence[str]) -> None:
  """Unpacks the members of ``folders`` (found at any depth of the archive: the LRA archive's
  prefix differs between reports, ``lra_release/`` or ``lra_release/lra_release/``) into
  DIR/<dest>/<folder>, each through a staging folder renamed into place, marker last."""
  dest = os.path.join(root, res.dest)
  os.makedirs(dest, exist_ok=True)
  _refuse_foreign(dest, folders)
  staging = {f: os.path.join(dest, f".unpack-{f}") for f in folders}
  for s in staging.values():
    if os.path.exists(s):
      shutil.rmtree(s)
  stager = _Stager(archive, folders, staging)
  print(f"  unpacking {', '.join(folders)} from {archive}")
  for name, is_dir, opener in _members(res.kind, archive):
    stager.place(name, is_dir, opener)
  missing = [f for f in folders if f not in stager.prefixes]
  if missing:
    for s in staging.values():
      shutil.rmtree(s, ignore_errors=True)
    raise DownloadError(
        f"{archive} holds no folder {', '.join(missing)}; its entries start "
        f"with: {', '.join(sorted(stager.seen_top)[:20])}."
    )
  for f in folders:
    _install(res, archive, f, staging[f], stager.prefixes[f])


def _refuse_foreign(dest: str, folders: Sequence[str]) -> None:
  """Raises DownloadError when a folder to unpack exists without this module's marker."""
  for f in folders:
    out = os.path.join(dest, f)
    if os.path.exists(out) and not os.path.exists(os.path.join(out, MARKER)):
      raise DownloadError(
          f"{out} exists but was not completed by this script (no {MARKER}); "
          f"move it away or delete it, then run again."
      )


def _members(kind: str, archive: str) -> Iterator[tuple[str, bool, Callable[[], IO[bytes]]]]:
  """(name, is a folder, opener) of each file and folder of the archive, in archive order;
  links are skipped, with a note after the last member."""
  if kind == "tar.gz":
    skipped_links = 0
    with tarfile.open(archive, mode="r|gz") as tar:  # a stream: members in archive order
      for m in tar:
        if m.issym() or m.islnk():
          skipped_links += 1
        elif m.isdir() or m.isfile():
          yield m.name, m.isdir(), lambda m=m: tar.extractfile(m)
    if skipped_links:
      print(f"  note: skipped {skipped_links} links in the archive")
  elif kind == "zip":
    with zipfile.ZipFile(archive) as z:
      for info in z.infolist():
        yield info.filename, info.is_dir(), lambda info=info: z.open(info)
  else:
    raise DownloadError(f"unknown archive kind {kind!r}; valid: tar.gz, zip.")


class _Stager:
  """Copies the members of the wanted folders into their staging folders. A folder is taken
  from the first path prefix it is found under; a second copy elsewhere is skipped."""

  def __init__(self, archive: str, folders: Sequence[str], staging: dict[str, str]):
    self.archive, self.folders, self.staging = archive, folders, staging
    self.prefixes: dict[str, tuple] = {}  # folder -> the member path prefix it was found under
    self.seen_top: set = set()  # the first three path parts of every member, for the error
    self.count = 0

  def place(self, name: str, is_dir: bool, opener: Callable[[], IO[bytes]]) -> None:
    parts = _safe_parts(name)
    if parts is None:
      raise DownloadError(f"{self.archive}: unsafe member path {name!r}; refusing to unpack.")
    self.seen_top.add("/".join(parts[:3]))
    i = _find_folder(parts, self.folders)
    if i < 0:
      return
    folder, prefix = parts[i], tuple(parts[:i])
    if self.prefixes.setdefault(folder, prefix) != prefix:
      print(
          f"  note: skipping {name} (a second copy of {folder}/ under "
          f"{'/'.join(prefix) or '.'}; using {'/'.join(self.prefixes[folder]) or '.'})"
      )
      return
    target = os.path.join(self.staging[folder], *parts[i + 1 :])
    if is_dir:
      os.makedirs(target, exist_ok=True)
    else:
      self._copy(opener, target)

  def _copy(self, opener: Callable[[], IO[bytes]], target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with opener() as src, open(target, "wb") as dst:
      shutil.copyfileobj(src, dst, 1 << 20)
    self.count += 1
    if self.count % 50000 == 0:
      print(f"  {self.count} files unpacked", flush=True)


def _install(res: Archive, archive: str, folder: str, staged: str, prefix: tuple) -> None:
  """Checks a staged folder (required files, published file checksums), marks it complete and
  renames it into DIR/<dest>/<folder>, replacing an earlier complete copy."""
  required = res.folders.get(folder, ())
  absent = [r for r in required if not os.path.exists(os.path.join(staged, r))]
  if absent:
    raise DownloadError(
        f"{archive}: {folder}/ lacks {', '.join(absent)} (wrong archive?); the "
        f"partial copy is left in {staged}."
    )
  for rel, (algo, digest) in res.file_checksums.items():
    head, _, tail = rel.partition("/")
    if head == folder:
      got = file_digests(os.path.join(staged, tail), [algo])[algo]
      if got != digest:
        raise DownloadError(
            f"{res.name}: {algo} of unpacked {tail} is {got}, expected " f"{digest}."
        )
  with open(os.path.join(staged, MARKER), "w") as m:
    json.dump(
        {
            "source": res.url,
            "archive_prefix": "/".join(prefix),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        m,
    )
  out = os.path.join(os.path.dirname(staged), folder)
  if os.path.exists(out):  # complete (marker) but asked again: replaced by the new copy
    shutil.rmtree(out)
  os.replace(staged, out)
  print(f"  -> {out}")


def prepare_tfds(res: Tfds, root: str) -> None:
  missing = [
      m for m in ("tensorflow", "importlib_resources") if importlib.util.find_spec(m) is None
  ]
  if missing:
    raise DownloadError(
        f"preparing tfds {res.name!r} with tensorflow-datasets needs {' and '.join(missing)} "
        f"(tfds reads archives with tf.io.gfile and encodes images with tf.image; reading the "
        f"prepared files later does not). Install them for this step only, e.g.\n"
        f"  python -m venv ~/tfds-prep\n"
        f"  ~/tfds-prep/bin/pip install tensorflow-datasets==4.9.10 tensorflow "
        f"importlib_resources\n"
        f"  ~/tfds-prep/bin/python scripts/download_data.py <tasks> --data_dir {root}"
    )
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  data_dir = os.path.join(root, paths.TFDS_SUBDIR)
  try:
    builder = tfds.builder(res.name, data_dir=data_dir)
    builder.download_and_prepare(
        file_format="array_record", download_dir=os.path.join(data_dir, "downloads")
    )
  except Exception as e:  # tfds wraps network / checksum errors in its own types
    last = (str(e).strip().splitlines() or [""])[-1]
    raise DownloadError(
        f"tfds could not prepare {res.name!r} under {data_dir}: {type(e).__name__}: {last}. "
        f"If this machine has no internet access, run the same command on one that has and "
        f"copy {os.path.join(data_dir, res.name)} here; running again resumes what tfds "
        f"downloaded into {os.path.join(data_dir, 'downloads')}."
    ) from e
  print(f"  -> {builder.data_dir}")


def run(
    task_names: Sequence[str],
    data_dir: str,
    *,
    dry_run: bool = False,
    fetch: Fetch = urllib_fetch,
    pathfinder: Sequence[int] = DEFAULT_PATHFINDER,
    delete_archives: bool = False,
    resources: dict | None = None,
    tasks: dict | None = None,
) -> list[Step]:
  """Plans, prints and (unless ``dry_run``) carries out the fetch of ``task_names``."""
  resources = RESOURCES if resources is None else resources
  steps = plan(task_names, data_dir, pathfinder=pathfinder, resources=resources, tasks=tasks)
  root = paths.data_root(data_dir)
  print(f"data root: {root}")
  print(describe(steps))
  if dry_run:
    return steps
  absent = _absent_folders(root, steps, resources)
  try:
    _carry_out(steps, root, resources, fetch, delete_archives)
  except BaseException:
    _remove_empty(absent)  # a failed run leaves no empty folder it created
    raise
  print("done.")
  return steps


def _absent_folders(root: str, steps: Sequence[Step], resources: dict) -> list[str]:
  """The folders a run may create that do not exist yet: the data root and its missing
  parents, DIR/downloads, the archives' destination folders and DIR/tfds."""
  candidates = [root, os.path.join(root, DOWNLOADS), os.path.join(root, paths.TFDS_SUBDIR)]
  parent = os.path.dirname(root)
  while parent and parent != os.path.dirname(parent):
    candidates.append(parent)
    parent = os.path.dirname(parent)
  for step in steps:
    res = resources[step.resource]
    if isinstance(res, Archive) and res.dest:
      candidates.append(os.path.join(root, res.dest))
  return [c for c in dict.fromkeys(candidates) if not os.path.exists(c)]


def _remove_empty(folders: Iterable[str]) -> None:
  """Removes those of ``folders`` that are now empty, deepest first."""
  for folder in sorted(folders, key=lambda f: f.count(os.sep), reverse=True):
    try:
      os.rmdir(folder)
    except OSError:  # not empty (it holds a resumable .part or data) or never created
      pass


def _carry_out(
    steps: Sequence[Step], root: str, resources: dict, fetch: Fetch, delete_archives: bool
) -> None:
  for step in steps:
    if step.done:
      continue
    res = resources[step.resource]
    print(f"[{step.resource}]")
    if isinstance(res, Archive):
      todo = [f for f, out in zip(step.folders, step.outputs) if out not in step.present]
      archive = download(res, root, fetch)
      unpack(res, archive, root, todo)
      if delete_archives:
        os.remove(archive)
        print(f"  deleted {archive}")
    else:
      prepare_tfds(res, root)


class _OneLineParser(argparse.ArgumentParser):
  """argparse with its errors as one line (the usage is in --help), exit code 2."""

  def error(self, message):
    print(f"{self.prog}: {message}; see {self.prog} --help.", file=sys.stderr)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
  parser = _OneLineParser(
      description="Fetch the data of fastpos tasks into one data root (see the module "
      "docstring for the layout)."
  )
  parser.add_argument(
      "tasks", nargs="*", metavar="TASK", help=f"tasks to fetch: {', '.join(TASKS)}"
  )
  parser.add_argument(
      "--data_dir",
      default="",
      help=f"the data root ('' = ${paths.ENV_VAR}, else {paths.DEFAULT_ROOT})",
  )
  parser.add_argument("--list", action="store_true", help="print the tasks and what each fetches")
  parser.add_argument(
      "--dry_run",
      action="store_true",
      help="print the plan (sources, sizes, checksums, outputs) and stop; "
      "without TASKs, the plan for every task",
  )
  parser.add_argument(
      "--pathfinder",
      default=",".join(map(str, DEFAULT_PATHFINDER)),
      help="Pathfinder resolutions to unpack (32 = Pathfinder, 128 = Path-X)",
  )
  parser.add_argument(
      "--delete_archives",
      action="store_true",
      help="delete each archive once unpacked (default: keep it in "
      "DIR/downloads for the other tasks it serves)",
  )
  return parser


def main(argv: Sequence[str] | None = None, *, fetch: Fetch = urllib_fetch) -> int:
  """``scripts/download_data.py``: returns the exit code (0, 2 with one ``error:`` line, 1 when
  the output pipe closed, 130 when interrupted)."""
  args = _parser().parse_args(argv)
  if args.list:
    print(list_text())
    return 0
  # --dry_run alone: the plan for every task (what the README offers to see the plan).
  task_names = args.tasks or (list(TASKS) if args.dry_run else [])
  blocked = paths.not_a_folder(paths.data_root(args.data_dir))
  if blocked:
    print(
        f"error: --data_dir: {blocked}; give a folder (it is created when missing).",
        file=sys.stderr,
    )
    return 2
  try:
    run(
        task_names,
        args.data_dir,
        dry_run=args.dry_run,
        fetch=fetch,
        pathfinder=parse_resolutions(args.pathfinder),
        delete_archives=args.delete_archives,
    )
  except DownloadError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:  # the output went to a pipe that closed (`| head`): stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
  except OSError as e:  # creating, unpacking or renaming under the data root
    where = f" {e.filename}" if e.filename else ""
    print(
        f"error: cannot write{where}: {e.strerror or e}. Free space or fix the permissions "
        f"there (or choose another --data_dir), then run again.",
        file=sys.stderr,
    )
    return 2
  except KeyboardInterrupt:
    print(
        "error: interrupted; run the same command again to resume (a partial download is "
        "kept as <file>.part).",
        file=sys.stderr,
    )
    return 130
  return 0
