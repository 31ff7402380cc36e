"""The papers' claims on a word-level causal LM, CPU-sized (fastpos.tasks.text_lm on the Vim
user manual): kernelized RPE (Luo et al.), LRPE, PermuteFormer and the Transformer-XL memory,
one variant per run, ``model=<variant>,context=<L>,memory=<bool>``.

Command: python train.py --config=configs/claim_text_lm.py:model=nprf_rpe --workdir=/tmp/claim_lm
Then:    python eval.py --workdir=/tmp/claim_lm --split=test
Claims:  scripts/claims.sh OUT_DIR runs every claim at 5 seeds (docs/claims.md); one claim:
         scripts/sweep.sh --config=configs/claim_text_lm.py --sweep_dir=DIR --mode=parallel arg.model=txl arg.context=16,32,64 arg.memory=false,true seed=0,1,2,3,4
         python scripts/make_tables.py DIR --compare='Transformer-XL rel. + memory>Transformer-XL rel.'
Hardware: a 2-core CPU (the time a run took: results/claims/README.md); ":tiny" runs in
seconds on the repository's WikiText fixtures (fastpos/tasks/samples/wikitext).
Data: words (WikiText-103's rules) of /usr/share/vim/vim90/doc/usr_*.txt (Debian's
vim-runtime; about 104k words), the 2000 most frequent kept (the rest <unk>); contiguous
splits: the last 10% of the text is test, the 10% before it validation (``paths=`` reads
another text). Each example is ``context`` tokens; validation and test score non-overlapping
segments (every token once), so a longer context or a memory sees more of the past.
Expected: no paper number applies (the papers report WikiText-103 at 512 tokens on GPUs); the
claim is the sign of the paired test-perplexity difference (results/claims/).
Variants: Luo et al. Table 2's rows (configs/wikitext103_nprf_table2.py: softmax, NPRF and
NPRF + kernelized RPE, sinusoidal absolute positions), LRPE Table 4's (configs/lrpe_table4.py:
ELU+1 with none / RoPE / LRPE types 1-3), PermuteFormer Table 4's (configs/
wikitext103_permuteformer_table4.py: Transformer, Performer, PermuteFormer) and the
Transformer-XL relative attention (softmax; ``memory``: model.memory_length = context, the
previous segment's states kept as the paper's memory).
Settings: 2 pre-LN layers x 128, 4 heads, MLP 512, dropout 0.1, tied embeddings, m = 64
random features; AdamW (0.9, 0.99), lr 1e-3, weight decay 0.1, 40 warmup steps then cosine,
clipping at 1; 400 steps of 16 segments (about 5 passes over the training words).
"""

from __future__ import annotations

import ml_collections

from configs import common, lrpe_table4, text_lm, wikitext103_nprf_table2
from configs import wikitext103_permuteformer_table4 as permuteformer_table4

VARIANTS: dict[str, common.Row] = {
    "softmax": wikitext103_nprf_table2.ROWS["vanilla"],
    "nprf": common.Row(
        dict(kernel="nprf", positional="absolute", positional_options=common.SINUSOIDAL),
        "NPRF-Transformer",
    ),
    "nprf_rpe": wikitext103_nprf_table2.ROWS["nprf_rpe"],
    **lrpe_table4.CLAIM_ROWS,
    **common.pick(permuteformer_table4.ROWS, common.PERMUTEFORMER_CLAIM),
    "txl": common.Row(dict(kernel="softmax", positional="transformer_xl"), "Transformer-XL rel."),
}
TABLE = "Claims on a word-level LM (Vim user manual)"
MEMORY = " + memory"  # the column label's suffix of a run with model.memory_length = context
SETTINGS = common.Settings(
    task="text_lm",
    task_fields=dict(
        paths=text_lm.VIM_MANUAL,
        include="usr_*.txt",
        level="word",
        vocab_size=2000,
        validation_fraction=0.1,
        test_fraction=0.1,
        segment_length=64,
        eval_stride=0,
    ),
    model=dict(
        num_layers=2,
        embed_dim=128,
        num_heads=4,
        mlp_dim=512,
        dropout_rate=0.1,
        norm="pre",
        tie_embeddings=True,
    ),
    kernel_options=dict(num_features=64),
    optimizer=dict(b2=0.99),
    batch_size=16,
    num_train_steps=400,
    warmup_steps=40,
    learning_rate=1e-3,
    weight_decay=0.1,
    grad_clip_norm=1.0,
    eval_every_steps=200,
)

ARGS = dict(model="nprf_rpe", context=64, memory=False, tiny=False)
CHOICES = dict(model=tuple(VARIANTS), context=(8, 16, 32, 64, 128, 256))


def build(*, model: str, context: int, memory: bool, tiny: bool) -> ml_collections.ConfigDict:
  """The run of variant ``model`` (a key of ``VARIANTS``) on ``context``-token segments, with
  a Transformer-XL memory of ``context`` states when ``memory`` (the ``txl`` variant only)."""
  if memory and model != "txl":
    raise ValueError(f"memory=true needs model=txl (the transformer_xl scheme), not {model!r}.")
  variant = VARIANTS[model]
  c = common.table_config(
      SETTINGS,
      common.Row({}, f"context {context}"),
      variant,
      col=variant.label + (MEMORY if memory else ""),
      table=TABLE,
      results={},
      metric="perplexity",
      tiny=tiny,
  )
  c.task.segment_length = context
  c.model.memory_length = context if memory else 0
  if tiny:  # the repository's WikiText fixtures (about 140 word types)
    c.task.update(paths=text_lm.FIXTURES, include="*.tokens", vocab_size=100)
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return build(**common.parse_arg(arg, choices=CHOICES, **ARGS))
