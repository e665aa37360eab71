"""KV codecs: how the pool stores K and V, from the model's dtype down to 2 bits.

Every codec is a class in its own file, registered in `CODECS` under the name
`EngineConfig.kv_codec` uses: None (the model's dtype, `floats.py`), "fp16", "bf16",
"int8", "fp8_e4m3", "fp8_e5m2", "int4" and "kivi2". A new codec is one file with a
`@CODECS.register("name")` class (a `TokenCodec` needs only `fields`, `encode`, `decode`).

Scaled codecs keep their scales in bfloat16 beside the codes: 2 bytes, the full fp32 range
(no overflow for huge values, unlike fp16 scales). Where a codec's error bound says `s`, it
means that stored scale.

NaN/inf: every codec except the baseline raises ValueError on a non-finite input (a NaN in
a scaled codec would silently spoil the scale of a whole head), and fp16/bf16 raise on
finite values they cannot hold (|x| > 65504 in fp16). The baseline stores anything.
Zeros round-trip exactly: an all-zero head or group gets scale 0, and the symmetric codes
(int8, fp8, int4) also keep every single zero exact; kivi2's asymmetric codes keep only
all-zero groups exact.
"""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE, KVCodec, StoredKV, TokenCodec
from kvlab.cache.codecs.registry import CODECS
from kvlab.cache.spec import KVSpec

# The built-in codecs register themselves on import, in this order (tables list them so).
# isort: off
from kvlab.cache.codecs import floats  # noqa: E402, F401  (None, "fp16", "bf16")
from kvlab.cache.codecs import int8  # noqa: E402, F401
from kvlab.cache.codecs import fp8  # noqa: E402, F401  ("fp8_e4m3", "fp8_e5m2")
from kvlab.cache.codecs import int4  # noqa: E402, F401
from kvlab.cache.codecs import kivi2  # noqa: E402, F401
# isort: on


def make_codec(
    kv_codec: str | None, spec: KVSpec, num_slots: int, dtype: torch.dtype, device: torch.device
) -> KVCodec:
    """The codec `kv_codec` names, owning the storage of `num_slots` slots."""
    return CODECS[kv_codec](spec, num_slots, dtype, device)


__all__ = ["CODECS", "SCALE_DTYPE", "KVCodec", "StoredKV", "TokenCodec", "make_codec"]
