"""LRA Pathfinder images from the project's own port of Linsley et al.'s generator.

LRA's Pathfinder images were made by ``snakes2.py`` of github.com/drewlinsley/pathfinder (Kim,
Linsley et al. 2020, "Disentangling neural mechanisms for perceptual grouping") with the settings
LRA's tfds builder lists (``lra_benchmarks/data/pathfinder.py``, class docstrings of
``Pathfinder32`` / ``Pathfinder64``). An image holds two target "snakes" (chains of
``contour_length`` short dashes, "paddles", each turning from the last by an angle drawn with
a cos^2 weight), short distractor snakes, and two round markers: on both ends of one target
snake (label 1) or on one end of each (label 0).

This module re-implements that procedure in numpy, vectorised across a batch of images (the
original draws one image at a time with OpenCV, PIL and scipy). The paddle shapes (once per
setting) and markers (once per position) are rendered with Pillow as the original renders them
(a line drawn at
``antialias_scale`` times the resolution, Lanczos-reduced as 8-bit, as ``scipy.misc.imresize``
did), and each image is then built by pasting those patches, so the pixels follow the same
rules; the random draws are our own (images are not the original's images for any seed, but
the same distribution: ``scripts/pathfinder_compare.py`` tests that against images of the
original code, docs/data.md "Generated Pathfinder").

The procedure, per image, as ``snakes2.from_wrapper`` (every quirk kept):
  1. label ~ {0, 1}; two seed paddles: the first at a uniformly drawn free pixel of the centre
     (``2 * seed_distance`` from each border, the occupied mask dilated by the paddle's own
     shape; for most angles OpenCV's dilation border leaves no free pixel at all, see
     ``seed_void``), the second ``seed_distance`` away at a random angle; each extended
     ``contour_length - 1`` times in turn (``_extend``). A failure anywhere restarts both.
  2. ``num_distractor_snakes`` distractors of ``distractor_length`` paddles, each tried up to
     ``max_distractor_contour_retrial + 1`` times, then skipped.
  3. markers at the first paddle's tail and at the last paddle's head; the image is
     byte-scaled to 0..255 by its own maximum (``scipy.misc.imsave``).

``generate(n, resolution=32, difficulty="hard", seed=0)`` -> uint8 images ``[n, r, r]``,
uint8 labels ``[n]`` and int16 ``num_distractors`` ``[n]`` (distractor snakes placed).
Deterministic for (settings, n, seed). ``GeneratedPathfinderTask`` (task
``pathfinder_generated``) serves the splits, generated once into the cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import os

import ml_collections
import numpy as np
from absl import logging
from PIL import Image, ImageDraw

from fastpos import fields
from fastpos.tasks import base, pathfinder, paths
from fastpos.tasks.info import TaskInfo

TASK = "pathfinder_generated"
# Bump when the generator's output for a given (settings, seed) changes: the cache key holds it.
GENERATOR_VERSION = 1

SPLITS = base.SPLITS
RESOLUTIONS = (32, 64)
# Difficulty -> the target snakes' number of paddles (LRA folder curv_baseline,
# curv_contour_length_9, curv_contour_length_14).
CONTOUR_LENGTHS = {"easy": 6, "intermediate": 9, "hard": 14}
CHUNK = 2048  # images drawn in lockstep (memory ~ CHUNK * (r + 2R)^2 * 8 bytes per canvas)
_MAX_ATTEMPTS = 100_000  # two-snake attempts per image before giving up (hard 32: ~50)
_BATCH = {32: 8192, 64: 2048}  # two-snake attempts drawn at once


@dataclasses.dataclass(frozen=True)
class Settings:
  """``snakes2_wrapper`` arguments (names as there); lengths in pixels, contrasts as factors.

  ``distractor_length`` is ``contour_length // 3`` and ``num_distractor_snakes`` a constant
  "ink" budget over it (20 paddles at 32, 22 at 64), recomputed per difficulty.
  """

  resolution: int
  contour_length: int
  distractor_length: int
  num_distractor_snakes: int
  paddle_length: int
  paddle_thickness: float
  paddle_margin: int
  padding: int
  seed_distance: int
  marker_radius: float
  antialias_scale: int
  continuity: float
  snake_contrast: float  # distractors' paddles
  paddle_contrast: float  # target paddles: paddle_contrast * snake_contrast
  max_paddle_retrial: int = 2
  max_distractor_contour_retrial: int = 4

  @property
  def reach(self) -> int:
    """Half the side of a paddle patch: ``length + ceil(thickness) + margin``."""
    return self.paddle_length + int(math.ceil(self.paddle_thickness)) + self.paddle_margin


def settings(resolution: int = 32, difficulty: str = "hard") -> Settings:
  """LRA's settings for ``resolution`` (32: Pathfinder, 64) and ``difficulty``."""
  if isinstance(resolution, bool) or resolution not in RESOLUTIONS:
    raise ValueError(
        f"unknown resolution {resolution!r} for the Pathfinder generator; valid choices: "
        f"{', '.join(map(str, RESOLUTIONS))}."
    )
  if difficulty not in CONTOUR_LENGTHS:
    raise ValueError(
        f"unknown difficulty {difficulty!r}; valid choices: {', '.join(CONTOUR_LENGTHS)}."
    )
  cl = CONTOUR_LENGTHS[difficulty]
  dl = cl // 3
  if resolution == 32:  # LRA's Pathfinder32 docstring
    return Settings(32, cl, dl, 20 // dl, 2, 0.5, 1, 1, 7, 1.5, 2, 1.0, 2.0, 0.75)
  # Pathfinder64: paddle length and contrast are snakes2_wrapper's defaults (5, 1.0)
  return Settings(64, cl, dl, 22 // dl, 5, 1.0, 1, 1, 12, 2.5, 2, 1.8, 0.8, 1.0)


# --------------------------------------------------------------------------- shapes (tables)
def _translate(y, x, orientation, dist):
  """``snakes.translate_coord``: the point ``dist`` along ``orientation``, rounded up."""
  dist = float(dist)
  return (
      np.ceil(y + dist * np.sin(orientation)).astype(np.int64),
      np.ceil(x + dist * np.cos(orientation)).astype(np.int64),
  )


def _flip(orientation):
  return np.where(orientation < 0, orientation + np.pi, orientation - np.pi)


def _disk(radius: float) -> np.ndarray:
  """Bool ``[2k+1, 2k+1]``: ``x^2 + y^2 <= radius^2`` (``generate_dilation_struct``)."""
  k = int(radius)
  y, x = np.ogrid[-k : k + 1, -k : k + 1]
  return x**2 + y**2 <= radius**2


def _dilate(image: np.ndarray, kernel: np.ndarray) -> np.ndarray:
  """Grey dilation with a centred bool kernel, outside pixels ignored (``cv2.dilate``)."""
  h, w = image.shape
  kh, kw = kernel.shape
  ay, ax = kh // 2, kw // 2
  padded = np.full((h + kh - 1, w + kw - 1), -np.inf)
  padded[ay : ay + h, ax : ax + w] = image
  out = np.full((h, w), -np.inf)
  for i, j in zip(*np.nonzero(kernel)):
    out = np.maximum(out, padded[i : i + h, j : j + w])
  return out


def _reduce(image: np.ndarray, size: int) -> np.ndarray:
  """``scipy.misc.imresize(image, (size, size), "lanczos")`` as float in [0, 1]: byte-scaled
  to 8 bits, Lanczos-reduced by Pillow as 8 bits, divided by 255."""
  if image.dtype != np.uint8:
    lo, hi = float(image.min()), float(image.max())
    scale = 255.0 / (hi - lo) if hi > lo else 255.0
    image = (np.clip((image - lo) * scale, 0, 255) + 0.5).astype(np.uint8)
  out = Image.fromarray(image, "L").resize((size, size), Image.Resampling.LANCZOS)
  return np.asarray(out, np.float32) / 255.0


def _paddle(s: Settings, orientation: float) -> tuple[np.ndarray, np.ndarray]:
  """``snakes.draw_line_n_mask`` before placement: the line and its margin mask, float32
  ``[2R+1, 2R+1]`` centred on the paddle's start, ``R = s.reach``."""
  aa, r = s.antialias_scale, s.reach
  c = r * aa
  hy, hx = _translate(c, c, orientation, s.paddle_length * aa)
  blown = Image.new("F", (2 * c + 1, 2 * c + 1), "black")
  ImageDraw.Draw(blown).line(
      [(c, c), (int(hx), int(hy))], fill="white", width=int(round(s.paddle_thickness * aa))
  )
  blown = np.asarray(blown, np.float32)
  mask = _dilate(blown, _disk(s.paddle_margin * aa)).astype(np.uint8)
  return _reduce(blown, 2 * r + 1), _reduce(mask, 2 * r + 1)


def _place(patch: np.ndarray, shape: tuple[int, int], y: int, x: int) -> np.ndarray:
  """``patch`` centred at ``(y, x)`` on a zero canvas of ``shape``, clipped."""
  r = patch.shape[0] // 2
  big = np.zeros((shape[0] + 2 * r, shape[1] + 2 * r), patch.dtype)
  big[y : y + 2 * r + 1, x : x + 2 * r + 1] = patch
  return big[r : r + shape[0], r : r + shape[1]]


@dataclasses.dataclass(frozen=True)
class _Tables:
  """Everything drawn once per setting. Orientation ids: 0..359 the seeds' whole degrees
  (-180..179), 360.. the flipped directions of the extension offsets."""

  seed_angles: np.ndarray  # float64 [360]
  ext_offsets: np.ndarray  # int64 [K, 2]: candidate heads around a pivot (dy, dx)
  ext_angles: np.ndarray  # float64 [K]: their directions
  lines: np.ndarray  # float32 [360 + K, P, P]
  masks: np.ndarray  # float32 [360 + K, P, P]
  struct_offsets: np.ndarray  # int64 [M, 2]: (dy, dx) any seed's footprint uses
  struct_use: np.ndarray  # bool [360, M]: which of them each seed angle uses
  target_free: np.ndarray | None  # uint64 [360, r]: free pixels of the first target seed
  seed_void: np.ndarray  # bool [360]: the footprint leaves a pixel seeing only the outside
  dilated_masks: np.ndarray  # float32 [360 + K, P + 2m, P + 2m]: masks dilated by the disk
  empty_mask: np.ndarray  # float32 [r, r]: the padding border
  empty_dilated: np.ndarray  # float32 [r, r]: it dilated by the margin's disk


@functools.lru_cache(maxsize=8)
def _tables(s: Settings) -> _Tables:
  seed_angles = np.arange(-180, 180) * np.pi / 180
  # get_coords_cmf: one sample per pixel of arc on the circle of radius length + margin
  step = s.paddle_length + s.paddle_margin
  deg = np.arange(0, 360, 360.0 / (2 * step * np.pi)) * np.pi / 180
  raw = np.stack([np.floor(step * np.sin(deg)), np.floor(step * np.cos(deg))], 1)
  ext_offsets = np.unique(raw.astype(np.int64), axis=0)
  ext_angles = np.arctan2(ext_offsets[:, 0], ext_offsets[:, 1]).astype(np.float64)
  drawn = [_paddle(s, float(o)) for o in (*seed_angles, *_flip(ext_angles))]
  lines = np.stack([d[0] for d in drawn])
  masks = np.stack([d[1] for d in drawn])
  # seed_snake's dilation struct: the saturated pixels of the mask of a paddle drawn from
  # (step + 1, step + 1) on a (2 step + 1)^2 canvas; cv2 anchors it at the centre.
  side = 2 * step + 1
  feet = np.stack([_place(masks[a], (side, side), step + 1, step + 1) >= 1.0 for a in range(360)])
  used = feet.any(0)
  struct_offsets = np.argwhere(used) - step
  struct_use = feet[:, used]
  # cv2.dilate pads with -DBL_MAX: a pixel whose footprint lies wholly outside the image
  # dilates to -DBL_MAX, and find_available_coordinates then reports no free pixel at all.
  # A footprint without the centre does that for most angles (the original's "mystery").
  r = s.resolution
  seed_void = np.zeros(360, bool)
  for a in range(360):
    seen = np.zeros((r, r), bool)
    for dy, dx in np.argwhere(feet[a]) - step:
      seen[max(0, -dy) : min(r, r - dy), max(0, -dx) : min(r, r - dx)] = True
    seed_void[a] = not seen.all()
  border = max(s.padding, 2 * s.seed_distance)
  occ = np.repeat(_occupied_bits(np.zeros((1, r, r), np.float32), border), 360, 0)
  m = s.paddle_margin
  disk = _disk(m)
  padded = np.pad(masks, ((0, 0), (m, m), (m, m)))
  dilated_masks = np.stack([_dilate(p, disk) for p in padded]).astype(np.float32)
  empty = np.zeros((s.resolution, s.resolution), np.float32)
  p = s.padding
  empty[:p] = empty[-p:] = 1.0
  empty[:, :p] = empty[:, -p:] = 1.0
  empty_dilated = _dilate(empty, disk).astype(np.float32)
  t = _Tables(
      seed_angles=seed_angles,
      ext_offsets=ext_offsets,
      ext_angles=ext_angles,
      lines=lines,
      masks=masks,
      struct_offsets=struct_offsets,
      struct_use=struct_use,
      target_free=None,
      seed_void=seed_void,
      dilated_masks=dilated_masks,
      empty_mask=empty,
      empty_dilated=empty_dilated,
  )
  # the first target seed sees an empty mask lined 2 * seed_distance deep: one table
  return dataclasses.replace(t, target_free=_free_bits(t, occ, np.arange(360), r))


@functools.lru_cache(maxsize=None)
def _marker(s: Settings, cy: int, cx: int) -> np.ndarray:
  """``snakes2.draw_circle`` at (cy, cx), float32 ``[r, r]``: a disk of ``marker_radius``
  drawn at ``antialias_scale`` times the resolution, Lanczos-reduced (drawn on first use)."""
  r, aa = s.resolution, s.antialias_scale
  y, x = np.ogrid[-cy * aa : (r - cy) * aa, -cx * aa : (r - cx) * aa]
  return _reduce((x**2 + y**2 <= (s.marker_radius * aa) ** 2).astype(np.float64), r)


def _markers(s: Settings, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
  """The markers at (ys[i], xs[i]), float32 ``[n, r, r]`` (n >= 1)."""
  return np.stack([_marker(s, int(y), int(x)) for y, x in zip(ys, xs)])


# --------------------------------------------------------------------------- the batch
class _Canvas:
  """Image, mask and margin-dilated mask of ``n`` images, float32 ``[n, r + 2G, r + 2G]``
  (pixel (y, x) at (y + G, x + G), ``G = R + margin``): patches paste whole; what lands in the
  margins is never read. ``dil`` is the mask dilated by the margin's disk (``extend_snake``'s
  ``dilated_mask``), kept by pasting dilated patches: dilation commutes with max, and a patch
  pixel outside the image (clipped by the original) only reaches pixels that the border line
  already saturates (padding >= 1)."""

  def __init__(self, s: Settings, t: _Tables, n: int):
    self.s, self.t, self.r, self.R = s, t, s.resolution, s.reach
    self.G = G = s.reach + s.paddle_margin
    side = s.resolution + 2 * G
    self.side = side
    self.img = np.zeros((n, side, side), np.float32)
    self.msk = np.zeros((n, side, side), np.float32)
    self.dil = np.zeros((n, side, side), np.float32)
    self.msk[:, G : G + self.r, G : G + self.r] = t.empty_mask
    self.dil[:, G : G + self.r, G : G + self.r] = t.empty_dilated

  def subset(self, rows: np.ndarray) -> _Canvas:
    out = object.__new__(_Canvas)
    out.__dict__.update(self.__dict__)
    out.img, out.msk, out.dil = self.img[rows], self.msk[rows], self.dil[rows]
    return out

  def _flat(self, rows, y, x, half: int):
    """Flat indices ``[len(rows), (2 half + 1)^2]`` of the windows centred on (y, x)."""
    span = np.arange(-half, half + 1)
    window = (span[:, None] * self.side + span[None, :]).ravel()
    base = rows * self.side * self.side + (y + self.G) * self.side + (x + self.G)
    return base[:, None] + window[None, :]

  def paste(self, which: str, rows, ids, y, x, scale: float = 1.0) -> None:
    """max-composites patch ``ids`` (orientation ids) centred on (y, x) into rows: "img" the
    line (times ``scale``), "msk" its mask (and the dilated mask its dilation)."""
    if not len(rows):
      return
    t = self.t
    pairs = [(self.img, t.lines, self.R)]
    if which == "msk":
      pairs = [(self.msk, t.masks, self.R), (self.dil, t.dilated_masks, self.G)]
    for arr, table, half in pairs:
      flat = arr.reshape(-1)
      idx = self._flat(rows, y, x, half)
      vals = table[ids].reshape(len(rows), -1)
      flat[idx] = np.maximum(flat[idx], vals * np.float32(scale) if which == "img" else vals)

  def collides(self, rows, ids, y, x) -> np.ndarray:
    """``max(mask + m_im) >= 1.8`` for each row: the new paddle's mask over the old mask."""
    if not len(rows):
      return np.zeros(0, bool)
    P = 2 * self.R + 1
    old = self.msk.reshape(-1)[self._flat(rows, y, x, self.R)].reshape(len(rows), P, P)
    span = np.arange(-self.R, self.R + 1)
    vy, vx = _in_image(self.r, y[:, None] + span), _in_image(self.r, x[:, None] + span)
    old = np.where(vy[:, :, None] & vx[:, None, :], old, 0)  # the original clips the patch
    return (old + self.t.masks[ids]).max((1, 2)) >= 1.8

  def dilated_at(self, rows, y, x) -> np.ndarray:
    """The dilated mask at in-image pixels (y, x) ``[n, k]`` (elsewhere: any value)."""
    lo, hi = -self.G, self.r + self.G - 1
    y, x = np.minimum(np.maximum(y, lo), hi), np.minimum(np.maximum(x, lo), hi)
    flat = (rows * self.side * self.side)[:, None] + (y + self.G) * self.side + (x + self.G)
    return self.dil.reshape(-1)[flat]

  def occupied_bits(self, rows, border: int) -> np.ndarray:
    """uint64 ``[n, r]``: bit x of row y set where mask > 0.3 or within ``border`` of an
    edge."""
    G, r = self.G, self.r
    return _occupied_bits(self.msk[rows, G : G + r, G : G + r], border)


def _occupied_bits(mask: np.ndarray, border: int) -> np.ndarray:
  """uint64 ``[n, r]`` of a mask ``[n, r, r]``: bit x of word y set where mask > 0.3 or
  within ``border`` of an edge (``seed_snake``'s lined mask, occupied where not free)."""
  occ = mask > 0.3
  occ[:, :border] = occ[:, -border:] = True
  occ[:, :, :border] = occ[:, :, -border:] = True
  packed = np.packbits(occ, axis=-1, bitorder="little")
  full = np.zeros(packed.shape[:2] + (8,), np.uint8)
  full[..., : packed.shape[2]] = packed
  return full.view("<u8")[..., 0]


def _shift_bits(bits: np.ndarray, dy: int, dx: int, width: int) -> np.ndarray:
  """out(y, x) = bits(y + dy, x + dx), zero outside (bit x of a row word is pixel x)."""
  out = np.zeros_like(bits)
  n = bits.shape[1]
  if dy >= 0:
    out[:, : n - dy] = bits[:, dy:]
  else:
    out[:, -dy:] = bits[:, : n + dy]
  if dx >= 0:
    out >>= np.uint64(dx)
  else:
    out <<= np.uint64(-dx)
    out &= np.uint64((1 << width) - 1) if width < 64 else np.uint64(2**64 - 1)
  return out


def _free_bits(t: _Tables, occ: np.ndarray, angle_ids: np.ndarray, r: int) -> np.ndarray:
  """uint64 ``[n, r]``: the pixels where a seed paddle of each angle meets no occupied pixel
  of ``occ`` (``seed_snake``'s mask dilated by the paddle's footprint ``struct_use[angle]``)."""
  use = t.struct_use[angle_ids]
  dil = np.zeros_like(occ)
  ones = np.uint64(2**64 - 1)
  for k, (dy, dx) in enumerate(t.struct_offsets):
    sel = np.where(use[:, k], ones, np.uint64(0))[:, None]
    dil |= _shift_bits(occ, int(dy), int(dx), r) & sel
  return ~dil & (np.uint64((1 << r) - 1) if r < 64 else ones)


def _pick_free(rng, t: _Tables, free: np.ndarray, angle_ids, r: int):
  """A uniformly drawn set bit of each row of ``free`` ``[n, r]``; no set bit (or a void
  angle, ``seed_void``) fails. Returns (ok, y, x)."""
  ar = np.arange(len(angle_ids))
  per_row = np.bitwise_count(free).astype(np.int64)
  total = per_row.sum(1)
  ok = (total > 0) & ~t.seed_void[angle_ids]
  pick = np.floor(rng.random(len(ar)) * np.maximum(total, 1)).astype(np.int64)
  cum = np.cumsum(per_row, 1)
  y = np.argmax(cum > pick[:, None], 1)
  k = pick - (cum[ar, y] - per_row[ar, y])
  word = free[ar, y]
  bits = ((word[:, None] >> np.arange(r, dtype=np.uint64)[None, :]) & np.uint64(1)).astype(np.int64)
  x = np.argmax(np.cumsum(bits, 1) > k[:, None], 1)
  return ok, y.astype(np.int64), x.astype(np.int64)


def _in_image(r, *coords) -> np.ndarray:
  ok = (coords[0] >= 0) & (coords[0] < r)
  for v in coords[1:]:
    ok &= (v >= 0) & (v < r)
  return ok


def _seed_orientation(rng, n):
  ids = rng.integers(0, 360, n)
  return ids, (ids - 180) * np.pi / 180


class _Snakes:
  """The growing ends of snakes in ``rows`` of a canvas: pivot, orientation and the last
  paddle (id, position), whose mask joins the canvas mask when the next paddle is placed."""

  def __init__(self, rows, py, px, orient, last_id, ly, lx):
    self.rows, self.py, self.px, self.orient = rows, py, px, orient
    self.last_id, self.ly, self.lx = last_id, ly, lx

  def take(self, keep):
    return _Snakes(*(a[keep] for a in vars(self).values()))


def _seed(rng, s, t, free_of, n: int):
  """``seed_snake`` for ``n`` snakes (up to ``max_paddle_retrial + 1`` orientations);
  ``free_of(todo, angle_ids)`` gives the free-pixel bits of those snakes for those angles.
  Returns (ok, {"ty", "tx", "py", "px", "id"}: tail, pivot and angle id, orientation)."""
  L, m, r = s.paddle_length, s.paddle_margin, s.resolution
  ok = np.zeros(n, bool)
  out = {k: np.zeros(n, np.int64) for k in ("ty", "tx", "py", "px", "id")}
  orient = np.zeros(n)
  todo = np.arange(n)
  for _ in range(s.max_paddle_retrial + 1):
    if not len(todo):
      break
    ids, o = _seed_orientation(rng, len(todo))
    free, ty, tx = _pick_free(rng, t, free_of(todo, ids), ids, r)
    hy, hx = _translate(ty, tx, o, L)
    py, px = _translate(hy, hx, _flip(o), L + m)
    good = free & _in_image(r, hy, hx, py, px)
    g = todo[good]
    ok[g] = True
    for k, v in (("ty", ty), ("tx", tx), ("py", py), ("px", px), ("id", ids)):
      out[k][g] = v[good]
    orient[g] = o[good]
    todo = todo[free & ~good]  # no free pixel: give up at once, as the original does
  return ok, out, orient


def _extend(rng, s, t, c: _Canvas, sn: _Snakes, contrast: float) -> np.ndarray:
  """``extend_snake`` for every snake of ``sn`` (in place); returns which succeeded.

  The next pivot lies ``length + 2 margin`` ahead; a head is drawn among the pixels at
  ``length + margin`` from it with weight (1 - dilated mask) * cos^2(min(continuity * turn,
  pi/2)); up to ``max_paddle_retrial + 1`` draws until its mask does not overlap the mask
  (``max(mask + new) < 1.8``)."""
  L, m, r = s.paddle_length, s.paddle_margin, s.resolution
  n = len(sn.rows)
  ny, nx = _translate(sn.py, sn.px, sn.orient, L + 2 * m)
  cy = ny[:, None] + t.ext_offsets[None, :, 0]
  cx = nx[:, None] + t.ext_offsets[None, :, 1]
  inside = _in_image(r, cy, cx)
  dil = c.dilated_at(sn.rows, cy, cx)
  turn = np.abs(t.ext_angles[None, :] - sn.orient[:, None])
  turn = np.minimum(np.minimum(turn, 2 * np.pi - turn) * s.continuity, 0.5 * np.pi)
  pmf = np.where(inside, (1 - dil) * np.maximum(np.cos(turn), 0) ** 2, 0)
  total = pmf.sum(1)
  alive = total >= 1e-4
  cmf = np.cumsum(pmf, 1) / np.maximum(total, 1e-30)[:, None]
  found = np.zeros(n, bool)
  pick = np.zeros(n, np.int64)
  todo = np.flatnonzero(alive)
  for _ in range(s.max_paddle_retrial + 1):
    if not len(todo):
      break
    k = np.argmax(cmf[todo] > rng.random(len(todo))[:, None], 1)
    hit = ~c.collides(sn.rows[todo], 360 + k, cy[todo, k], cx[todo, k])
    found[todo[hit]] = True
    pick[todo[hit]] = k[hit]
    todo = todo[~hit]
  g = np.flatnonzero(found)
  k = pick[g]
  hy, hx = cy[g, k], cx[g, k]
  rows = sn.rows[g]
  c.paste("img", rows, 360 + k, hy, hx, contrast)
  c.paste("msk", rows, sn.last_id[g], sn.ly[g], sn.lx[g])
  sn.py[g], sn.px[g], sn.orient[g] = ny[g], nx[g], t.ext_angles[k]
  sn.last_id[g], sn.ly[g], sn.lx[g] = 360 + k, hy, hx
  return found


def _two_snakes(rng, s, t, n):
  """``n`` independent ``two_snakes`` attempts; returns the canvas of the k that succeeded,
  their origin and terminal tips ``[k, 2, 2]`` (tips[i, snake] = (y, x))."""
  contrast = s.paddle_contrast * s.snake_contrast
  ok1, a, o1 = _seed(rng, s, t, lambda todo, ids: t.target_free[ids], n)
  # the second seed: seed_distance from the first, no occupancy test (as the original)
  ok2 = np.zeros(n, bool)
  b = {k: np.zeros(n, np.int64) for k in ("ty", "tx", "py", "px", "id")}
  o2 = np.zeros(n)
  todo = np.arange(n)
  L, m, r = s.paddle_length, s.paddle_margin, s.resolution
  for _ in range(s.max_paddle_retrial + 1):
    ids, o = _seed_orientation(rng, len(todo))
    ang = rng.integers(0, 360, len(todo)) * np.pi / 180
    ty = np.round(a["ty"][todo] + s.seed_distance * np.sin(ang)).astype(np.int64)
    tx = np.round(a["tx"][todo] + s.seed_distance * np.cos(ang)).astype(np.int64)
    hy, hx = _translate(ty, tx, o, L)
    py, px = _translate(hy, hx, _flip(o), L + m)
    good = _in_image(r, hy, hx, py, px)
    g = todo[good]
    ok2[g] = True
    for k, v in (("ty", ty), ("tx", tx), ("py", py), ("px", px), ("id", ids)):
      b[k][g] = v[good]
    o2[g] = o[good]
    todo = todo[~good]
  ok = ok1 & ok2
  origin = np.stack([np.stack([a["ty"], a["tx"]], 1), np.stack([b["ty"], b["tx"]], 1)], 1)
  live = np.flatnonzero(ok)
  c = _Canvas(s, t, len(live))  # only attempts with both seeds get a canvas
  snakes = []
  for d, o in ((a, o1), (b, o2)):
    c.paste("img", np.arange(len(live)), d["id"][live], d["ty"][live], d["tx"][live], contrast)
    snakes.append(
        _Snakes(
            np.arange(len(live)),
            d["py"][live],
            d["px"][live],
            o[live],
            d["id"][live],
            d["ty"][live],
            d["tx"][live],
        )
    )
  for _ in range(s.contour_length - 1):
    for i in (0, 1):
      done = _extend(rng, s, t, c, snakes[i], contrast)
      keep = np.isin(snakes[1 - i].rows, snakes[i].rows[done])
      snakes[i] = snakes[i].take(done)
      snakes[1 - i] = snakes[1 - i].take(keep)
  # the original adds only the second snake's last paddle to the mask
  last = snakes[1]
  c.paste("msk", last.rows, last.last_id, last.ly, last.lx)
  done = snakes[0].rows  # canvas rows of the attempts that succeeded
  terminal = np.zeros((len(done), 2, 2), np.int64)
  for i in (0, 1):
    terminal[:, i] = np.stack([snakes[i].ly, snakes[i].lx], 1)
  return c.subset(done), origin[live[done]], terminal


def _distractor(rng, s, t, c: _Canvas, rows) -> np.ndarray:
  """``make_snake`` (a distractor) on images ``rows`` of ``c``; commits the snakes that
  succeed and returns which did. Fails when under 1% of the image is free, when no pixel takes
  the seed, or when an extension fails (the image is then left as it was)."""
  r, G = s.resolution, c.G
  occ = c.occupied_bits(rows, 1)
  ok, d, o = _seed(rng, s, t, lambda todo, ids: _free_bits(t, occ[todo], ids, r), len(rows))
  ok &= (c.msk[rows, G : G + r, G : G + r] <= 0.3).sum((1, 2)) >= 0.01 * r * r
  live = np.flatnonzero(ok)
  sub = c.subset(rows[live])  # a copy: a failed snake leaves no trace
  local = np.arange(len(live))
  sub.paste("img", local, d["id"][live], d["ty"][live], d["tx"][live], s.snake_contrast)
  sn = _Snakes(
      local, d["py"][live], d["px"][live], o[live], d["id"][live], d["ty"][live], d["tx"][live]
  )
  for _ in range(s.distractor_length - 1):
    sn = sn.take(_extend(rng, s, t, sub, sn, s.snake_contrast))
  sub.paste("msk", sn.rows, sn.last_id, sn.ly, sn.lx)
  done = rows[live[sn.rows]]
  c.img[done], c.msk[done], c.dil[done] = sub.img[sn.rows], sub.msk[sn.rows], sub.dil[sn.rows]
  out = np.zeros(len(rows), bool)
  out[live[sn.rows]] = True
  return out


def _targets(rng, s: Settings, t: _Tables, n: int):
  """Two target snakes on each of ``n`` canvases, by rejection: batches of fresh two-snake
  attempts (each independent, as the original's ``while not success`` restarts), the first
  ``n`` successes kept. Returns (canvas, origin tips, terminal tips) ``[n, 2, 2]``."""
  c = _Canvas(s, t, n)
  origin = np.zeros((n, 2, 2), np.int64)
  terminal = np.zeros((n, 2, 2), np.int64)
  filled, tried, succeeded = 0, 0, 0
  while filled < n:
    if tried > _MAX_ATTEMPTS * n:
      raise RuntimeError(
          f"Pathfinder generator: under 1 in {_MAX_ATTEMPTS} attempts fits two target "
          f"snakes ({s})."
      )
    need = n - filled
    rate = max(succeeded, 1) / max(tried, 1) if tried else 0.05
    m = int(min(max(need / rate * 1.2, 64), _BATCH[s.resolution]))
    trial, o, term = _two_snakes(rng, s, t, m)
    tried, succeeded = tried + m, succeeded + len(o)
    g = slice(0, min(need, len(o)))
    dst = slice(filled, filled + min(need, len(o)))
    c.img[dst], c.msk[dst], c.dil[dst] = trial.img[g], trial.msk[g], trial.dil[g]
    origin[dst], terminal[dst] = o[g], term[g]
    filled += min(need, len(o))
  return c, origin, terminal


def _chunk(rng, s: Settings, t: _Tables, n: int):
  r = s.resolution
  labels = rng.integers(0, 2, n)
  c, origin, terminal = _targets(rng, s, t, n)
  G = c.G
  num_distractors = np.zeros(n, np.int16)
  for _ in range(s.num_distractor_snakes):
    todo = np.arange(n)
    for _ in range(s.max_distractor_contour_retrial + 1):
      if not len(todo):
        break
      ok = _distractor(rng, s, t, c, todo)
      num_distractors[todo[ok]] += 1
      todo = todo[~ok]
  start = rng.integers(0, 2, n)
  end = np.where(labels == 1, start, 1 - start)
  ar = np.arange(n)
  oy, ox = origin[ar, start, 0], origin[ar, start, 1]
  ey, ex = terminal[ar, end, 0], terminal[ar, end, 1]
  marked = np.maximum(c.img[:, G : G + r, G : G + r], _markers(s, oy, ox))
  marked = np.maximum(marked, _markers(s, ey, ex))
  return _bytescale(marked), labels.astype(np.uint8), num_distractors


def _chunk_job(job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One chunk from (settings, seed entropy, spawn key, size): a process pool's unit."""
  s, entropy, key, n = job
  rng = np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=key))
  return _chunk(rng, s, _tables(s), n)


def _bytescale(x: np.ndarray) -> np.ndarray:
  """``scipy.misc.bytescale`` per image: min -> 0, max -> 255, rounded."""
  lo = x.min((1, 2), keepdims=True).astype(np.float64)
  hi = x.max((1, 2), keepdims=True).astype(np.float64)
  scale = 255.0 / np.where(hi > lo, hi - lo, 1.0)
  return (np.clip((x - lo) * scale, 0, 255) + 0.5).astype(np.uint8)


def generate(
    num_examples: int,
    *,
    resolution: int = 32,
    difficulty: str = "hard",
    seed: int | np.random.SeedSequence = 0,
    setting: Settings | None = None,
    num_workers: int = 1,
) -> dict[str, np.ndarray]:
  """``num_examples`` Pathfinder images: ``images`` uint8 ``[n, r, r]``, ``labels`` uint8
  ``[n]`` (1: the markers are joined by one path), ``num_distractors`` int16 ``[n]``.

  ``setting`` (``Settings``, e.g. ``dataclasses.replace(settings(32, "hard"),
  contour_length=9)``) overrides ``resolution`` / ``difficulty``. Images come in chunks of
  ``CHUNK``, chunk k drawn from the k-th child of ``SeedSequence(seed)``: the same arguments
  give the same arrays, whatever ``num_workers`` (processes drawing chunks side by side;
  started with "spawn", so a caller that holds threads, as JAX does, is safe).
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
    raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}.")
  if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)):
    raise ValueError(f"num_examples must be an integer >= 0, got {num_examples!r}.")
  if num_examples < 0:
    raise ValueError(f"num_examples must be an integer >= 0, got {num_examples!r}.")
  if isinstance(seed, np.random.SeedSequence):
    root = seed
  elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed must be an integer >= 0 or a SeedSequence, got {seed!r}.")
  else:
    root = np.random.SeedSequence(int(seed))
  s = setting if setting is not None else settings(resolution, difficulty)
  r = s.resolution
  jobs = [
      (s, root.entropy, (*root.spawn_key, k), min(CHUNK, num_examples - start))
      for k, start in enumerate(range(0, num_examples, CHUNK))
  ]
  parts = [(np.zeros((0, r, r), np.uint8), np.zeros(0, np.uint8), np.zeros(0, np.int16))]
  if num_workers > 1 and len(jobs) > 1:
    ctx = multiprocessing.get_context("spawn")
    workers = min(num_workers, len(jobs))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
      parts += list(pool.map(_chunk_job, jobs))
  else:
    parts += [_chunk_job(job) for job in jobs]
  return {
      "images": np.concatenate([p[0] for p in parts]),
      "labels": np.concatenate([p[1] for p in parts]),
      "num_distractors": np.concatenate([p[2] for p in parts]),
  }


# --------------------------------------------------------------------------- the task
def _cache_path(cache_dir: str, key: dict) -> str:
  name = (
      f"{TASK}_v{key['version']}_{key['resolution']}_{key['difficulty']}_{key['split']}_"
      f"n{key['num_examples']}_seed{key['seed']}.npz"
  )
  return os.path.join(cache_dir, name)


def load_split(
    split: str,
    *,
    num_examples: int,
    resolution: int = 32,
    difficulty: str = "hard",
    seed: int = 0,
    cache_dir: str | None = None,
    num_workers: int = 1,
) -> dict[str, np.ndarray]:
  """One generated split as ``pathfinder.examples`` gives it (``inputs`` int32 ``[n, r*r]``
  = intensity + 1, ``mask``, ``targets``), drawn from ``base.split_seed(seed, split)`` (the
  splits' streams are independent). Generated once, then read from ``cache_dir`` (default
  ``paths.cache_dir("pathfinder_generated")``), an .npz named by every argument."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
  settings(resolution, difficulty)  # checks both before any work
  key = {
      "version": GENERATOR_VERSION,
      "resolution": int(resolution),
      "difficulty": difficulty,
      "split": split,
      "num_examples": int(num_examples),
      "seed": int(seed),
  }
  path = _cache_path(os.fspath(cache_dir) if cache_dir else paths.cache_dir(TASK), key)
  want = json.dumps(key, sort_keys=True)
  if os.path.exists(path):
    try:
      with np.load(path, allow_pickle=False) as z:
        stored = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as e:
      raise ValueError(f"{TASK} cache file {path!r} is unreadable ({e}); delete it.") from None
    if str(stored.get("key")) != want or stored["images"].shape != (
        num_examples,
        resolution,
        resolution,
    ):
      raise ValueError(f"{TASK} cache file {path!r} holds other data; delete it to rebuild.")
  else:
    stored = generate(
        num_examples,
        resolution=resolution,
        difficulty=difficulty,
        seed=base.split_seed(int(seed), split),
        num_workers=num_workers,
    )
    paths.save_npz_atomic(path, {**stored, "key": np.array(want)})
    logging.info("%s %s: generated %d images into %s", TASK, split, num_examples, path)
  return pathfinder.examples(stored["images"], stored["labels"])


class GeneratedPathfinderTask(base.Task):
  """Pathfinder from the project's generator (LRA's settings), no download: the examples
  and ``TaskInfo`` of ``pathfinder`` (tokens = intensity + 1, grid (r, r))."""

  task_name = TASK
  config_fields = {
      # LRA's settings: 32 (LRA Pathfinder) or 64.
      "resolution": fields.Field("int", default=32, choices=RESOLUTIONS),
      # Target path of 6 ("easy", LRA's curv_baseline), 9 ("intermediate",
      # curv_contour_length_9) or 14 paddles ("hard", curv_contour_length_14, LRA's choice).
      "difficulty": fields.string("hard", CONTOUR_LENGTHS),
      "num_train": fields.integer(20_000, 1),  # images per split (LRA: 160k / 20k / 20k)
      "num_validation": fields.integer(2000, 1),
      "num_test": fields.integer(2000, 1),
      "seed": fields.seed(),  # data seed (independent of the training seed); splits never share
      "cache_dir": fields.path(trajectory=False),  # generated splits ("" = paths.cache_dir)
      # Processes generating a split (first use only; the images do not depend on it).
      "num_workers": fields.integer(2, 1, trajectory=False),
  }
  generated = True

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    settings(cfg.resolution, cfg.difficulty)
    return pathfinder.task_info(cfg.resolution)

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    return load_split(
        split,
        num_examples=n,
        resolution=cfg.resolution,
        difficulty=cfg.difficulty,
        seed=cfg.seed,
        cache_dir=cfg.cache_dir or None,
        num_workers=cfg.num_workers,
    )
