"""Disaggregated prefill and decode, run for real as two processes on one machine.

A prefill engine (a process of its own, `prefill.py`) computes each prompt's KV and its first
token; the request's KV blocks then travel to the decode engine (this process) as the
codec's stored bytes with a checksum (`transfer.py`), over a local socket (a
multiprocessing pipe). They move through the KV connector interface
(kvlab.cache.connector), as vLLM's P/D connectors do (`connector.py`): the prefill
engine's connector is the "kv_producer" (saves each layer's codes off its pool, sends
them), the decode engine's the "kv_consumer" (checks what arrived, loads it layer by
layer). The decode engine admits the request the way it swaps a preempted one back in:
blocks allocated, the KV loaded into them, decoding continues from the first token. A
transfer that arrives corrupted or truncated is detected and the request is recomputed
from its prompt, never decoded on bad KV; if the prefill process dies, the prompts it held
and every later one are prefilled on the decode engine (`pair.py`). One prefill engine may
feed a pool of decode engines (`decode_engines=2`: 1P:2D), each prefilled request routed
to the least-loaded one (`routing.py`).

As vLLM's docs say of its disaggregated prefill: this does not raise throughput; it keeps
long prompts' prefills from stalling the running decodes (time to first token decoupled
from inter-token latency).
"""

from kvlab.disagg.connector import PrefillDecodeConnector
from kvlab.disagg.pair import Disaggregated
from kvlab.disagg.transfer import KVTransfer

__all__ = ["Disaggregated", "KVTransfer", "PrefillDecodeConnector"]
