"""fastpos's benchmarks: scripts that print tables of ratios measured side by side in one run
and write them (markdown and JSON) next to the committed results in this folder.

Not part of the installed ``fastpos`` package (nothing in ``fastpos`` imports it); run from the
repository root, where ``benchmarks`` and ``configs`` import:

  python -m benchmarks                      # the list of benchmarks
  python -m benchmarks NAME --help          # one benchmark's flags
  python -m benchmarks speed --mode=all --out=/tmp/bench
  python -m benchmarks.NAME ...             # the same, by module

``BENCHMARKS`` names every benchmark (the module ``benchmarks.<name>`` with a
``main(argv) -> int``); the other modules are shared pieces: ``measure`` (compiling, timing
and memory of a group of cases), ``report`` (where results go), ``ops`` and ``models`` (the
rows of the speed tables), ``gpu_modes`` (the GPU check's linear-attention parts).
"""

# name -> one line on what it measures (``python -m benchmarks`` lists them).
BENCHMARKS = {
    "speed": "speed and memory against sequence length of the fast ops, the attention layer "
    "and the LRA Text train step (--mode=ops|layer|train_step|all)",
    "decode": "decoding ms per token and state memory against context length",
    "memory": "train-step memory against model.remat / scan_layers / mlp_chunk, compile time "
    "against depth (compiles only)",
    "memory_length": "FastRPB's memory claim: train-step memory against N, softmax against "
    "linear attention + FastRPB (compiles only)",
    "context_parallel": "train-step memory per device with the sequence split over devices "
    "(mesh.seq; compiles only)",
    "million": "the 1,048,576-token train step over devices: memory per device",
    "ops_lean": "linear attention against the matmul peak, kernelized RPE against its peers",
    "modes": "causal linear attention by algorithm, recurrent against chunk (--update_auto: "
    "the table of mode='auto')",
    "chunked_layer": "one attention layer by chunks (model.attn_chunk) against the whole layer",
    "padding": "the main job's real tokens/s padded against length-bucketed",
    "packing": "the main job's real tokens/s padded, bucketed and packed",
    "small_lm": "a small character LM's train step against a plain Flax GPT",
    "checkpoint_digests": "what checkpoint digests cost on save and restore",
    "ops_accuracy": "the fast ops' worst relative error against their dense references "
    "(float64 and float32)",
    "gpu": "the GPU check: its seven parts within a time budget (scripts/gpu_check.sh)",
}
