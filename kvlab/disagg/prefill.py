"""The prefill engine's process: prompts in, KVTransfers out."""

from __future__ import annotations

import torch

from kvlab.config import EngineConfig, SamplingParams
from kvlab.disagg.connector import PrefillDecodeConnector
from kvlab.disagg.transfer import KVTransfer


def _damage(transfer: KVTransfer, fault: str) -> None:
    """Test hook: spoil a transfer after its checksum is taken."""
    name = sorted(transfer.stored.tensors)[0]
    tensor = transfer.stored.tensors[name]
    if fault == "truncate":
        transfer.stored.tensors[name] = tensor[:, : max(1, tensor.shape[1] // 2)].clone()
    elif fault == "corrupt":
        flat = tensor.view(torch.uint8).reshape(-1)
        flat[len(flat) // 2] ^= 0xFF


def prefill_main(conn, model_name: str | None, dtype, config: dict, fault: str | None) -> None:
    """Loop: receive (index, prompt_ids, params) batches, prefill them, send transfers.

    Each request runs until its first token; its KV then goes through the producer
    connector (read off the pool layer by layer, checksummed) onto the pipe, and the
    request is cancelled, freeing its blocks. Each transfer carries the engine's step
    time and step count so far (one step that finishes several prompts counts once); at
    "stop" it sends its blocks still held and the totals of its own telemetry.
    """
    from kvlab.build import Engine
    from kvlab.model.loading import load_model

    torch.set_num_threads(1)
    engine = Engine(load_model(model_name, device="cpu", dtype=dtype, progress=False),
                    EngineConfig(**config))  # fmt: skip
    sending: dict[int, tuple[int, SamplingParams]] = {}  # request id -> index, params
    busy = {"s": 0.0, "steps": 0}  # running totals over the steps so far, each step once

    def send(seq, stored, digest) -> None:  # the producer's transport: the pipe
        index, params = sending.pop(seq.request_id)
        transfer = KVTransfer(
            index, seq.prompt_ids, params, seq.output_ids[0], engine.cache.pool.kv_codec,
            stored, digest, busy["s"], busy["steps"],
        )  # fmt: skip
        if fault:
            _damage(transfer, fault)
        conn.send(("kv", transfer))

    producer = PrefillDecodeConnector("kv_producer", engine.cache, transport=send)
    conn.send(("ready", None))
    while True:
        kind, batch = conn.recv()
        if kind == "stop":
            engine.cache.check_integrity()
            producer.check_integrity()
            cache, steps = engine.cache, engine.stats()  # its telemetry: a row per step
            held = cache.num_blocks - cache.num_available
            totals = {
                "blocks_held": held,
                "steps": len(steps),
                "step_s": float(steps["step_s"].sum()),
            }
            conn.send(("stopped", totals))
            return
        ids = {}
        for index, prompt_ids, params in batch:
            ids[engine.add_request(prompt_ids, _first_token_only(params))] = (index, params)
        while ids:
            recorded = len(engine.telemetry.records)
            engine.step()
            for record in engine.telemetry.records[recorded:]:  # this step's row
                busy["s"] += record.step_s
                busy["steps"] += 1
            for seq in list(engine.scheduler.running):
                if seq.request_id not in ids or not seq.output_ids:
                    continue
                sending[seq.request_id] = ids.pop(seq.request_id)
                producer.request_finished(seq, engine.cache.block_table(seq))  # sends
                engine.cancel(seq.request_id)


def _first_token_only(params: SamplingParams) -> SamplingParams:
    """Keep the request running past its first token (so its blocks are still there to
    read out); it is cancelled right after."""
    return SamplingParams(max_new_tokens=max(2, params.max_new_tokens),
                          temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, seed=params.seed, ignore_eos=True)  # fmt: skip
