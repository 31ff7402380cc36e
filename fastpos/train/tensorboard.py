"""TensorBoard scalar event files written without TensorFlow.

An event file is a TFRecord stream of ``Event`` protocol buffers. Only scalars are needed, so
the three messages are encoded by hand (field numbers from TensorFlow's event.proto and
summary.proto):

  Event    { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
  Summary  { repeated Value value = 1; }
  Value    { string tag = 1; float simple_value = 2; }

Each record is framed as ``uint64 length, uint32 masked_crc32c(length), data,
uint32 masked_crc32c(data)`` (little endian), with CRC-32C (Castagnoli) masked as in TFRecord.
``read_scalars`` parses the files back (and checks every CRC) for tests and scripts.

A workdir has one event file: a resumed run appends to the newest one, after dropping the
events past the step it resumes from (so TensorBoard shows each step once).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

_CRC_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
  _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), as TFRecord uses; crc32c(b"123456789") == 0xE3069283."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement)
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None,
           scalars: dict[str, float] | None = None) -> bytes:
  out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
  if file_version is not None:
    out += _field_bytes(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) +
                     struct.pack("<f", float(value)))
        for tag, value in scalars.items())
    out += _field_bytes(5, summary)
  return out


def _record(data: bytes) -> bytes:
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data +
          struct.pack("<I", masked_crc32c(data)))


def _records(data: bytes) -> list[tuple[bytes, bytes]]:
  """(raw record, payload) of every complete record; stops at a torn or damaged one."""
  out, pos = [], 0
  while pos + 12 <= len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    end = pos + 16 + length
    if crc != masked_crc32c(header) or end > len(data):
      break
    payload = data[pos + 12:pos + 12 + length]
    (crc,) = struct.unpack("<I", data[pos + 12 + length:end])
    if crc != masked_crc32c(payload):
      break
    out.append((data[pos:end], payload))
    pos = end
  return out


def _event_step(payload: bytes) -> int:
  for number, value in _fields(payload):
    if number == 2:
      return value
  return 0


class EventWriter:
  """Appends scalar summaries to the ``events.out.tfevents.*`` file of ``logdir``.

  A new file is started when there is none; with ``resume_step`` set, the newest existing file
  is kept without its events past that step (rewritten to a temporary file renamed over it,
  which also drops a record cut off by a crash) and appended to.
  """

  def __init__(self, logdir: str | os.PathLike, resume_step: int | None = None):
    Path(logdir).mkdir(parents=True, exist_ok=True)
    existing = sorted(Path(logdir).glob("events.out.tfevents.*"),
                      key=lambda p: (p.stat().st_mtime, p.name))
    existing = [p for p in existing if not p.name.endswith(".tmp")]
    if resume_step is not None and existing:
      self.path = existing[-1]
      data = self.path.read_bytes()
      records = _records(data)
      kept = b"".join(raw for raw, payload in records if _event_step(payload) <= resume_step)
      if len(kept) != len(data):
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(kept)
        tmp.replace(self.path)
      self._file = open(self.path, "ab")
      return
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self.path = Path(logdir) / name
    self._file = open(self.path, "ab")
    self._file.write(_record(_event(time.time(), 0, file_version="brain.Event:2")))
    self._file.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self._file.write(_record(_event(time.time(), step, scalars=values)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  shift = value = 0
  while True:
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return value, pos


def _fields(buf: bytes):
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _read_varint(buf, pos)
    elif wire == 1:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == 5:
      value, pos = buf[pos:pos + 4], pos + 4
    elif wire == 2:
      size, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + size], pos + size
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    yield number, value


def read_scalars(path: str | os.PathLike) -> list[tuple[int, str, float]]:
  """(step, tag, value) for every scalar in an event file, checking each record's CRCs."""
  data = Path(path).read_bytes()
  out, pos = [], 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    if crc != masked_crc32c(header):
      raise ValueError(f"{path}: bad length CRC at byte {pos}")
    payload = data[pos + 12:pos + 12 + length]
    (crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
    if crc != masked_crc32c(payload):
      raise ValueError(f"{path}: bad data CRC at byte {pos}")
    pos += 16 + length
    step = 0
    for number, value in _fields(payload):
      if number == 2:
        step = value
      elif number == 5:
        for _, v in _fields(value):
          tag, simple = "", None
          for n2, v2 in _fields(v):
            if n2 == 1:
              tag = v2.decode()
            elif n2 == 2:
              (simple,) = struct.unpack("<f", v2)
          out.append((step, tag, simple))
  return out
