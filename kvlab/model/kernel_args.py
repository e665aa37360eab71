"""What the kernels read of a KV pool: one layer's stored K/V (and scales), in the argument
names of kvlab.kernels' calls. kernels/kv_codes.py names the same codecs on the kernels'
side (it imports nothing of kvlab, so that the kernels load on a GPU machine alone)."""

from __future__ import annotations

from kvlab.cache.pool import KVPool

KERNEL_CODECS = (None, "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")
SCALED = ("int8", "fp8_e4m3", "fp8_e5m2")  # codes + one bf16 scale per token per kv head


def pool_layer(pool: KVPool, layer: int) -> dict:
    """One layer's stored K/V (and scales) in the kernels' argument names."""
    codec = pool.codec
    k, v = codec.k_fields, codec.v_fields  # each [codes, scales?], (layers, slots, ...)
    args = {"k_cache": k[0][layer], "v_cache": v[0][layer], "kv_codec": pool.kv_codec}
    if pool.kv_codec in SCALED:
        args.update(k_scale=k[1][layer], v_scale=v[1][layer])
    return args
