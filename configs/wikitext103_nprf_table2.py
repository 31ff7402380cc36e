"""WikiText-103 causal language modelling: Luo et al. (2021) Table 2 (validation perplexity),
NPRF attention with kernelized RPE (FFT) against softmax, ELU+1 and TRF baselines,
``model=<row>``.

Command: python train.py --config=configs/wikitext103_nprf_table2.py:model=nprf_rpe --workdir=/tmp/wt103_nprf_rpe
Then:    python eval.py --workdir=/tmp/wt103_nprf_rpe --split=validation
Data:    python scripts/download_data.py wikitext103
Hardware: GPUs (the paper: 8 V100s, 150k steps of 64 x 512 tokens). ":tiny" builds a small
model (segments of 64, 100 words) for a CPU check on the repository's fixtures
(fastpos/tasks/samples/wikitext; --config.task.data_dir="" reads the real data instead).
Paper: Luo et al. 2021, "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding", Table 2, validation perplexity, in config.paper: NPRF w/ RPE 30.6,
vanilla Transformer 33.0, Linear Transformer 38.4, TRF 33.6 (TRF-GATE, 31.3, is not built
here).
Evaluation protocol: the paper trains and evaluates on 512-token segments without context from
earlier segments and describes no sliding window; this file scores non-overlapping 512-token
segments (config.task.eval_stride=0, every token once).
Settings: the paper's Sec. 4.2: 6 layers, 8 heads, width 512, FFN 2048, dropout 0.1, weight
decay 0.01, batch 64 x 512 tokens, m = 64 features, Adam eps 1e-6 (0.9, 0.98), peak lr 2e-3,
150k steps, 6k warmup then inverse square root; sinusoidal absolute positions in every row
(fairseq's default).
"""

from __future__ import annotations

import ml_collections

from configs import common

ROWS: dict[str, common.Row] = {
    "vanilla": common.Row(
        dict(kernel="softmax", positional="absolute", positional_options=common.SINUSOIDAL),
        "Vanilla Transformer",
    ),
    "linear": common.Row(
        dict(kernel="elu1", positional="absolute", positional_options=common.SINUSOIDAL),
        "Linear Transformer",
    ),
    "trf": common.Row(
        dict(kernel="trf", positional="absolute", positional_options=common.SINUSOIDAL),
        "TRF-Transformer",
    ),
    "nprf_rpe": common.Row(
        dict(
            kernel="nprf",
            positional="absolute+kernelized_rpe",
            positional_options=common.SINUSOIDAL,
        ),
        "NPRF-Transformer w/ RPE",
    ),
}
RESULTS = common.results(
    [label for _, label in ROWS.values()], ["WikiText-103"], [(33.0,), (38.4,), (33.6,), (30.6,)]
)
SETTINGS = common.Settings(
    task="wikitext103",
    task_fields=dict(segment_length=512, eval_stride=0),
    model=dict(
        num_layers=6,
        embed_dim=512,
        num_heads=8,
        mlp_dim=2048,
        dropout_rate=0.1,
        norm="post",
        tie_embeddings=True,
    ),
    kernel_options=dict(num_features=64),
    optimizer=dict(eps=1e-6),
    batch_size=64,
    num_train_steps=150_000,
    warmup_steps=6000,
    schedule="rsqrt",
    learning_rate=2e-3,
    weight_decay=0.01,
    grad_clip_norm=0.0,
    eval_every_steps=5000,
)

ARGS = dict(model="nprf_rpe", tiny=False)
CHOICES = dict(model=tuple(ROWS))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  return common.table_config(
      SETTINGS,
      ROWS[a.model],
      col="WikiText-103",
      table="Luo et al. Table 2 (validation perplexity)",
      results=RESULTS,
      metric="perplexity",
      tiny=a.tiny,
  )
