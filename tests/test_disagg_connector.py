"""The P/D connector in one process: producer -> consumer bit for bit, layer by layer."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.cache.connector import SCHEDULER_SIDE, WORKER_SIDE, method_table
from kvlab.disagg.connector import PrefillDecodeConnector
from kvlab.disagg.transfer import KVTransfer
from kvlab.integrity import IntegrityError

PROMPT = list(range(100, 140))  # 40 tokens: kivi2 holds two full groups and a window
CODECS = {None: 4, "int8": 4, "kivi2": 16}  # kv_codec -> block size (kivi2: its group)


def same_bytes(a, b) -> bool:
    """Bit for bit (codes may read as NaN floats, which never equal themselves)."""
    if a.tensors.keys() != b.tensors.keys():
        return False
    raw = {name: (t.contiguous().view(torch.uint8), b.tensors[name].contiguous().view(torch.uint8))
           for name, t in a.tensors.items()}  # fmt: skip
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in raw.values())


def engine(model, kv_codec=None) -> kvlab.Engine:
    config = EngineConfig(cache="paged", block_size=CODECS[kv_codec], max_model_len=256,
                          kv_codec=kv_codec)  # fmt: skip
    return kvlab.Engine(model, config)


def prefill(model, kv_codec=None, log=None):
    """Prefill PROMPT on a producer engine; returns (the KVTransfer its connector sent,
    what a whole `pool.read` of the request gives)."""
    producer_engine = engine(model, kv_codec)
    sent = []

    def send(seq, stored, digest):
        sent.append(KVTransfer(0, seq.prompt_ids, seq.params, seq.output_ids[0], kv_codec,
                               stored, digest, 0.0))  # fmt: skip

    producer = PrefillDecodeConnector("kv_producer", producer_engine.cache, transport=send)
    if log is not None:
        record(producer_engine.cache.pool, log)
    producer_engine.add_request(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True))
    producer_engine.step()
    (seq,) = producer_engine.scheduler.running
    cache = producer_engine.cache
    whole = cache.pool.read(cache.position_slots(seq, 0, seq.num_computed))
    producer.request_finished(seq, cache.block_table(seq))
    producer_engine.cancel(seq.request_id)
    assert cache.num_available == cache.num_blocks  # no block leaked
    producer.check_integrity()
    (transfer,) = sent
    return transfer, whole


def record(pool, log: list) -> None:
    """Log every per-layer pool call as (method, layer)."""
    for name in ("read_layer", "restore_layer"):
        method = getattr(pool, name)

        def logged(layer, *args, _method=method, _name=name):
            log.append((_name, layer))
            return _method(layer, *args)

        setattr(pool, name, logged)


def arrive(model, transfer, kv_codec=None, log=None):
    """A consumer engine receives `transfer`; the caller then takes its blocks
    (`allocate_computed`) and loads it, as the scheduler does at swap-in. Returns (engine,
    connector, sequence, received)."""
    decode = engine(model, kv_codec)
    consumer = PrefillDecodeConnector("kv_consumer", decode.cache)
    if log is not None:
        record(decode.cache.pool, log)
    seq = decode.make_sequence(transfer.prompt_ids, transfer.params)
    received = consumer.receive(seq, transfer)
    return decode, consumer, seq, received


@pytest.mark.parametrize("kv_codec", list(CODECS))
def test_round_trip_is_bit_exact(tiny_model, kv_codec):
    transfer, whole = prefill(tiny_model, kv_codec)
    assert same_bytes(transfer.stored, whole)  # layer by layer == one whole read
    decode, consumer, seq, received = arrive(tiny_model, transfer, kv_codec)
    assert received and consumer.get_num_new_matched_tokens(seq, 0) == (len(PROMPT), False)
    seq.num_computed = len(PROMPT)
    cache = decode.cache
    assert cache.allocate_computed(seq, alone=True) is not None  # as the scheduler's swap-in
    consumer.load(seq)
    back = cache.pool.read(cache.position_slots(seq, 0, len(PROMPT)))
    assert same_bytes(back, whole)
    assert consumer.stats.requests == 1 and consumer.stats.bytes == whole.nbytes
    layerwise = cache.pool.layerwise
    assert layerwise == (kv_codec != "kivi2")
    assert (sum(consumer.stats.layer_bytes) == whole.nbytes) == layerwise
    consumer.check_integrity()
    cache.free(seq)
    assert cache.num_available == cache.num_blocks
    cache.check_integrity()


@pytest.mark.parametrize("fault", ["corrupt", "truncate"])
def test_consumer_refuses_a_damaged_transfer(tiny_model, fault):
    transfer, _ = prefill(tiny_model)
    name = sorted(transfer.stored.tensors)[0]
    tensor = transfer.stored.tensors[name]
    if fault == "corrupt":
        tensor.view(torch.uint8).reshape(-1)[7] ^= 0x01  # one bit
    else:
        transfer.stored.tensors[name] = tensor[:, :-1].clone()
    decode, consumer, seq, received = arrive(tiny_model, transfer)
    assert not received
    assert consumer.get_num_new_matched_tokens(seq, 0) == (0, False)
    seq.num_computed = len(PROMPT)
    with pytest.raises(IntegrityError, match="no intact transfer"):
        consumer.load(seq)
    assert decode.cache.num_available == decode.cache.num_blocks


def test_per_layer_calls_run_in_layer_order(tiny_model):
    saves, loads = [], []
    transfer, _ = prefill(tiny_model, log=saves)
    decode, consumer, seq, _ = arrive(tiny_model, transfer, log=loads)
    seq.num_computed = len(PROMPT)
    assert decode.cache.allocate_computed(seq, alone=True) is not None
    consumer.load(seq)
    layers = range(tiny_model.hf_model.config.num_hidden_layers)
    assert saves == [("read_layer", layer) for layer in layers]
    assert loads == [("restore_layer", layer) for layer in layers]
    consumer.bind_connector_metadata(consumer.build_connector_meta())
    consumer._bound.loads = [(seq.request_id, torch.arange(4), transfer.stored)]
    with pytest.raises(IntegrityError, match="layer order"):
        consumer.wait_for_layer_load(1)  # layer 0 first


def test_method_table_covers_both_roles(tiny_model):
    cache = engine(tiny_model).cache
    for connector in (PrefillDecodeConnector("kv_consumer", cache),
                      PrefillDecodeConnector("kv_producer", cache, transport=print)):  # fmt: skip
        rows = method_table(connector)
        assert [name for _, name, _ in rows] == [*SCHEDULER_SIDE, *WORKER_SIDE]
        assert all(doc for _, _, doc in rows)
    docs = {name: doc for _, name, doc in rows}
    assert docs["request_finished"].startswith("Producer")
    assert docs["get_num_new_matched_tokens"].startswith("Consumer")
    with pytest.raises(IntegrityError, match="kv_role"):
        PrefillDecodeConnector("kv_both", cache)


def queue_arrived(decode, consumer, seq, transfer) -> None:
    """What Disaggregated._admit does with an intact transfer: the first token is known,
    the prompt's KV waits in the connector, the request waits in `swapped`."""
    seq.output_ids.append(transfer.first_token)
    seq.num_computed = len(transfer.prompt_ids)
    seq.first_token_s = decode.clock()
    seq.token_times.append(seq.first_token_s)
    decode.scheduler.add_arrived(seq, consumer)


def test_arrived_request_decodes_like_one_engine(tiny_model):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    (expected,) = engine(tiny_model).generate([PROMPT], params)
    transfer, _ = prefill(tiny_model)
    decode, consumer, seq, _ = arrive(tiny_model, transfer)
    seq.params = params
    queue_arrived(decode, consumer, seq, transfer)
    outs = []
    while decode.has_unfinished():
        outs += decode.step()
    assert [o.token_ids for o in outs] == [expected.token_ids]
    assert consumer.stats.requests == 1 and not consumer.arrived
    assert decode.cache.num_available == decode.cache.num_blocks


def test_cancelled_before_loading_forgets_the_transfer(tiny_model):
    transfer, _ = prefill(tiny_model)
    decode, consumer, seq, _ = arrive(tiny_model, transfer)
    queue_arrived(decode, consumer, seq, transfer)
    assert decode.cancel(seq.request_id)
    assert not consumer.arrived and consumer.stats.requests == 0
    assert decode.cache.num_available == decode.cache.num_blocks
