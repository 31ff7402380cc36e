"""Images as sequences of pixels: LRA Image (CIFAR-10 grayscale, task "lra_image") and MNIST
(task "mnist", the FastRPB paper's Table 2); one class, parameterised by ``SPECS``.

Sources: tfds ``cifar10`` 3.0.2 (32x32 RGB, 10 classes; LRA, Tay et al. 2021, Sec. 3.4) and
``mnist`` 3.0.1 (28x28 grayscale, 10 classes), prepared by ``python scripts/download_data.py
lra_image mnist --data_dir DIR`` and read through ``tfds.data_source`` (no TensorFlow).

Neither has a validation split: ``validation_fraction`` (0.1, LRA's share) of tfds train is
held out with a seeded permutation (LRA takes the last 10%: same sizes, other images). CIFAR-10
is made grayscale exactly as LRA does (``rgb_to_grayscale``). Each image becomes its pixels in
raster order with id = intensity + 1 (vocabulary 257; LRA uses the intensities themselves,
which changes only the embedding row each uses), mask all True, and ``TaskInfo.grid = (H, W)``
so that 2D positional schemes see the image. The pixels of each tfds split are cached once
(``fastpos.tasks.tfds_source``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import ml_collections
import numpy as np

from fastpos.tasks import base, tfds_source
from fastpos.tasks.info import TaskInfo

VOCAB_SIZE = 257  # 256 intensities + padding
CACHE_VERSION = 1
# LRA's grayscale weights (tf.image.rgb_to_grayscale, ITU-R BT.601 luma).
RGB_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], np.float32)
TFDS_SPLIT = {"train": "train", "validation": "train", "test": "test"}


@dataclasses.dataclass(frozen=True)
class ImageSpec:
  """One image dataset: its tfds name, image shape (height, width, channels) and classes."""

  tfds_name: str
  height: int
  width: int
  channels: int
  num_classes: int

  @property
  def grid(self) -> tuple[int, int]:
    return (self.height, self.width)

  @property
  def length(self) -> int:
    return self.height * self.width


SPECS = {
    "lra_image": ImageSpec("cifar10", 32, 32, 3, 10),
    "mnist": ImageSpec("mnist", 28, 28, 1, 10),
}


def rgb_to_grayscale(images: np.ndarray) -> np.ndarray:
  """LRA's grayscale: ``tf.image.rgb_to_grayscale`` on uint8, replayed in numpy float32::

    gray = uint8( trunc( ((R/255) * 0.2989 + (G/255) * 0.5870 + (B/255) * 0.1140) * 255.5 ) )

  (``convert_image_dtype`` to float32 multiplies by 1/255; back to uint8 it multiplies by 255.5
  and truncates; the largest value is 255.47, so nothing saturates). The sum runs left to right
  in float32; another order would change a few dozen of the 2^24 colours by 1.

  Args:
    images: uint8 ``[..., 3]`` (RGB).
  Returns:
    uint8 ``[...]``.
  """
  images = np.asarray(images)
  if images.dtype != np.uint8 or images.ndim < 1 or images.shape[-1] != 3:
    raise ValueError(
        f"rgb_to_grayscale expects uint8 [..., 3], got {images.dtype} " f"{list(images.shape)}."
    )
  f = images.astype(np.float32) * np.float32(1.0 / 255)
  gray = (f[..., 0] * RGB_WEIGHTS[0] + f[..., 1] * RGB_WEIGHTS[1]) + f[..., 2] * RGB_WEIGHTS[2]
  return (gray * np.float32(255.5)).astype(np.uint8)  # float -> uint8 truncates, as TF's cast


def encode(gray: np.ndarray) -> np.ndarray:
  """Token ids uint16 ``[..., H * W]`` of grayscale images uint8 ``[..., H, W]``: raster
  order, id = intensity + 1."""
  gray = np.asarray(gray)
  if gray.dtype != np.uint8 or gray.ndim < 2:
    raise ValueError(f"encode expects uint8 [..., H, W], got {gray.dtype} {list(gray.shape)}.")
  return gray.reshape(gray.shape[:-2] + (-1,)).astype(np.uint16) + 1


def decode(ids: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
  """Grayscale images uint8 ``[..., H, W]`` of token ids ``[..., H * W]`` (ids 1..256)."""
  ids = np.asarray(ids)
  h, w = grid
  if ids.shape[-1:] != (h * w,) or ids.min() < 1 or ids.max() > 256:
    raise ValueError(
        f"decode expects ids in 1..256 of shape [..., {h * w}], got "
        f"{list(ids.shape)} with ids {ids.min()}..{ids.max()}."
    )
  return (ids - 1).astype(np.uint8).reshape(ids.shape[:-1] + (h, w))


def read_images(source: Sequence[Any], split: str, spec: ImageSpec) -> dict[str, np.ndarray]:
  """Every image of a tfds data source as grayscale pixels.

  Returns:
    ``pixels`` uint8 ``[n, H * W]`` (raster order), ``labels`` uint8 ``[n]``.
  """
  n = len(source)
  pixels = np.empty((n, spec.length), np.uint8)
  labels = np.empty(n, np.uint8)
  want = (spec.height, spec.width, spec.channels)
  for start, chunk in tfds_source.iter_chunks(source):
    for i, ex in enumerate(chunk, start):
      img = np.asarray(ex["image"])
      if img.shape != want or img.dtype != np.uint8:
        raise ValueError(
            f"{spec.tfds_name} {split} example {i}: image {img.dtype} "
            f"{list(img.shape)}, expected uint8 {list(want)}."
        )
      label = int(ex["label"])
      if not 0 <= label < spec.num_classes:
        raise ValueError(
            f"{spec.tfds_name} {split} example {i}: label {label} outside "
            f"0..{spec.num_classes - 1}."
        )
      labels[i] = label
    images = np.stack([np.asarray(ex["image"]) for ex in chunk])  # [c, H, W, C]
    gray = rgb_to_grayscale(images) if spec.channels == 3 else images[..., 0]
    pixels[start : start + len(chunk)] = gray.reshape(len(chunk), spec.length)
  return {"pixels": pixels, "labels": labels}


class ImageTask(base.Task):
  """An image classified from its pixel sequence; subclasses set ``spec`` and ``task_name``.
  Accuracy picks the best checkpoint."""

  spec: ClassVar[ImageSpec]

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    tfds_source.check_fraction_and_seed(cfg.validation_fraction, cfg.validation_seed)
    s = cls.spec
    return TaskInfo(
        kind="classify",
        vocab_size=VOCAB_SIZE,
        num_classes=s.num_classes,
        max_length=s.length,
        grid=s.grid,
    )

  def __init__(self, cfg: ml_collections.ConfigDict):
    super().__init__(cfg)
    self._raw: dict[str, dict[str, np.ndarray]] = {}  # tfds split -> cached arrays

  def raw_split(self, tfds_split: str) -> dict[str, np.ndarray]:
    """The cached arrays of a tfds split (``read_images``), read or built once."""
    if tfds_split not in self._raw:
      cfg, spec = self.cfg, self.spec
      self._raw[tfds_split] = tfds_source.cached_split(
          task=self.task_name,
          name=spec.tfds_name,
          split=tfds_split,
          data_dir=cfg.data_dir or None,
          cache_dir=cfg.cache_dir or None,
          params={},
          version=CACHE_VERSION,
          fields=("pixels", "labels"),
          build=lambda src, s: read_images(src, s, spec),
      )
    return self._raw[tfds_split]

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    raw = self.raw_split(TFDS_SPLIT[split])
    idx = tfds_source.split_indices(
        split, raw["labels"].shape[0], self.cfg.validation_fraction, self.cfg.validation_seed
    )
    inputs = raw["pixels"][idx].astype(np.uint16) + 1
    return {
        "inputs": inputs,
        "mask": np.ones(inputs.shape, bool),
        "targets": raw["labels"][idx].astype(np.int32),
    }


class LraImageTask(ImageTask):
  """LRA Image: CIFAR-10 in LRA's grayscale, 1024 pixels, grid (32, 32), 10 classes."""

  task_name = "lra_image"
  config_fields = tfds_source.FIELDS
  spec = SPECS["lra_image"]


class MnistTask(ImageTask):
  """MNIST: 784 pixels, grid (28, 28), 10 classes."""

  task_name = "mnist"
  config_fields = tfds_source.FIELDS
  spec = SPECS["mnist"]
