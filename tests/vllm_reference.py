"""vLLM's own answers for kvlab's block-hash and KV-event tests; runs with the vLLM venv's
python only (never imports kvlab):

    .venv-vllm/bin/python tests/vllm_reference.py < cases.json > answers.json

Input, a JSON object:
    "hashes": [{"tokens": [...], "block_size": 16, "salt": str|null, "seed": str|null}]
        -> each request's block hashes (hex) as vLLM computes them: a `vllm.v1.request.
        Request` with that cache_salt and the block hasher vLLM's scheduler gives it
        (`get_request_block_hasher(block_size, sha256_cbor)`), NONE_HASH from
        `init_none_hash(sha256_cbor)` under PYTHONHASHSEED=seed (unset when null);
    "payloads": [base64 of one ZMQ payload]
        -> each decoded with vLLM's `msgspec.msgpack.Decoder(KVEventBatch)` and encoded
        again with its publisher's encoder (base64), or the decoder's error.
"""

import base64
import json
import os
import sys


def block_hashes(case: dict) -> list[str]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    if case["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    kv_cache_utils.init_none_hash(sha256_cbor)
    hasher = kv_cache_utils.get_request_block_hasher(case["block_size"], sha256_cbor)
    request = Request(
        request_id="r",
        prompt_token_ids=list(case["tokens"]),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=case["salt"],
        block_hasher=hasher,
    )
    return [bytes(h).hex() for h in request.block_hashes]


def reencode(payload: str) -> dict:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    try:
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(base64.b64decode(payload))
    except msgspec.DecodeError as error:
        return {"error": str(error)}
    again = msgspec.msgpack.Encoder().encode(batch)
    return {
        "payload": base64.b64encode(again).decode(),
        "types": [type(e).__name__ for e in batch.events],
    }


def main() -> None:
    cases = json.load(sys.stdin)
    answers = {
        "hashes": [block_hashes(case) for case in cases.get("hashes", [])],
        "payloads": [reencode(p) for p in cases.get("payloads", [])],
    }
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
