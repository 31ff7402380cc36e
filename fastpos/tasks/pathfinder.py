"""LRA Pathfinder (and Path-X): are the two dots joined by one path? Images read pixel by pixel.

Source: Long Range Arena (Tay et al. 2021, Sec. 3.5), images of Linsley et al. (2018) / Kim et
al. (2020). ``python scripts/download_data.py pathfinder --data_dir DIR`` unpacks them from the
LRA release into ``DIR/lra_release/pathfinder<resolution>/<difficulty folder>/``, each holding
``metadata/<k>.npy`` (text, one image a line: folder, file name, _, label, ...) and
``imgs/<i>/sample_<j>.png`` (grayscale, resolution x resolution).

LRA's Pathfinder is ``resolution=32, difficulty="hard"`` (the defaults: 1024 tokens, grid
32x32) and Path-X is ``resolution=128`` (16384 tokens). Tokens: id = intensity + 1 (vocab 257,
no padding), raster order, the grid passed on in ``TaskInfo.grid``. The 80 / 10 / 10 splits
reproduce LRA's tfds order (``lra_order``). Decoding ~200K PNGs takes minutes, so all three
splits are decoded once and cached (``load_split``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
from typing import NamedTuple

import ml_collections
import numpy as np
from absl import logging
from PIL import Image

from fastpos import fields
from fastpos.tasks import base, paths
from fastpos.tasks.info import TaskInfo

TASK = "pathfinder"
SPLITS = base.SPLITS
RESOLUTIONS = (32, 64, 128, 256)
DIFFICULTIES = {
    "easy": "curv_baseline",
    "intermediate": "curv_contour_length_9",
    "hard": "curv_contour_length_14",
}
SPLIT_ORDERS = ("lra", "metadata")
# LRA's tfds slices, in percent: train [:80%], validation [80%:90%], test [90%:].
SPLIT_PERCENT = {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}
VOCAB_SIZE = 257  # intensity + 1
NUM_CLASSES = 2
CACHE_VERSION = 1
_CONVERTIBLE_MODES = ("L", "1", "P", "LA", "RGB", "RGBA")


class Example(NamedTuple):
  """One metadata line: the tfds key, the image path, its label and where it was read."""

  key: str
  image: str  # absolute path
  label: int
  source: str  # "<metadata file>:<line>"


def dataset_dir(data_dir: str | os.PathLike | None, resolution: int, difficulty: str) -> str:
  """``<root>/lra_release/pathfinder<resolution>/<difficulty folder>``."""
  _check_choice("resolution", resolution, RESOLUTIONS)
  _check_choice("difficulty", difficulty, tuple(DIFFICULTIES))
  return paths.task_path(
      data_dir, paths.LRA_SUBDIR, f"pathfinder{resolution}", DIFFICULTIES[difficulty]
  )


def _check_choice(name: str, value, choices) -> None:
  if isinstance(value, bool) or value not in choices:
    raise ValueError(
        f"unknown {name} {value!r}; valid choices: " f"{', '.join(str(c) for c in choices)}."
    )


def _metadata_files(folder: str) -> list[str]:
  meta = os.path.join(folder, "metadata")
  names = [n for n in os.listdir(meta) if n.endswith(".npy")]
  if not names:
    raise ValueError(f"{meta!r} holds no metadata/*.npy files (wrong layout?).")
  bad = [n for n in names if not n[:-4].isdigit()]
  if bad:
    raise ValueError(f"{os.path.join(meta, bad[0])!r}: metadata files are named <number>.npy.")
  return [os.path.join(meta, n) for n in sorted(names, key=lambda n: int(n[:-4]))]


def read_metadata(folder: str) -> list[Example]:
  """Every line of ``folder/metadata/*.npy`` (files in numeric order, lines in order).

  As LRA's tfds builder reads them: the ``.npy`` files are text despite the name; each line is
  split on whitespace, field 0 is the image's folder, field 1 its file name, field 3 its label
  (0 / 1). A line with fewer than 4 fields, another label or a file that does not end in a
  newline (truncated) is an error naming the file and line.
  """
  out = []
  for path in _metadata_files(folder):
    with open(path, "rb") as f:
      raw = f.read()
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not a text metadata file ({e}).") from None
    if not text.endswith("\n"):
      raise ValueError(f"{path}: does not end in a newline (truncated metadata file?).")
    for line_no, line in enumerate(text.split("\n")[:-1], start=1):
      fields = line.split()
      where = f"{path}:{line_no}"
      if len(fields) < 4:
        raise ValueError(
            f"{where}: expected at least 4 space-separated fields (folder, file, "
            f"index, label, ...), got {len(fields)}."
        )
      if fields[3] not in ("0", "1"):
        raise ValueError(f"{where}: label {fields[3]!r} is not 0 or 1.")
      key = "_".join([fields[0], fields[1], str(line_no)])
      out.append(Example(key, os.path.join(folder, fields[0], fields[1]), int(fields[3]), where))
  return out


def lra_order(examples: list[Example], difficulty: str) -> list[Example]:
  """``examples`` in tfds' stored order: ascending md5(difficulty + key) as an integer.

  LRA builds a tfds dataset per difficulty and slices it ``[:80%]`` / ``[80%:90%]`` /
  ``[90%:]`` (``split_bounds``); tfds stores examples sorted by the md5 of their key salted
  with the split name (``tfds.core.hashing``), the key being ``"<field0>_<field1>_<k>"`` with
  ``k`` the 1-based line number in its metadata file and the salt the difficulty name. This is
  reproduced from LRA's builder and tfds' code, not checked against LRA's own shards.
  """
  salt = hashlib.md5(difficulty.encode("utf-8"))

  def hkey(ex: Example) -> int:
    h = salt.copy()
    h.update(ex.key.replace("\\", "/").encode("utf-8"))
    return int(h.hexdigest(), 16)

  return sorted(examples, key=hkey)


def split_bounds(n: int) -> dict[str, tuple[int, int]]:
  """``[start, stop)`` of each split over ``n`` examples (tfds' percent slicing, "closest")."""
  return {
      s: (int(round(a * n / 100.0)), int(round(b * n / 100.0)))
      for s, (a, b) in SPLIT_PERCENT.items()
  }


def decode_png(path: str, resolution: int, where: str = "") -> np.ndarray:
  """The image at ``path`` as uint8 ``[resolution, resolution]``; errors name the file."""
  at = f" (listed at {where})" if where else ""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise ValueError(
        f"image {path!r}{at} does not exist (wrong layout or incomplete " f"unpacking?)."
    ) from None
  arr = None
  try:
    with Image.open(io.BytesIO(data)) as img:
      img.load()
      mode = img.mode
      if mode in _CONVERTIBLE_MODES:
        arr = np.asarray(img if mode == "L" else img.convert("L"), np.uint8)
  except Exception as e:  # Pillow raises several types for broken files
    raise ValueError(
        f"image {path!r}{at} is not a readable PNG ({type(e).__name__}: {e})."
    ) from None
  if arr is None:
    raise ValueError(
        f"image {path!r}{at} has mode {mode!r}; expected 8-bit grayscale 'L' (or "
        f"one of {', '.join(_CONVERTIBLE_MODES[1:])})."
    )
  if arr.shape != (resolution, resolution):
    raise ValueError(
        f"image {path!r}{at} is {arr.shape[1]}x{arr.shape[0]}; expected "
        f"{resolution}x{resolution}."
    )
  return arr


def _cache_key(folder: str, resolution: int, difficulty: str, split_order: str) -> dict:
  files = [
      (os.path.basename(p), os.stat(p).st_size, os.stat(p).st_mtime_ns)
      for p in _metadata_files(folder)
  ]
  return {
      "version": CACHE_VERSION,
      "folder": os.path.abspath(folder),
      "resolution": int(resolution),
      "difficulty": difficulty,
      "split_order": split_order,
      "metadata": files,
  }


def _cache_paths(cache_dir: str, key: dict) -> dict[str, str]:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  stem = (
      f"pathfinder_v{CACHE_VERSION}_{key['resolution']}_{key['difficulty']}_"
      f"{key['split_order']}_{digest}"
  )
  return {s: os.path.join(cache_dir, f"{stem}_{s}.npz") for s in SPLITS}


def build_splits(
    folder: str, resolution: int, difficulty: str, split_order: str, num_threads: int = 8
) -> dict[str, dict[str, np.ndarray]]:
  """Reads and decodes every image of ``folder``: split -> {"images" uint8 [n, res, res],
  "targets" uint8 [n], "num_empty" int64 []}. Empty PNG files are dropped after slicing, as
  LRA does (the release has at least one: ``pathfinder32/curv_baseline/imgs/0/sample_172.png``).
  """
  examples = read_metadata(folder)
  if split_order == "lra":
    examples = lra_order(examples, difficulty)
  bounds = split_bounds(len(examples))
  out = {}
  with concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool:
    for split in SPLITS:
      start, stop = bounds[split]
      part = examples[start:stop]
      keep = []
      for ex in part:
        try:
          size = os.path.getsize(ex.image)
        except FileNotFoundError:
          raise ValueError(
              f"image {ex.image!r} (listed at {ex.source}) does not exist (wrong "
              f"layout or incomplete unpacking?)."
          ) from None
        if size > 0:
          keep.append(ex)
      images = np.zeros((len(keep), resolution, resolution), np.uint8)
      decoded = pool.map(lambda ex: decode_png(ex.image, resolution, ex.source), keep, chunksize=64)
      for i, arr in enumerate(decoded):
        images[i] = arr
      out[split] = {
          "images": images,
          "targets": np.array([ex.label for ex in keep], np.uint8),
          "num_empty": np.int64(len(part) - len(keep)),
      }
  return out


def load_split(
    split: str,
    *,
    data_dir: str | os.PathLike | None,
    resolution: int = 32,
    difficulty: str = "hard",
    split_order: str = "lra",
    cache_dir: str | None = None,
    num_threads: int = 8,
) -> dict[str, np.ndarray]:
  """One split: ``inputs`` int32 ``[n, resolution**2]`` (intensity + 1, raster order),
  ``mask`` all True, ``targets`` int32 ``[n]``.

  The first call decodes all three splits and saves each as uint8 images + labels in one
  ``.npz`` under ``cache_dir`` (default ``paths.cache_dir``; ~200 MB per difficulty at
  32, ~3.3 GB for Path-X), named by a hash of the resolution, difficulty, split order, cache
  version and the metadata files' names, sizes and dates; writes are atomic. Later calls read
  the cached split. PNGs in another 8-bit mode are converted with Pillow's ``convert("L")``;
  16-bit / float images are an error (``decode_png``).
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
  _check_choice("split_order", split_order, SPLIT_ORDERS)
  folder = dataset_dir(data_dir, resolution, difficulty)
  paths.require(
      TASK, folder, data_dir, f"Pathfinder-{resolution} {difficulty} ({DIFFICULTIES[difficulty]})"
  )
  paths.require(TASK, os.path.join(folder, "metadata"), data_dir, "the metadata folder")
  key = _cache_key(folder, resolution, difficulty, split_order)
  cache_dir = os.fspath(cache_dir) if cache_dir else paths.cache_dir(TASK)
  files = _cache_paths(cache_dir, key)
  if not all(os.path.exists(p) for p in files.values()):
    splits = build_splits(folder, resolution, difficulty, split_order, num_threads)
    for s, arrays in splits.items():
      paths.save_npz_atomic(files[s], {**arrays, "key": np.array(json.dumps(key, sort_keys=True))})
    logging.info(
        "pathfinder: decoded %s (%s) into %s",
        folder,
        ", ".join(f"{s} {len(a['targets'])}" for s, a in splits.items()),
        cache_dir,
    )
  stored = _load_cache(files[split], key, resolution)
  n = stored["targets"].shape[0]
  if int(stored["num_empty"]):
    logging.info(
        "pathfinder %s: dropped %d empty image file(s), as LRA does.",
        split,
        int(stored["num_empty"]),
    )
  logging.info("pathfinder %s: %d examples from the cache %s", split, n, files[split])
  if n == 0:
    raise ValueError(f"pathfinder {split} split of {folder!r} is empty.")
  return examples(stored["images"], stored["targets"])


def examples(images: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
  """A split's arrays from uint8 images ``[n, r, r]`` and labels ``[n]``: ``inputs`` int32
  ``[n, r*r]`` (intensity + 1, raster order), ``mask`` bool all True, ``targets`` int32."""
  n, h, w = images.shape
  inputs = images.reshape(n, h * w).astype(np.int32) + 1
  return {
      "inputs": inputs,
      "mask": np.ones(inputs.shape, bool),
      "targets": np.asarray(targets).astype(np.int32),
  }


def task_info(resolution: int) -> TaskInfo:
  """The ``TaskInfo`` of Pathfinder images of side ``resolution`` (grid (r, r))."""
  return TaskInfo(
      kind="classify",
      vocab_size=VOCAB_SIZE,
      num_classes=NUM_CLASSES,
      max_length=resolution * resolution,
      grid=(resolution, resolution),
  )


def _load_cache(path: str, key: dict, resolution: int) -> dict[str, np.ndarray]:
  try:
    with np.load(path, allow_pickle=False) as z:
      stored = {k: z[k] for k in z.files}
  except (OSError, ValueError, EOFError) as e:
    raise ValueError(
        f"pathfinder cache file {path!r} is unreadable ({e}); delete it to " f"rebuild."
    ) from None
  want = json.dumps(key, sort_keys=True)
  if set(stored) != {"images", "targets", "num_empty", "key"} or str(stored["key"]) != want:
    raise ValueError(
        f"pathfinder cache file {path!r} does not hold the data asked for; delete "
        f"it to rebuild."
    )
  images = stored["images"]
  if (
      images.dtype != np.uint8
      or images.shape[1:] != (resolution, resolution)
      or (stored["targets"].shape != images.shape[:1])
  ):
    raise ValueError(
        f"pathfinder cache file {path!r} has images {images.dtype}{images.shape}; "
        f"delete it to rebuild."
    )
  return stored


class PathfinderTask(base.Task):
  """LRA Pathfinder / Path-X: 2-class classification of a grayscale image as a pixel sequence."""

  task_name = TASK
  config_fields = {
      # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data): reads
      # <root>/lra_release/pathfinder<resolution>/<difficulty folder>/.
      "data_dir": fields.path(),
      "cache_dir": fields.path(trajectory=False),  # decoded images ("" = paths.cache_dir)
      # 32 (LRA Pathfinder), 64, 128 (Path-X) or 256.
      "resolution": fields.Field("int", default=32, choices=RESOLUTIONS),
      # "easy" (curv_baseline), "intermediate" (curv_contour_length_9) or "hard"
      # (curv_contour_length_14, LRA's choice for Pathfinder and Path-X).
      "difficulty": fields.string("hard", DIFFICULTIES),
      # "lra": LRA's tfds order and 80/10/10 slices; "metadata": file order, same slices.
      "split_order": fields.string("lra", SPLIT_ORDERS),
      "num_threads": fields.integer(8, 1, trajectory=False),  # PNG decoding threads (first load)
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    _check_choice("resolution", cfg.resolution, RESOLUTIONS)
    _check_choice("difficulty", cfg.difficulty, tuple(DIFFICULTIES))
    _check_choice("split_order", cfg.split_order, SPLIT_ORDERS)
    if (
        isinstance(cfg.num_threads, bool)
        or not isinstance(cfg.num_threads, int)
        or (cfg.num_threads < 1)
    ):
      raise ValueError(f"num_threads must be an integer >= 1, got {cfg.num_threads!r}.")
    return task_info(cfg.resolution)

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    return load_split(
        split,
        data_dir=cfg.data_dir or None,
        resolution=cfg.resolution,
        difficulty=cfg.difficulty,
        split_order=cfg.split_order,
        cache_dir=cfg.cache_dir or None,
        num_threads=cfg.num_threads,
    )
