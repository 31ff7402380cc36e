"""Modes ``layer`` and ``train_step`` of ``python -m benchmarks speed``: the attention layer
and the full LRA Text train step, built from ``fastpos.models`` as a config would build them.

layer: ``fastpos.models.Attention`` with 8 heads of dim 64 (width 512), batch 1, timed
forward+backward (``grad`` of ``sum(layer(x) * cotangent)`` w.r.t. the parameters and x):
  * a sweep over N of the headline cells (softmax through ``jax.nn.dot_product_attention``,
    softmax as the plain XLA formula, softmax by cuDNN (GPU, bf16), ELU+1, ELU+1 + FastRPB,
    NPRF + kernelized RPE);
  * every compatible kernel x scheme cell (1D, bidirectional; ``--cells``) at one length,
    with its memory compiled at two lengths for the exponent of memory in N.
train_step: the LRA Text model (4 layers, width 256, 4 heads of dim 64, MLP 1024, dropout
0.1; LRA's text setting, as configs/lra_text_fastrpb.py) at the task's length 4000: one jitted
step = value_and_grad of the cross-entropy + clip + AdamW update, on random tokens. Rows are
models, each with its steps/s and memory against the softmax Transformer (PermuteFormer
Table 2's layout).

Parameters are filled with ``pseudo_normal`` noise (std 0.02) rather than each model's
initialiser: timing does not depend on their values, and compiling random initialisers per
cell costs more than the measurements on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from benchmarks import measure as bm
from benchmarks.ops import exponent_lengths
from fastpos import positional
from fastpos.models import (
    Attention,
    AttentionConfig,
    KernelSpec,
    PositionalSpec,
    TaskInfo,
    build_model,
    model_config,
)
from fastpos.positional import compatibility

HEADS, DIM = 8, 64


def pseudo_params(shapes, seed: int = 7, scale: float = 0.02):
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  return jax.tree_util.tree_unflatten(
      treedef, [bm.pseudo_normal(seed + i, s.shape, s.dtype, scale) for i, s in enumerate(leaves)]
  )


# ---------------------------------------------------------------------------------------------
# The attention layer
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cell:
  kernel: str
  scheme: str  # "none" for no positional scheme
  reference: bool = False  # dense references (softmax: the plain XLA formula)
  cudnn: bool = False  # softmax by jax.nn.dot_product_attention(implementation="cudnn")

  @property
  def label(self) -> str:
    if self.cudnn:
      return "softmax (cuDNN)"
    if self.kernel == "softmax" and self.scheme == "none":
      return "softmax (XLA dense)" if self.reference else "softmax (jax.nn.dot_product_attention)"
    return f"{self.kernel} + {self.scheme}" + (" (dense reference)" if self.reference else "")

  @property
  def linear(self) -> bool:
    return self.kernel != "softmax" and not self.reference


SOFTMAX_DPA, SOFTMAX_XLA, SOFTMAX_CUDNN = (
    Cell("softmax", "none"),
    Cell("softmax", "none", reference=True),
    Cell("softmax", "none", cudnn=True),
)
ELU, ELU_RPB, KRPE = Cell("elu1", "none"), Cell("elu1", "fastrpb"), Cell("nprf", "kernelized_rpe")
SWEEP = (SOFTMAX_DPA, SOFTMAX_XLA, SOFTMAX_CUDNN, ELU, ELU_RPB, KRPE)

# The sweep rows the targets are read from, by length (they run under target_run_s).
SWEEP_TARGETS = {
    4096: (SOFTMAX_DPA, SOFTMAX_XLA, ELU, ELU_RPB, KRPE),
    16384: (SOFTMAX_CUDNN, ELU_RPB),
}


class CudnnSoftmax(nn.Module):
  """The softmax layer of ``fastpos.models.Attention`` (same projections) with its softmax
  by ``jax.nn.dot_product_attention(implementation="cudnn")``: jax 0.10's default
  implementation (None) is the XLA one on every platform, so the layer never reaches cuDNN
  by itself. Needs a GPU and bf16 / fp16."""

  dtype: jnp.dtype = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    dense = lambda name: nn.DenseGeneral((HEADS, DIM), dtype=self.dtype, name=name)
    q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
    out = jax.nn.dot_product_attention(q, k, v, scale=DIM**-0.5, implementation="cudnn")
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), dtype=self.dtype, name="out")(out)


def layer_case(
    key: str,
    cell: Cell,
    n: int,
    args,
    *,
    skip_time: str | None = None,
    max_run_s: float | None = None,
) -> bm.Case:
  dtype = jnp.dtype(args.dtype)
  x_shape = (1, n, HEADS * DIM)
  if cell.cudnn:
    layer = CudnnSoftmax(dtype=dtype)
    apply = lambda p, x: layer.apply(p, x)
    if args.platform != "gpu" or dtype not in (jnp.bfloat16, jnp.float16):
      return bm.Case(
          key,
          None,
          None,
          skip=f"cuDNN attention needs a GPU and bf16/fp16 "
          f"(this run: {args.platform}, {args.dtype})",
      )
  else:
    spec = KernelSpec(cell.kernel, num_features=args.num_features)
    schemes = () if cell.scheme == "none" else (PositionalSpec.make(cell.scheme),)
    cfg = AttentionConfig(
        num_heads=HEADS,
        head_dim=DIM,
        embed_dim=HEADS * DIM,
        kernel=spec,
        positional=schemes,
        max_length=n,
    )
    layer = Attention(cfg, dtype=dtype)
    apply = lambda p, x: layer.apply(p, x, reference=cell.reference)
  shapes = jax.eval_shape(layer.init, jax.random.key(0), jax.ShapeDtypeStruct(x_shape, dtype))

  def fn(params, x, ct):
    def loss(p, x):
      return jnp.sum(apply(p, x).astype(jnp.float32) * ct)

    return jax.grad(loss, (0, 1))(params, x)

  def make():
    return (
        pseudo_params(shapes),
        bm.pseudo_normal(1, x_shape, dtype),
        bm.pseudo_normal(2, x_shape),
    )

  return bm.Case(key, fn, make, skip_time=skip_time, max_run_s=max_run_s)


def all_cells(selection: str) -> tuple[list[Cell], list[str]]:
  """The cells of the layer table (1D, bidirectional) and notes on what is left out.

  ``selection``: "all" (every compatible pair), "each" (every kernel with "none" and every
  scheme with softmax and ELU+1: each kernel and each scheme at least once) or
  "kernel:scheme,..."."""
  notes = []
  embed_only = [
      s for s, cls in positional.SCHEMES.items() if set(cls.hooks) <= {"embed"} and s != "none"
  ]
  if embed_only:
    notes.append(
        f"Embedding-only schemes ({', '.join(embed_only)}) act before the layer: "
        "the layer with them is the layer with 'none'."
    )
  cells = [
      Cell(k, s)
      for s in positional.SCHEMES
      if s not in embed_only
      for k in compatibility.KERNELS
      if compatibility.problem(k, s, causal=False, two_d=False) is None
  ]
  if selection == "each":
    chosen = [c for c in cells if c.scheme == "none" or c.kernel in ("softmax", "elu1")]
    notes.append(
        f"{len(chosen)} of the {len(cells)} compatible cells: every kernel with "
        "'none', every scheme with softmax and ELU+1 (`--cells all` runs all)."
    )
    return chosen, notes
  if selection != "all":
    wanted = [tuple(c.split(":")) for c in selection.split(",")]
    bad = [w for w in wanted if len(w) != 2 or Cell(*w) not in cells]
    if bad:
      raise ValueError(
          f"--cells: {bad} are not compatible 1D bidirectional cells; valid: "
          f"'all', 'each' or kernel:scheme from "
          f"{', '.join(f'{c.kernel}:{c.scheme}' for c in cells)}."
      )
    cells = [Cell(*w) for w in wanted]
  return cells, notes


def run_layer(args, log) -> tuple[list[bm.Table], list[bm.Target]]:
  history: dict = {}
  sweep: dict[Cell, dict[int, bm.Result]] = {c: {} for c in SWEEP}
  for n in args.layer_lengths:
    cases = [
        layer_case(
            f"sweep/{c.label}",
            c,
            n,
            args,
            max_run_s=args.limits.target_run_s if c in SWEEP_TARGETS.get(n, ()) else None,
        )
        for c in SWEEP
    ]
    got = bm.measure_group(
        cases, history=history, limits=args.limits, min_time_s=args.min_time, max_runs=args.repeats
    )
    for c in SWEEP:
      sweep[c][n] = got[f"sweep/{c.label}"]
    log(
        f"layer sweep N={n}: "
        + ", ".join(f"{c.label}={bm.fmt_ms(sweep[c][n].time_s)}" for c in SWEEP)
    )

  cells, cell_notes = all_cells(args.cells)
  n0 = args.cell_length
  mem_lengths = [m for m in args.cell_memory if m != n0]
  per_cell: dict[Cell, dict[int, bm.Result]] = {}
  order = [SOFTMAX_DPA] + [c for c in cells if c != SOFTMAX_DPA]  # the ratios' baseline first
  for i, c in enumerate(order):
    cases = [layer_case("cell", c, n0, args)]
    cases += [layer_case(f"mem{m}", c, m, args, skip_time="memory only") for m in mem_lengths]
    got = bm.measure_group(
        cases, limits=args.limits, min_time_s=args.min_time, max_runs=args.repeats
    )
    per_cell[c] = {n0: got["cell"]} | {m: got[f"mem{m}"] for m in mem_lengths}
    log(f"cell {i + 1}/{len(order)} {c.label}: {bm.fmt_ms(got['cell'].time_s)} ms")
  tables = [_sweep_table(sweep, args), _cells_table(per_cell, cells, cell_notes, args)]
  return tables, _layer_targets(sweep, per_cell, args)


def _sweep_table(sweep, args) -> bm.Table:
  notes = bm.Footnotes()
  lengths = list(args.layer_lengths)
  base = sweep[SOFTMAX_DPA]
  rows, data = [], {}
  t_series, m_series = {}, {}
  for c in SWEEP:
    res = sweep[c]
    data[c.label] = {n: res[n].as_dict() for n in lengths}
    rows.append([c.label, "ms"] + [notes.time(res[n]) for n in lengths])
    rows.append(["", "x softmax"] + [_ratio_text(res[n], base[n]) for n in lengths])
    rows.append(["", "memory"] + [notes.memory(res[n]) for n in lengths])
    if any(res[n].device_peak_bytes for n in lengths):
      rows.append(["", "device peak"] + [_peak_text(res[n]) for n in lengths])
    t_series[c.label] = [(n, res[n].time_s * 1e3) for n in lengths if res[n].time_s]
    m_series[c.label] = [(n, res[n].memory_bytes / 2**20) for n in lengths if res[n].memory_bytes]
  fit_n = exponent_lengths(lengths)
  exps = [
      f"{c.label} {e:.2f}"
      for c in SWEEP
      for e in [bm.fit_exponent(fit_n, [sweep[c][n].memory_bytes for n in fit_n])]
      if e is not None
  ]
  header = ["cell", ""] + [f"N={n}" for n in lengths]
  note_lines = [
      f"Attention layer, batch 1, {HEADS} heads x {DIM}, {args.dtype}, forward+backward "
      f"(grads of parameters and x); random maps m = {args.num_features}. Lower bound: the "
      "dense reference, here softmax as the XLA formula (materialised [1, 8, N, N] scores); "
      "'x softmax' is time over the layer's own softmax, jax.nn.dot_product_attention with "
      "its default implementation (XLA on every platform in jax 0.10; the cuDNN row forces "
      "implementation='cudnn', GPU and bf16 only). Memory: compiled temp + argument + "
      "output"
      + (
          ", device peak: allocator high-water mark ('<=': bound only)"
          if args.platform != "cpu"
          else ""
      )
      + ".",
      f"Memory exponent over N = {', '.join(map(str, fit_n))}: " + "; ".join(exps) + ".",
  ]
  return bm.Table(
      "layer_sweep",
      "attention layer against N (forward+backward)",
      header,
      rows,
      note_lines + notes.notes(),
      data,
      [
          bm.Panel("attention layer fwd+bwd", "N", "median ms", t_series),
          bm.Panel("memory (compiled)", "N", "MiB", m_series),
      ],
  )


def _ratio_text(a: bm.Result, b: bm.Result) -> str:
  if a.time_s is None or b.time_s is None:
    return "-"
  return f"{a.time_s / b.time_s:.2f}x"


def _peak_text(r: bm.Result) -> str:
  if r.device_peak_bytes is None:
    return "-"
  return ("<= " if r.device_peak_is_bound else "") + bm.fmt_bytes(r.device_peak_bytes)


def _cells_table(per_cell, cells, cell_notes, args) -> bm.Table:
  notes = bm.Footnotes()
  n0 = args.cell_length
  mem_n = sorted(set(args.cell_memory) | {n0})
  base = per_cell[SOFTMAX_DPA][n0]
  rows, data = [], {}
  for c in cells:
    res = per_cell[c]
    e = bm.fit_exponent(mem_n, [res[n].memory_bytes for n in mem_n])
    data[c.label] = {n: res[n].as_dict() for n in mem_n} | {"memory_exponent": e}
    rows.append(
        [c.kernel, c.scheme, notes.time(res[n0]), _ratio_text(res[n0], base)]
        + [notes.memory(res[n]) for n in mem_n]
        + ["-" if e is None else f"{e:.2f}"]
    )
  header = (
      ["kernel", "scheme", f"ms N={n0}", "x softmax"]
      + [f"mem N={n}" for n in mem_n]
      + ["mem exponent"]
  )
  note_lines = [
      "Every compatible kernel x scheme cell (1D, bidirectional; "
      "`python -m fastpos.positional.compatibility`), "
      f"attention layer forward+backward at N={n0}, batch 1, {HEADS} heads x {DIM}, "
      f"{args.dtype}, random maps m = {args.num_features}; 'x softmax' against softmax "
      f"through jax.nn.dot_product_attention at the same N. Memory compiled at N = "
      f"{', '.join(map(str, mem_n))} (not run where not timed); exponent = slope of log "
      "memory on log N."
  ] + cell_notes
  return bm.Table(
      "layer_cells",
      f"every kernel x scheme cell at N={n0}",
      header,
      rows,
      note_lines + notes.notes(),
      data,
  )


def _layer_targets(sweep, per_cell, args) -> list[bm.Target]:
  out = []
  lengths = list(args.layer_lengths)
  elu, rpb = sweep[ELU], sweep[ELU_RPB]
  text = "FastRPB adds at most 50% to the forward+backward time of the ELU+1 layer at N=4096"
  if 4096 not in lengths or elu[4096].time_s is None or rpb[4096].time_s is None:
    out.append(bm.Target(text, "not measured (N=4096 not in the sweep or skipped)", None))
  else:
    extra = rpb[4096].time_s / elu[4096].time_s - 1
    out.append(
        bm.Target(
            text,
            f"{100 * extra:+.0f}% ({bm.fmt_ms(rpb[4096].time_s)} ms vs "
            f"{bm.fmt_ms(elu[4096].time_s)} ms)",
            extra <= 0.5,
        )
    )

  krpe, dense = sweep[KRPE], sweep[SOFTMAX_XLA]
  text = (
      f"kernelized RPE (NPRF, m={args.num_features}) faster than dense XLA softmax, "
      "forward+backward, from N=4096 up"
  )
  parts, ok, any_measured = [], True, False
  for n in [n for n in lengths if n >= 4096]:
    a, b = krpe[n], dense[n]
    if a.time_s is not None and b.time_s is not None:
      any_measured = True
      ok &= a.time_s < b.time_s
      parts.append(
          f"N={n}: {bm.fmt_ms(a.time_s)} vs {bm.fmt_ms(b.time_s)} ms "
          f"({b.time_s / a.time_s:.2f}x)"
      )
    else:
      pred = ", ".join(
          f"{name} ~{r.predicted_s:.0f} s predicted"
          for name, r in (("kernelized RPE", a), ("softmax", b))
          if r.predicted_s
      )
      parts.append(f"N={n}: not run ({pred or a.skipped or b.skipped})")
  out.append(
      bm.Target(
          text,
          "; ".join(parts) if parts else "no N >= 4096 in the sweep",
          ok if any_measured else None,
      )
  )

  worst = None
  for c, res in list(per_cell.items()) + [(c, sweep[c]) for c in SWEEP]:
    if not c.linear:
      continue
    ns = sorted(n for n in res if 1024 <= n <= 16384 and res[n].memory_bytes)
    e = bm.fit_exponent(ns, [res[n].memory_bytes for n in ns]) if len(ns) >= 2 else None
    if e is not None and (worst is None or e > worst[0]):
      worst = (e, c.label, ns)
  text = "memory of every linear cell grows linearly: fitted exponent over 1K-16K <= 1.1"
  if worst is None or worst[2][0] > 1024 or worst[2][-1] < 16384:
    out.append(bm.Target(text, "not measured (memory lengths do not span 1K-16K)", None))
  else:
    out.append(bm.Target(text, f"worst {worst[0]:.2f} ({worst[1]})", worst[0] <= 1.1))

  text = (
      "GPU: ELU+1 + FastRPB layer faster than jax.nn.dot_product_attention (cuDNN) at "
      "N=16384, forward+backward, bf16"
  )
  soft = sweep[SOFTMAX_CUDNN]
  if args.platform != "gpu" or args.dtype != "bfloat16":
    out.append(
        bm.Target(
            text,
            f"not measured (needs a GPU and --dtype bfloat16; this run: "
            f"{args.platform}, {args.dtype})",
            None,
        )
    )
  elif 16384 not in lengths or rpb[16384].time_s is None or soft[16384].time_s is None:
    why = rpb.get(16384) and (rpb[16384].skipped or soft[16384].skipped)
    out.append(bm.Target(text, f"not measured ({why or 'N=16384 not in the sweep'})", None))
  else:
    a, b = rpb[16384].time_s, soft[16384].time_s
    out.append(bm.Target(text, f"{bm.fmt_ms(a)} ms vs {bm.fmt_ms(b)} ms ({b / a:.2f}x)", a < b))
  return out


# ---------------------------------------------------------------------------------------------
# The train step
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  kernel: str
  positional: str
  core: bool = True  # in the "core" rows (--train-rows core, the CPU default)
  fields: tuple = ()  # further (name, value) config.model fields, e.g. (("remat", "block"),)


def train_models(num_features: int) -> list[Model]:
  """The rows: the softmax Transformer first (the ratios' baseline), then linear models with
  and without FastRPB, Performer, kernelized RPE, PermuteFormer (ReLU features, as its
  paper) and every further registered scheme that acts in the attention layer (with ELU+1,
  or softmax where linear kernels do not fit); the rows up to PermuteFormer are "core"."""
  rows = [
      Model("Transformer (softmax)", "softmax", "absolute"),
      Model("Linear ELU+1", "elu1", "absolute"),
      Model("Linear ELU+1 + FastRPB", "elu1", "absolute,fastrpb"),
      Model("Linear SIKF", "sikf", "absolute"),
      Model("Linear SIKF + FastRPB (configs/lra_text_fastrpb.py)", "sikf", "absolute,fastrpb"),
      Model(f"Performer (FAVOR+, m={num_features})", "favor", "absolute"),
      Model(f"Kernelized RPE (NPRF, m={num_features})", "nprf", "kernelized_rpe"),
  ]
  if "permuteformer" in positional.SCHEMES:
    rows.append(Model("PermuteFormer (ReLU features)", "relu", "permuteformer"))
  rows.append(Model("Transformer + T5 bias", "softmax", "absolute,t5_bias", core=False))
  known = {
      "none",
      "absolute",
      "fastrpb",
      "kernelized_rpe",
      "t5_bias",
      "transformer_xl",
      "permuteformer",
  }
  for s in positional.SCHEMES:
    if s in known or set(positional.SCHEMES[s].hooks) <= {"embed"}:
      continue
    kernel = "elu1" if compatibility.problem("elu1", s) is None else "softmax"
    if compatibility.problem(kernel, s) is None:
      rows.append(
          Model(
              f"{'Linear ELU+1' if kernel == 'elu1' else 'Transformer'} + {s}",
              kernel,
              s,
              core=False,
          )
      )
  return rows


def _model_cfg(m: Model, args) -> ml_collections.ConfigDict:
  cfg = model_config()
  cfg.kernel = m.kernel
  cfg.positional = m.positional
  cfg.kernel_options.num_features = args.num_features
  cfg.dtype = args.dtype
  cfg.update(dict(m.fields))
  if args.smoke:
    cfg.update(num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64)
  return cfg


def train_case(m: Model, args) -> bm.Case:
  length, batch = args.train_length, args.train_batch
  task = TaskInfo("classify", vocab_size=257, num_classes=2, max_length=length)
  model = build_model(_model_cfg(m, args), task)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(5e-4, weight_decay=0.1))
  example = {
      "inputs": jax.ShapeDtypeStruct((batch, length), jnp.int32),
      "mask": jax.ShapeDtypeStruct((batch, length), jnp.bool_),
  }
  shapes = jax.eval_shape(model.init, jax.random.key(0), example)

  def step(variables, opt_state, batch_, rng):
    def loss_fn(v):
      logits = model.apply(v, batch_, train=True, rngs={"dropout": rng})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch_["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(variables)
    updates, opt_state = tx.update(grads, opt_state, variables)
    return optax.apply_updates(variables, updates), opt_state, loss

  def make():
    variables = pseudo_params(shapes)
    noise = bm.pseudo_normal(3, (batch, length + 1))  # uniform in [-sqrt(3), sqrt(3))
    ids = jnp.floor((noise / 3**0.5 + 1) * 128).astype(jnp.int32) + 1  # tokens 1..256
    batch_ = {
        "inputs": ids[:, :length],
        "mask": jnp.ones((batch, length), jnp.bool_),
        "targets": ids[:, length] % 2,
    }
    return variables, tx.init(variables), batch_, jax.random.key(0)

  return bm.Case(m.name, step, make)


def select_train_models(selection: str, num_features: int) -> list:
  """The train_step rows of ``--train-rows`` ('all', 'core' or names), baseline first; a
  ValueError names unknown rows and the valid ones."""
  models = train_models(num_features)
  if selection == "core":
    return [m for m in models if m.core]
  if selection == "all":
    return models
  wanted = [w.strip() for w in selection.split(",")]
  names = [m.name for m in models]
  bad = [w for w in wanted if w not in names]
  if bad:
    raise ValueError(
        f"--train-rows: unknown rows {bad}; valid: 'all', 'core' or names from "
        f"{'; '.join(names)}."
    )
  return [models[0]] + [m for m in models[1:] if m.name in wanted]


def run_train(args, log) -> tuple[list[bm.Table], list[bm.Target]]:
  models = select_train_models(args.train_rows, args.num_features)
  log(f"{len(models)} models at length {args.train_length}, batch {args.train_batch}")
  got = bm.measure_group(
      [train_case(m, args) for m in models],
      limits=args.limits,
      min_time_s=args.min_time,
      max_runs=args.repeats,
  )
  base = got[models[0].name]
  notes = bm.Footnotes()
  rows, data = [], {}
  for m in models:
    r = got[m.name]
    data[m.name] = r.as_dict() | {"kernel": m.kernel, "positional": m.positional}
    sps = "-" if r.time_s is None else f"{1 / r.time_s:.3g}"
    t_ratio = "-" if r.time_s is None or base.time_s is None else f"{r.time_s / base.time_s:.2f}x"
    m_ratio = (
        "-"
        if not r.memory_bytes or not base.memory_bytes
        else f"{r.memory_bytes / base.memory_bytes:.2f}x"
    )
    row = [m.name, m.kernel, m.positional, notes.time(r), sps, t_ratio, notes.memory(r), m_ratio]
    if args.platform != "cpu":
      row.append(_peak_text(r))
    rows.append(row)
  header = [
      "model",
      "kernel",
      "positional",
      "ms/step",
      "steps/s",
      "time vs Transformer",
      "memory",
      "memory vs Transformer",
  ] + (["device peak"] if args.platform != "cpu" else [])
  size = (
      "1 layer, width 32, 2 heads, MLP 64 (smoke)"
      if args.smoke
      else ("4 layers, width 256, 4 heads x 64, MLP 1024")
  )
  note_lines = [
      f"LRA Text model ({size}, dropout 0.1, mean pooling), length {args.train_length}, "
      f"batch {args.train_batch}, {args.dtype}; one jitted step: value_and_grad of the "
      "cross-entropy, global-norm clip, AdamW update. Ratios: step time and memory over the "
      "softmax Transformer's (PermuteFormer Table 2 reports the same ratio on epoch time). "
      "Lower bound: the Transformer row. Memory: compiled temp + argument + output (params, "
      "AdamW state, batch, activations)."
  ]
  table = bm.Table(
      "train_step",
      f"train step, LRA Text at N={args.train_length}",
      header,
      rows,
      note_lines + notes.notes(),
      data,
  )
  return [table], _train_targets(got, models, args)


def _train_targets(got, models, args) -> list[bm.Target]:
  out = []
  by_name = {m.name: got[m.name] for m in models}
  for plain, with_rpb, label in (
      ("Linear SIKF", "Linear SIKF + FastRPB (configs/lra_text_fastrpb.py)", "SIKF"),
      ("Linear ELU+1", "Linear ELU+1 + FastRPB", "ELU+1"),
  ):
    text = (
        f"FastRPB adds at most 15% to a full train step of the LRA Text model ({label}, "
        f"N={args.train_length})"
    )
    a, b = by_name.get(plain), by_name.get(with_rpb)
    if a is None or b is None or a.time_s is None or b.time_s is None:
      out.append(bm.Target(text, "not measured (row not run)", None))
    elif args.train_length != 4000 or args.smoke:
      out.append(
          bm.Target(
              text,
              f"not measured at the LRA length (this run: "
              f"{args.train_length}; {100 * (b.time_s / a.time_s - 1):+.0f}%)",
              None,
          )
      )
    else:
      extra = b.time_s / a.time_s - 1
      out.append(
          bm.Target(
              text,
              f"{100 * extra:+.0f}% ({bm.fmt_ms(b.time_s)} vs "
              f"{bm.fmt_ms(a.time_s)} ms per step)",
              extra <= 0.15,
          )
      )
  return out
