"""Disaggregated: a prefill engine in its own process, a pool of decode engines here."""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Sequence as Seq

from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.disagg.connector import PrefillDecodeConnector
from kvlab.disagg.prefill import prefill_main
from kvlab.disagg.routing import least_loaded, load_of
from kvlab.disagg.transfer import KVTransfer
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.requests import Prompt
from kvlab.model.loading import EMBEDDED_MODEL, LoadedModel
from kvlab.processes import exit_status, worker_context
from kvlab.workloads import Request


@dataclasses.dataclass
class PairStats:
    """What a Disaggregated pair moved between its processes, and what it recomputed."""

    transfers: int = 0
    bytes_moved: int = 0
    prompt_tokens: int = 0  # the transfers' prompt tokens: bytes_moved is their KV
    rejected: int = 0  # corrupted or truncated: recomputed on the decode side
    prefill_s: float = 0.0  # the prefill engine's steps' wall time, each step once
    prefill_steps: int = 0  # the prefill engine's steps (one may finish many prompts)
    prefilled_here: int = 0  # in flight or not sent when the prefill process died
    routed: list[int] = dataclasses.field(default_factory=list)  # requests per decode engine


class Disaggregated:
    """Serve requests with prefill and decode on different engines (and processes).

        pair = Disaggregated(model, EngineConfig(cache="paged"), EngineConfig(cache="paged"))
        outputs = pair.generate(prompts, SamplingParams(max_new_tokens=64))
        pair.close()

    `decode_engines` (the D of P:D, default 1) decode engines share this process, each
    with its own cache and scheduler, and step in turn; each finished prefill goes to the
    least-loaded one (`kvlab.disagg.routing`). `pair.decodes` lists them, `pair.decode` is
    the first. They must swap (they admit transfers as swap-ins) and use the prefill
    engine's KV codec. `fault` ("corrupt" | "truncate") spoils every transfer after its
    checksum, to show detection and recompute.

    If the prefill process dies (a RuntimeWarning says so, and `lost` how it ended), the
    prompts it held and those not sent yet are prefilled on the decode engines, and the run
    carries on with the same greedy tokens. The pair then serves every later call on the
    decode engines alone; the prefill process is not restarted.
    """

    def __init__(
        self,
        model: LoadedModel,
        prefill: EngineConfig,
        decode: EngineConfig,
        fault: str | None = None,
        decode_engines: int = 1,
    ):
        if type(decode_engines) is not int or decode_engines < 1:
            raise ValueError(f"decode_engines={decode_engines!r} must be an int >= 1: the "
                             "prefill engine needs a decode engine to hand its KV to")  # fmt: skip
        if prefill.kv_codec != decode.kv_codec:
            raise ValueError(
                f"prefill kv_codec={prefill.kv_codec!r} != decode kv_codec={decode.kv_codec!r}: "
                "the stored KV moves as it is"
            )
        self.decode = Engine(model, decode)
        if not self.decode.cache.swaps:
            raise ValueError(f"the decode engine's cache={decode.cache!r} cannot admit KV "
                             "from outside (it does not swap): use cache='paged'")  # fmt: skip
        self.decodes = [self.decode, *(Engine(model, decode) for _ in range(decode_engines - 1))]
        for engine in self.decodes[1:]:
            engine._start = self.decode._start  # one clock: arrival times are on decode 0's
        self.stats = PairStats(routed=[0] * decode_engines)
        self.consumers = [PrefillDecodeConnector("kv_consumer", e.cache) for e in self.decodes]
        self.consumer = self.consumers[0]
        context = worker_context(["kvlab.disagg.prefill"])
        self.conn, child = context.Pipe()  # a local socket pair
        name = None if model.name == EMBEDDED_MODEL else model.name
        config = {f.name: getattr(prefill, f.name) for f in dataclasses.fields(prefill)}
        self.worker = context.Process(
            target=prefill_main,
            args=(child, name, model.hf_model.dtype, config, fault),
            daemon=True,
        )
        self.worker.start()
        child.close()  # the worker's end: closed here, a dead worker reads as EOF, not a hang
        self._stop = weakref.finalize(self, _stop, self.worker, self.conn)
        self.prefill_blocks_held: int | None = None  # after close(): 0 means no leak
        self.prefill_record: dict | None = None  # after close(): its engine's step records
        self.lost: str | None = None  # how the prefill process died, once it has
        try:
            self._expect("ready")
        except EOFError:
            self.close()
            raise RuntimeError(
                f"the prefill process exited ({exit_status(self.worker)}) before it was "
                "ready: its error is printed above"
            ) from None

    def _expect(self, kind: str):
        got, payload = self.conn.recv()
        if got != kind:
            raise RuntimeError(f"prefill process sent {got!r}, expected {kind!r}")
        return payload

    def generate(
        self,
        prompts: Seq[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        chat: bool | None = None,
    ) -> list[RequestOutput]:
        """Prefill every prompt over there, decode here; one output per prompt, in order."""
        params = sampling_params or SamplingParams()
        return self._serve([self._sequence(p, params, chat, 0.0) for p in prompts])

    def run(self, requests: Seq[Request], *, ignore_eos: bool = False) -> list[RequestOutput]:
        """Serve a workload (kvlab.workloads): request i is sent to the prefill engine
        `arrival_s` after the call. One output per request, in order."""
        offset = self.decode.clock()
        seqs = [
            self._sequence(r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens,
                           ignore_eos=ignore_eos), None, offset + r.arrival_s)
            for r in requests
        ]  # fmt: skip
        return self._serve(seqs)

    def _sequence(self, prompt: Prompt, params: SamplingParams, chat, arrival_s: float):
        if params.n > 1:
            raise ValueError(f"SamplingParams.n={params.n}: disaggregated serving runs n=1")
        return self.decode.make_sequence(prompt, params, chat=chat, arrival_s=arrival_s)

    def _serve(self, seqs: list) -> list[RequestOutput]:
        """Send prompts as they arrive, admit transfers as they come back, decode (each
        decode engine one step in turn). Once the prefill process is dead, the prompts it
        held and the unsent ones are prefilled here."""
        unsent = sorted(range(len(seqs)), key=lambda i: seqs[i].arrival_s)
        in_flight: set[int] = set()  # sent to the prefill process, no transfer back yet
        outputs: dict[int, RequestOutput] = {}
        index_of: dict[tuple[int, int], int] = {}  # (decode engine, request id) -> index
        while len(outputs) < len(seqs):
            if self.lost and (in_flight or unsent):
                for i in [*sorted(in_flight), *unsent]:
                    d = self._route()
                    index_of[d, self.decodes[d].enqueue(seqs[i])] = i  # at its arrival time
                self.stats.prefilled_here += len(in_flight) + len(unsent)
                in_flight, unsent = set(), []
            busy = any(engine.has_unfinished() for engine in self.decodes)
            try:
                transfer = self._exchange(seqs, unsent, in_flight, busy)
            except Exception:  # the pipe broke, or a transfer's shared memory is gone
                if not self._prefill_died():
                    raise
                continue
            if transfer is not None:
                d, request_id, done = self._admit(transfer, seqs[transfer.index])
                index_of[d, request_id] = transfer.index
                for out in done:
                    outputs[transfer.index] = out
                continue
            for d, engine in enumerate(self.decodes):
                if not engine.has_unfinished():
                    continue
                for out in engine.step():
                    if (d, out.request_id) in index_of:
                        outputs[index_of[d, out.request_id]] = out
            if not busy and not in_flight and unsent:
                time.sleep(max(0.0, min(seqs[unsent[0]].arrival_s - self.decode.clock(), 1.0)))
        return [outputs[i] for i in range(len(seqs))]

    def _route(self) -> int:
        """The decode engine that takes the next request (least-loaded), counted."""
        d = least_loaded([load_of(engine) for engine in self.decodes])
        self.stats.routed[d] += 1
        return d

    def _exchange(self, seqs: list, unsent: list, in_flight: set, busy: bool):
        """Send the prompts that are due (moved from `unsent` to `in_flight`); return a
        transfer that comes back before the decode engine has work (`busy`) or the next
        prompt is due, else None."""
        clock = self.decode.clock
        due = [i for i in unsent if seqs[i].arrival_s <= clock()]
        if due:
            del unsent[: len(due)]
            in_flight.update(due)
            self.conn.send(("prefill", [(i, seqs[i].prompt_ids, seqs[i].params) for i in due]))
        wait = 0 if busy else (max(0.0, seqs[unsent[0]].arrival_s - clock()) if unsent else None)
        if not in_flight or not self.conn.poll(wait):
            return None
        transfer = self._expect("kv")
        in_flight.discard(transfer.index)
        return transfer

    def _prefill_died(self) -> bool:
        """Whether the prefill process is dead (after up to 5 s); the first time, warn and
        set `lost`: from now on this pair prefills on the decode engine."""
        self.worker.join(timeout=5)
        if self.worker.is_alive():
            return False
        if self.lost is None:
            self.lost = (
                f"the prefill process (pid {self.worker.pid}) died ({exit_status(self.worker)})"
            )
            warnings.warn(f"{self.lost}: its prompts, and every later one, are prefilled on "
                          "the decode engine", RuntimeWarning, stacklevel=4)  # fmt: skip
        return True

    def _admit(self, transfer: KVTransfer, seq) -> tuple[int, int, list[RequestOutput]]:
        """Route a transfer to a decode engine, hand it to that engine's consumer connector
        and queue its request as an arrival (swapped in when it fits, its KV loaded through
        the connector), or, if its KV is bad, as a new request to recompute. Returns the
        engine's index, the request's id, and its output if its first token ends it."""
        d = self._route()
        engine, consumer, stats = self.decodes[d], self.consumers[d], self.stats
        stats.transfers += 1
        stats.bytes_moved += transfer.nbytes
        stats.prompt_tokens += len(transfer.prompt_ids)
        stats.prefill_s = transfer.prefill_s  # running totals: a step counts once
        stats.prefill_steps = transfer.prefill_steps
        consumer.receive(seq, transfer)
        matched, _ = consumer.get_num_new_matched_tokens(seq, 0)
        if not matched:
            stats.rejected += 1
            engine.enqueue(seq)  # recomputed from its prompt: never decoded on bad KV
            return d, seq.request_id, []
        seq.output_ids.append(transfer.first_token)
        seq.num_computed = matched
        seq.first_token_s = engine.clock()
        seq.token_times.append(seq.first_token_s)
        reason = engine._finish_reason(seq, transfer.first_token)
        if reason:
            consumer.request_finished(seq, [])
            return d, seq.request_id, engine._retire(seq, reason, engine.clock())
        engine.scheduler.add_arrived(seq, consumer)
        return d, seq.request_id, []

    def close(self) -> None:
        """Stop the prefill process (`prefill_blocks_held`: its cache's count at exit, None
        if it died; `prefill_record`: its engine's step count and step time from its own
        telemetry) and join it; close the decode engines. Idempotent."""
        if self.worker.is_alive():
            try:
                self.conn.send(("stop", None))
                self.prefill_record = self._expect("stopped")
                self.prefill_blocks_held = self.prefill_record["blocks_held"]
            except (EOFError, OSError):
                pass  # it died meanwhile
            self.worker.join(timeout=30)
        self._stop()
        for engine in self.decodes:
            engine.close()


def _stop(worker, conn) -> None:
    """Stop the prefill process (killed if it does not stop), join it, close the pipe."""
    if worker.is_alive():
        try:
            conn.send(("stop", None))
        except OSError:
            pass
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
            worker.join()
    conn.close()
