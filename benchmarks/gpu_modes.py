"""The GPU check's parts on linear attention by algorithm (``benchmarks.gpu`` runs them).

Three parts, each measured side by side in one process (``benchmarks.measure``: compiled
once, a warm-up, then interleaved runs; medians):

  modes       causal linear attention fwd+bwd by each ``mode`` (``recurrent``, ``chunk``,
              ``fused``) beside the bidirectional op, the bandwidth floor (a copy of the bytes
              the fwd+bwd must touch: read phi_q, phi_k, v and the output's cotangent, write the
              three gradients) and softmax attention, causal (``jax.nn.dot_product_attention``,
              cuDNN on a GPU in bf16, XLA otherwise), at each N, batch, float32 and bf16 (bf16
              activations; the op keeps float32 states and sums);
  layer       one causal attention layer (width 512, 8 heads): ELU+1 + FastRPB through the op's
              ``auto`` mode against cuDNN causal softmax attention (same projections), bf16;
  lm_step     a decoder-LM train step (2 layers x 512, 8 heads): ELU+1 + FastRPB against softmax,
              tokens/s at N = 4K-32K, batch 1.

Each part returns a JSON-able dict; ``goals`` read the measured rows (PASS / FAIL with the
figure), ``markdown`` renders them. The shapes of the rows follow ``benchmarks.gpu``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from benchmarks import measure as bm
from benchmarks.models import pseudo_params
from fastpos.models import TaskInfo, build_model, model_config
from fastpos.ops import attention as ops_attention

HEADS, DIM = 8, 64  # heads; feature size m = value size d = 64
CAUSAL_MODES = ("recurrent", "chunk", "fused")
FLOOR = "copy (bandwidth floor)"
BIDIRECTIONAL = "bidirectional"
SOFTMAX = "softmax causal"


@dataclasses.dataclass(frozen=True)
class ModeSizes:
  lengths: tuple[int, ...]
  batches: tuple[int, ...]
  dtypes: tuple[str, ...]
  layer_lengths: tuple[int, ...]
  lm_lengths: tuple[int, ...]
  lm_width: int
  rounds: int


FULL = ModeSizes(
    lengths=(1024, 4096, 16384, 65536),
    batches=(1, 8),
    dtypes=("float32", "bfloat16"),
    layer_lengths=(1024, 4096, 16384, 32768),
    lm_lengths=(4096, 16384, 32768),
    lm_width=512,
    rounds=5,
)
SMOKE = ModeSizes(
    lengths=(64, 128),
    batches=(1, 2),
    dtypes=("float32", "bfloat16"),
    layer_lengths=(64,),
    lm_lengths=(64,),
    lm_width=32,
    rounds=1,
)


def _platform() -> str:
  return jax.devices()[0].platform


def _positive(seed: int, shape, dtype):
  """Features as an ELU+1 map gives them: positive, about 1."""
  return (jnp.abs(bm.pseudo_normal(seed, shape)) + 0.1).astype(dtype)


def _grads(fn):
  """``(phi_q, phi_k, v, ct) -> (dphi_q, dphi_k, dv)``: the fwd+bwd of ``fn``."""

  def g(q, k, v, ct):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  return g


def _floor(q, k, v, ct):
  """Reads what the fwd+bwd reads and writes what it writes, and nothing more."""
  two = jnp.asarray(2, q.dtype)
  return q * two, k * two, v * two + ct.astype(v.dtype)


def _softmax_causal(q, k, v):
  cudnn = _platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
  return jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn" if cudnn else None
  )


def mode_cases(n: int, batch: int, dtype: str, memory_limit: float) -> list[bm.Case]:
  """The rows of one (N, batch, dtype) group, inputs ``[batch, N, 8, 64]`` token-major."""
  dt = jnp.dtype(dtype)
  shape = (batch, n, HEADS, DIM)

  def make():
    return (
        _positive(1, shape, dt),
        _positive(2, shape, dt),
        bm.pseudo_normal(3, shape, dt),
        bm.pseudo_normal(4, shape),
    )

  cases = []
  for mode in CAUSAL_MODES:
    op = lambda q, k, v, mode=mode: ops_attention.linear_attention(q, k, v, causal=True, mode=mode)
    cases.append(bm.Case(f"causal {mode}", _grads(op), make))
  cases.append(
      bm.Case(BIDIRECTIONAL, _grads(lambda q, k, v: ops_attention.linear_attention(q, k, v)), make)
  )
  cases.append(bm.Case(FLOOR, _floor, make))
  # XLA's softmax holds [batch, heads, N, N] logits; cuDNN's flash kernel does not.
  logits_bytes = 4.0 * batch * HEADS * n * n
  cudnn = _platform() == "gpu" and dt in (jnp.bfloat16, jnp.float16)
  too_big = None if cudnn or logits_bytes < memory_limit / 4 else "skipped: [N, N] logits"
  cases.append(bm.Case(SOFTMAX, _grads(_softmax_causal), make, skip=too_big))
  return cases


def _memory_limit() -> float:
  stats = bm.device_memory_stats()
  return 0.8 * stats["bytes_limit"] if stats and "bytes_limit" in stats else 16e9


def _try_group(cases, rounds: int, limits: bm.Limits) -> dict:
  """Measures ``cases``; a case whose compile fails (e.g. a mode that this backend or shape
  does not build) is reported with its one-line reason, and the others still run."""
  ok = []
  skipped = {}
  for c in cases:
    if c.skip:
      skipped[c.key] = c.skip
      continue
    try:
      jax.jit(c.fn).lower(*jax.eval_shape(c.make_inputs))
      ok.append(c)
    except Exception as e:  # a mode refusing this cell: named in the table, others run
      skipped[c.key] = "not built: " + (str(e).strip().splitlines() or [type(e).__name__])[0]
  got = bm.measure_group(ok, limits=limits, min_time_s=0.0, min_runs=rounds, max_runs=rounds)
  rows = {k: {"skipped": v} for k, v in skipped.items()}
  for k, r in got.items():
    rows[k] = {"ms": None if r.time_s is None else 1e3 * r.time_s, "skipped": r.skipped}
  return rows


def run_modes(sizes: ModeSizes, deadline, log) -> dict:
  """Part ``modes``: rows[dtype][batch][N] -> row key -> {"ms", "skipped"}."""
  limit = _memory_limit()
  out = {"rows": {}, "errors": {}}
  for dtype in sizes.dtypes:
    for b in sizes.batches:
      for n in sizes.lengths:
        where = f"{dtype} batch {b} N={n}"
        if deadline.left() <= 0:
          out["errors"][where] = "skipped: time budget"
          continue
        try:
          rows = _try_group(
              mode_cases(n, b, dtype, limit), sizes.rounds, bm.Limits(max_memory_bytes=limit)
          )
        except Exception as e:  # one shape failing (e.g. out of memory) keeps the others
          out["errors"][where] = _one_line(e)
          log(f"  {where}: FAILED {out['errors'][where]}")
          continue
        out["rows"].setdefault(dtype, {}).setdefault(str(b), {})[str(n)] = rows
        log(f"  {where}: " + ", ".join(f"{k} {_ms(r)}" for k, r in rows.items()))
  return out


def _ms(r: dict) -> str:
  return f"{r['ms']:.3f} ms" if r.get("ms") is not None else (r.get("skipped") or "-")


def _best_causal(rows: dict) -> tuple[str, float] | None:
  got = [(m, rows[f"causal {m}"]["ms"]) for m in CAUSAL_MODES if rows.get(f"causal {m}", {})]
  got = [(m, t) for m, t in got if t is not None]
  return min(got, key=lambda x: x[1]) if got else None


def _ratio(a, b) -> float | None:
  return None if a is None or b is None or b <= 0 else a / b


def modes_goals(part: dict) -> list[dict]:
  """causal <= 1.5x bidirectional at N = 4K-64K (batch 1 and 8); bidirectional and causal
  within 2x the copy floor at N >= 16K, batch 8. Read from the float32 rows (bf16 is shown)."""
  rows = part.get("rows", {}).get("float32", {})
  ratios, floor_ratios = [], []
  for b, by_n in rows.items():
    for n, r in by_n.items():
      best = _best_causal(r)
      bi = r.get(BIDIRECTIONAL, {}).get("ms")
      if best and int(n) >= 4096:
        ratios.append((int(b), int(n), best[0], _ratio(best[1], bi)))
      fl = r.get(FLOOR, {}).get("ms")
      if best and int(n) >= 16384 and int(b) == 8:
        floor_ratios.append((int(n), _ratio(bi, fl), _ratio(best[1], fl)))
  goals = []
  if ratios:
    worst = max(ratios, key=lambda x: x[3] or float("inf"))
    ok = all(x[3] is not None and x[3] <= 1.5 for x in ratios)
    goals.append(
        _goal(
            "causal linear attention fwd+bwd <= 1.5x bidirectional at N = 4K-64K, batch 1 and 8",
            f"worst {worst[3]:.2f}x (batch {worst[0]}, N={worst[1]}, mode {worst[2]})"
            if worst[3] is not None
            else "not measured",
            ok,
        )
    )
  if floor_ratios:
    worst = max(max(x[1] or float("inf"), x[2] or float("inf")) for x in floor_ratios)
    text = "; ".join(
        f"N={n}: bidirectional {bi:.2f}x, causal {ca:.2f}x"
        for n, bi, ca in floor_ratios
        if bi is not None and ca is not None
    )
    goals.append(
        _goal(
            "bidirectional and causal within 2x of the bandwidth floor at N >= 16K, batch 8",
            text or "not measured",
            worst <= 2.0,
        )
    )
  return goals


def _modes_md(part: dict) -> list[str]:
  keys = [f"causal {m}" for m in CAUSAL_MODES] + [BIDIRECTIONAL, FLOOR, SOFTMAX]
  lines = [
      "| dtype | batch | N | " + " | ".join(keys) + " | best causal / bidirectional |",
      "|---|---:|---:|" + "---:|" * (len(keys) + 1),
  ]
  for dtype, by_b in part.get("rows", {}).items():
    for b, by_n in sorted(by_b.items(), key=lambda x: int(x[0])):
      for n, r in sorted(by_n.items(), key=lambda x: int(x[0])):
        cells = [_ms(r.get(k, {})) for k in keys]
        best = _best_causal(r)
        ratio = _ratio(best[1], r.get(BIDIRECTIONAL, {}).get("ms")) if best else None
        ratio_text = f"{ratio:.2f}x ({best[0]})" if ratio is not None else "-"
        lines.append(f"| {dtype} | {b} | {n} | " + " | ".join(cells) + f" | {ratio_text} |")
  return lines


# ---------------------------------------------------------------------------------------------
# Part "layer": the causal ELU+1 + FastRPB layer against cuDNN causal softmax, bf16
# ---------------------------------------------------------------------------------------------
def _attention_model(kernel: str, scheme: str, n: int, width: int, layers: int):
  c = model_config()
  c.kernel, c.positional = kernel, scheme
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim = layers, width, HEADS, 4 * width
  c.dropout_rate, c.max_length = 0.0, n
  return c


def layer_cases(n: int, dtype: str) -> list[bm.Case]:
  import flax.linen as nn

  from fastpos.api.layers import attention

  dt = jnp.dtype(dtype)
  width = HEADS * DIM
  x_shape = (1, n, width)
  cudnn = _platform() == "gpu" and dt in (jnp.bfloat16, jnp.float16)

  class Softmax(nn.Module):

    @nn.compact
    def __call__(self, x):
      dense = lambda name: nn.DenseGeneral((HEADS, DIM), dtype=dt, name=name)
      q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
      out = jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn" if cudnn else None
      )
      return nn.DenseGeneral(width, axis=(-2, -1), dtype=dt, name="out")(out)

  rows = {
      "ELU+1 + FastRPB causal (auto)": attention(
          width, HEADS, kernel="elu1", positional="fastrpb", causal=True, max_length=n, dtype=dt
      ),
      "softmax causal (cuDNN)" if cudnn else "softmax causal (XLA)": Softmax(),
  }
  cases = []
  for key, layer in rows.items():
    shapes = jax.eval_shape(layer.init, jax.random.key(0), jax.ShapeDtypeStruct(x_shape, dt))

    def fn(params, x, ct, layer=layer):
      loss = lambda p, x: jnp.sum(layer.apply(p, x).astype(jnp.float32) * ct)
      return jax.grad(loss, (0, 1))(params, x)

    def make(shapes=shapes):
      return pseudo_params(shapes), bm.pseudo_normal(1, x_shape, dt), bm.pseudo_normal(2, x_shape)

    cases.append(bm.Case(key, fn, make))
  return cases


def run_layer(sizes: ModeSizes, deadline, log) -> dict:
  out = {"rows": {}, "errors": {}}
  limit = _memory_limit()
  for n in sizes.layer_lengths:
    if deadline.left() <= 0:
      out["errors"][f"N={n}"] = "skipped: time budget"
      continue
    try:
      out["rows"][str(n)] = _try_group(
          layer_cases(n, "bfloat16"), sizes.rounds, bm.Limits(max_memory_bytes=limit)
      )
      log(f"  layer N={n}: " + ", ".join(f"{k} {_ms(r)}" for k, r in out["rows"][str(n)].items()))
    except Exception as e:
      out["errors"][f"N={n}"] = _one_line(e)
  return out


def layer_goals(part: dict) -> list[dict]:
  ratios = []
  for n, r in part.get("rows", {}).items():
    lin = r.get("ELU+1 + FastRPB causal (auto)", {}).get("ms")
    soft = r.get("softmax causal (cuDNN)", {}).get("ms")
    if int(n) >= 4096:
      ratios.append((int(n), _ratio(lin, soft)))
  if not ratios:
    return []
  ok = all(x is not None and x < 1.0 for _, x in ratios)
  text = "; ".join(f"N={n}: {'-' if x is None else f'{x:.2f}x'}" for n, x in sorted(ratios))
  return [
      _goal(
          "causal ELU+1 + FastRPB layer faster than cuDNN causal attention in bf16 from N = 4K",
          text + ("" if any(x is not None for _, x in ratios) else " (no cuDNN row: not a GPU)"),
          ok,
      )
  ]


def _pair_md(part: dict, what: str) -> list[str]:
  keys = sorted({k for r in part.get("rows", {}).values() for k in r})
  lines = ["| N | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
  for n, r in sorted(part.get("rows", {}).items(), key=lambda x: int(x[0])):
    lines.append(f"| {n} | " + " | ".join(_ms(r.get(k, {})) for k in keys) + " |")
  return lines + ["", f"Times are {what}."]


# ---------------------------------------------------------------------------------------------
# Part "lm_step": a decoder-LM train step, ELU+1 + FastRPB against softmax
# ---------------------------------------------------------------------------------------------
LM_ROWS = {"ELU+1 + FastRPB": ("elu1", "fastrpb"), "softmax": ("softmax", "none")}


def lm_case(key: str, n: int, width: int, smoke: bool) -> bm.Case:
  kernel, scheme = LM_ROWS[key]
  cfg = _attention_model(kernel, scheme, n, width, 1 if smoke else 2)
  cfg.num_heads = 2 if smoke else HEADS
  model = build_model(cfg, TaskInfo(kind="lm", vocab_size=257, max_length=n))
  tx = optax.adamw(3e-4)
  example = {"inputs": jax.ShapeDtypeStruct((1, n), jnp.int32)}
  shapes = jax.eval_shape(model.init, jax.random.key(0), example)

  def step(variables, opt_state, ids):
    def loss_fn(v):
      logits = model.apply(v, {"inputs": ids[:, :-1]})
      return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(variables)
    updates, opt_state = tx.update(grads, opt_state, variables)
    return optax.apply_updates(variables, updates), opt_state, loss

  def make():
    variables = pseudo_params(shapes)
    noise = bm.pseudo_normal(3, (1, n + 1))
    ids = jnp.floor((noise / 3**0.5 + 1) * 128).astype(jnp.int32) + 1
    return variables, tx.init(variables), ids

  return bm.Case(key, step, make)


def run_lm_step(sizes: ModeSizes, deadline, log, smoke: bool) -> dict:
  out = {"rows": {}, "errors": {}}
  limit = _memory_limit()
  for n in sizes.lm_lengths:
    if deadline.left() <= 0:
      out["errors"][f"N={n}"] = "skipped: time budget"
      continue
    try:
      cases = [lm_case(k, n, sizes.lm_width, smoke) for k in LM_ROWS]
      rows = _try_group(cases, sizes.rounds, bm.Limits(max_memory_bytes=limit))
      for r in rows.values():
        if r.get("ms"):
          r["tokens_per_s"] = n / (r["ms"] / 1e3)
      out["rows"][str(n)] = rows
      log(f"  lm step N={n}: " + ", ".join(f"{k} {_ms(r)}" for k, r in rows.items()))
    except Exception as e:
      out["errors"][f"N={n}"] = _one_line(e)
  return out


def lm_goals(part: dict) -> list[dict]:
  r = part.get("rows", {}).get("16384")
  if not r:
    return []
  ratio = _ratio(r.get("softmax", {}).get("ms"), r.get("ELU+1 + FastRPB", {}).get("ms"))
  return [
      _goal(
          "decoder-LM step with ELU+1 + FastRPB >= 2x softmax's tokens/s at N = 16K",
          "-" if ratio is None else f"{ratio:.2f}x softmax's tokens/s",
          ratio is not None and ratio >= 2.0,
      )
  ]


def _goal(text: str, measured: str, ok: bool) -> dict:
  return {"goal": text, "measured": measured, "pass": bool(ok)}


def _one_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def layer_md(part: dict) -> list[str]:
  return _pair_md(part, "fwd+bwd ms of one layer (width 512, 8 heads, batch 1), bf16")


def lm_md(part: dict) -> list[str]:
  return _pair_md(part, "ms per train step (2 layers x 512, batch 1, float32, AdamW)")


modes_md = _modes_md
