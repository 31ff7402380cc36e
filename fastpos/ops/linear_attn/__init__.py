"""Causal linear attention, one module per algorithm (the layout of flash-linear-attention):

* ``naive``: the dense O(N^2) reference (``linear_attention_reference``);
* ``recurrent``: a serial scan over chunks (exact inside a chunk, a state carried between);
* ``chunk``: chunkwise-parallel, every chunk's products at once and the chunk states'
  exclusive prefix by an associative scan (no serial loop);
* ``fused``: one kernel for the whole causal product (where built);
* ``auto``: the per-backend choice; ``dispatch``: picks the algorithm for a call.

The public op is ``fastpos.ops.attention.linear_attention(..., mode=...)``. Submodules are
imported by name (``from fastpos.ops.linear_attn import chunk``); this package imports none of
them eagerly, so ``fastpos.ops.attention`` can build on them.
"""
