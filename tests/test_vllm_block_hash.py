"""kvlab's block hashes and KV-event payloads against vLLM's own code, from vLLM's venv.

- Hashes: kvlab's hash index with prefix_caching_hash_algo="sha256_cbor" against the
  block hashes vLLM's scheduler gives a `vllm.v1.request.Request` (its block hasher,
  `init_none_hash(sha256_cbor)`), on the same token ids: chat prompts, documents and
  held-out prose through the embedded model's chat template, and random ids over the
  vocabulary and past it; block sizes 1, 16, 32 and 128; no salt, a tenant salt, a unicode
  one and kvlab serve's JSON tenant salt; vLLM's default NONE_HASH seed and two
  PYTHONHASHSEED values. Identical, block for block.
- Payloads: kvlab serve's KV-event batches decoded by vLLM's msgspec decoder for
  `KVEventBatch` and encoded again by its publisher's encoder: the same bytes.

One vLLM process answers the module (importing vLLM takes ~30 s here). Skips, saying why,
where vLLM's venv is missing.
"""

from __future__ import annotations

import base64
import json
import random
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvlab import texts
from kvlab.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvlab.cache.prefix import PREFIX_INDEXES
from kvlab.cache.prefix.hash import block_hashes
from kvlab.config import EngineConfig
from kvlab.model.prompts import encode_messages
from kvlab.peers.vllm_serve import vllm_cli_missing, vllm_env, vllm_venv
from kvlab.serve.kv_events import encode_batch

pytestmark = pytest.mark.skipif(bool(vllm_cli_missing()), reason=str(vllm_cli_missing()))
REFERENCE = Path(__file__).with_name("vllm_reference.py")
SALTS = [None, "tenant-a", "ünïcødé ☃", '["alice", "session-7"]']
SEEDS = [None, "0", "kvlab-fleet"]


def ask_vllm(cases: dict) -> dict:
    """vLLM's answers (tests/vllm_reference.py, run by vLLM's python outside the repo)."""
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [str(vllm_venv() / "bin" / "python"), str(REFERENCE)],
            input=json.dumps(cases), capture_output=True, text=True, timeout=600, cwd=cwd,
            env=vllm_env(VLLM_TARGET_DEVICE="cpu"),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def prompts(tokenizer) -> list[list[int]]:
    """Token ids as kvlab serve and vLLM would see them: chats through the chat template,
    a document with a question, held-out prose, random ids (some past the vocabulary and
    past 2**16 and 2**32, where CBOR's integer widths change)."""
    rng = random.Random(40)
    chats = [encode_messages(tokenizer, [{"role": "user", "content": p}])
             for p in texts.chat_prompts()[:6]]  # fmt: skip
    doc = next(iter(texts.documents().values()))
    chats.append(encode_messages(tokenizer, [{"role": "user", "content": f"{doc}\n\nSummarise."}]))
    chats.append(list(tokenizer.encode(texts.heldout()[:3000])))
    odd = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40]
    chats.append([rng.choice(odd) for _ in range(70)])
    chats += [[rng.randrange(49152) for _ in range(rng.randrange(1, 300))] for _ in range(6)]
    return chats


@pytest.fixture(scope="module")
def token_prompts(model) -> list[list[int]]:
    return prompts(model.tokenizer)


def hash_cases(token_prompts) -> list[dict]:
    cases = []
    for i, tokens in enumerate(token_prompts):
        for block_size in (1, 16, 32, 128):
            if block_size == 1 and len(tokens) > 64:
                tokens = tokens[:64]
            salt = SALTS[(i + block_size) % len(SALTS)]
            seed = SEEDS[i % len(SEEDS)]
            cases.append({"tokens": tokens, "block_size": block_size, "salt": salt, "seed": seed})
    return cases


def event_batches() -> list[bytes]:
    """kvlab serve's payloads of every event kind, as its publisher encodes them."""
    keys = block_hashes(list(range(64)), 16, "tenant-a")
    stored = BlockStored(keys[:2], None, list(range(32)), 16, [("tenant-a",), None])
    later = BlockStored(keys[2:], keys[1], list(range(32, 64)), 16, [None, None])
    removed = BlockRemoved([keys[3]])
    return [
        encode_batch(1767225600.25, [stored, later]),
        encode_batch(1767225601.5, [removed, AllBlocksCleared()]),
        encode_batch(1767225602.0, [stored], rank=0, as_int=False),
    ]


@pytest.fixture(scope="module")
def vllm_answers(token_prompts) -> dict:
    payloads = [base64.b64encode(p).decode() for p in event_batches()]
    return ask_vllm({"hashes": hash_cases(token_prompts), "payloads": payloads})


def test_block_hashes_equal_vllms_block_for_block(token_prompts, vllm_answers):
    cases = hash_cases(token_prompts)
    assert len(vllm_answers["hashes"]) == len(cases)
    compared = 0
    for case, theirs in zip(cases, vllm_answers["hashes"]):
        config = EngineConfig(
            cache="paged", prefix_caching="hash", block_size=case["block_size"],
            prefix_caching_hash_algo="sha256_cbor", prefix_caching_hash_seed=case["seed"],
        )  # fmt: skip
        index = PREFIX_INDEXES["hash"].from_config(config)
        ours = [k.hex() for k in index.keys(case["tokens"], case["salt"])]
        assert len(ours) == len(case["tokens"]) // case["block_size"]
        assert ours == theirs, case
        compared += len(ours)
    assert compared > 500  # 888 blocks over 64 cases


def test_salt_and_seed_change_every_hash(token_prompts, vllm_answers):
    """The comparison is not vacuous: vLLM's hashes move with the salt and the seed."""
    tokens = token_prompts[0]
    base = block_hashes(tokens, 16)
    assert block_hashes(tokens, 16, salt="tenant-a")[0] != base[0]
    assert block_hashes(tokens, 16, seed="0")[0] != base[0]
    assert block_hashes(tokens, 16, algo="blake2b")[0] != base[0]


def test_event_payloads_are_vllms_encoding(vllm_answers):
    """vLLM decodes kvlab's batches as KVEventBatch and, encoding them again, writes the
    very same bytes: field names, order, types and the batch layout are vLLM's."""
    ours = event_batches()
    answers = vllm_answers["payloads"]
    assert [a.get("types") for a in answers] == [
        ["BlockStored", "BlockStored"],
        ["BlockRemoved", "AllBlocksCleared"],
        ["BlockStored"],
    ]
    for payload, answer in zip(ours, answers):
        assert "error" not in answer, answer
        assert base64.b64decode(answer["payload"]) == payload
