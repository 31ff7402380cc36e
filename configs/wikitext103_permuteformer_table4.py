"""WikiText-103 causal language modelling: PermuteFormer Table 4 (test perplexity), one row
per model (Transformer, Performer, PermuteFormer and its ablations without r and without
P_pi), ``model=<row>``.

Command: python train.py --config=configs/wikitext103_permuteformer_table4.py:model=permuteformer --workdir=/tmp/wt103_permuteformer
Then:    python eval.py --workdir=/tmp/wt103_permuteformer --split=test
Data:    python scripts/download_data.py wikitext103 (the word-level release; the vocabulary and
         id streams are cached on first use).
Hardware: one or more GPUs (the paper: fairseq on 8 V100s; 50k steps of 64 x 512 tokens).
":tiny" builds a small model (segments of 64, 100 words) for a CPU check on the repository's
fixtures (fastpos/tasks/samples/wikitext; --config.task.data_dir="" reads the real data instead).
Paper: PermuteFormer (Chen 2021) Table 4, test perplexity, in config.paper: Transformer 30.18,
Performer 36.87, PermuteFormer 32.49, w/o r 35.76, w/o P_pi 33.08.
Evaluation protocol: the paper's numbers count only the last 256 tokens of each 512-token
window (fairseq's sliding window); this file sets config.task.eval_stride=256 so that
validation and eval.py score the same way (every token once, with >= 256 tokens of context).
--config.task.eval_stride=0 scores non-overlapping segments instead (a harder setting).
Settings: fairseq's transformer_lm recipe (examples/language_model) with the paper's sizes
(Sec. 4.2.1): 6 layers, width 512, FFN 1024, 8 heads, segments of 512; Adam (0.9, 0.98), lr
5e-4, inverse-sqrt after 4000 warmup steps, weight decay 0.01, no clipping, dropout 0.1, 50k
updates of 64 segments. Sinusoidal absolute positions (fairseq's default) except for
PermuteFormer ("Absolute position embedding is disabled"), whose kernel is ReLU features as in
its LRA rows; r in [0.88, 0.99] per head (decay="paper").
"""

from __future__ import annotations

import ml_collections

from configs import common

_PAPER_DECAY = "paper"  # permuteformer's decay option: per-head r = paper_decays(num_heads)
ROWS: dict[str, common.Row] = {
    "transformer": common.Row(
        dict(kernel="softmax", positional="absolute", positional_options=common.SINUSOIDAL),
        "Transformer",
    ),
    "performer": common.Row(
        dict(kernel="favor", positional="absolute", positional_options=common.SINUSOIDAL),
        "Performer",
    ),
    "permuteformer": common.Row(
        dict(
            kernel="relu",
            positional="permuteformer",
            positional_options={"permuteformer": {"decay": _PAPER_DECAY}},
        ),
        "PermuteFormer",
    ),
    "no_r": common.Row(dict(kernel="relu", positional="permuteformer"), "PermuteFormer w/o r"),
    "no_perm": common.Row(
        dict(
            kernel="relu",
            positional="permuteformer",
            positional_options={"permuteformer": {"decay": _PAPER_DECAY, "permute": False}},
        ),
        "PermuteFormer w/o Ppi",
    ),
}
RESULTS = common.results(
    [label for _, label in ROWS.values()],
    ["WikiText-103"],
    [(30.18,), (36.87,), (32.49,), (35.76,), (33.08,)],
)
SETTINGS = common.Settings(
    task="wikitext103",
    task_fields=dict(segment_length=512, eval_stride=256),
    model=dict(
        num_layers=6,
        embed_dim=512,
        num_heads=8,
        mlp_dim=1024,
        dropout_rate=0.1,
        norm="post",
        tie_embeddings=True,
    ),
    batch_size=64,
    num_train_steps=50_000,
    warmup_steps=4000,
    schedule="rsqrt",
    learning_rate=5e-4,
    weight_decay=0.01,
    grad_clip_norm=0.0,
    eval_every_steps=2000,
)

ARGS = dict(model="permuteformer", tiny=False)
CHOICES = dict(model=tuple(ROWS))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  return common.table_config(
      SETTINGS,
      ROWS[a.model],
      col="WikiText-103",
      table="PermuteFormer Table 4 (test perplexity)",
      results=RESULTS,
      metric="perplexity",
      tiny=a.tiny,
  )
