"""The dense O(N^2) reference of linear attention (the "naive" algorithm): materialises the
``[b, h, N, N]`` weights with every mask, decay, rpe table and segment, then normalises.
Every other algorithm in ``fastpos.ops.linear_attn`` is tested against it.

It lives beside the op's input checks in ``fastpos.ops.attention`` (which it shares); this
module names it with the other algorithms."""

from fastpos.ops.attention import linear_attention_reference

__all__ = ["linear_attention_reference"]
