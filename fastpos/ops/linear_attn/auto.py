"""``mode="auto"``: which causal linear-attention algorithm runs on which backend.

One entry per ``jax.default_backend()`` ("cpu", "gpu", "tpu"): the mode, and where the choice
comes from (the benchmark, the machine, the date). ``python -m benchmarks modes`` measures
recurrent against chunk fwd+bwd side by side and rewrites its backend's entry below (the
block between the markers), with the table it wrote (benchmarks/modes_<backend>.md).
A backend not listed runs "chunk" (no serial loop).
"""

from __future__ import annotations

import jax

# BEGIN TABLE (rewritten by benchmarks.modes)
TABLE = {
    "cpu": {
        "mode": "recurrent",
        "source": (
            "benchmarks.modes on x86_64, 2 cores, cpu, 2026-11-28 20:30 UTC: chunk / "
            "recurrent fwd+bwd 1.24x, 2.34x, 1.82x, 2.56x, 3.17x at N = 1024, 2048, 4096, "
            "8192, 16384 (benchmarks/modes_cpu.md)"
        ),
    },
    "gpu": {
        "mode": "chunk",
        "source": (
            "not measured; chosen because the serial scan measured 6.5-23x bidirectional on "
            "an H200 (benchmarks/gpu/summary.md)"
        ),
    },
    "tpu": {
        "mode": "chunk",
        "source": (
            "not measured; chosen because the serial scan measured 6.5-23x bidirectional on "
            "an H200 (benchmarks/gpu/summary.md)"
        ),
    },
}
# END TABLE

DEFAULT = "chunk"


def pick(backend: str | None = None) -> str:
  """The mode "auto" runs on ``backend`` (``jax.default_backend()`` when None): "chunk" or
  "recurrent"."""
  backend = jax.default_backend() if backend is None else backend
  return TABLE.get(backend, {"mode": DEFAULT})["mode"]
