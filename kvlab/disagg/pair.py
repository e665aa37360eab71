"""Disaggregated: a decode engine here, a prefill engine in its own process."""

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
    rejected: int = 0  # corrupted or truncated: recomputed on the decode side
    prefill_s: float = 0.0  # prefill steps' wall time on the prefill side
    prefilled_here: int = 0  # in flight or not sent when the prefill process died


class Disaggregated:
    """Serve requests with prefill and decode on different engines (and processes).

        pair = Disaggregated(model, EngineConfig(cache="paged"), EngineConfig(cache="paged"))
        outputs = pair.generate(prompts, SamplingParams(max_new_tokens=64))
        pair.close()

    The decode engine (`pair.decode`) must swap (it admits transfers as swap-ins) and use
    the prefill engine's KV codec. `fault` ("corrupt" | "truncate") spoils every transfer
    after its checksum, to show detection and recompute.

    If the prefill process dies (a RuntimeWarning says so, and `lost` how it ended), the
    prompts it held and those not sent yet are prefilled on the decode engine, and the run
    carries on with the same greedy tokens. The pair then serves every later call on the
    decode engine alone; the prefill process is not restarted.
    """

    def __init__(
        self,
        model: LoadedModel,
        prefill: EngineConfig,
        decode: EngineConfig,
        fault: str | None = None,
    ):
        if prefill.kv_codec != decode.kv_codec:
            raise ValueError(
                f"prefill kv_codec={prefill.kv_codec!r} != decode kv_codec={decode.kv_codec!r}: "
                "the stored KV moves as it is"
            )
        self.decode = Engine(model, decode)
        if not self.decode.cache.swaps:
            raise ValueError(f"the decode engine's cache={decode.cache!r} cannot admit KV "
                             "from outside (it does not swap): use cache='paged'")  # fmt: skip
        self.stats = PairStats()
        self.consumer = PrefillDecodeConnector("kv_consumer", self.decode.cache)
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
        """Send prompts as they arrive, admit transfers as they come back, decode. Once the
        prefill process is dead, the prompts it held and the unsent ones are prefilled here."""
        engine = self.decode
        unsent = sorted(range(len(seqs)), key=lambda i: seqs[i].arrival_s)
        in_flight: set[int] = set()  # sent to the prefill process, no transfer back yet
        outputs: dict[int, RequestOutput] = {}
        index_of: dict[int, int] = {}  # decode request id -> index
        while len(outputs) < len(seqs):
            if self.lost and (in_flight or unsent):
                for i in [*sorted(in_flight), *unsent]:
                    index_of[engine.enqueue(seqs[i])] = i  # queued at its arrival time
                self.stats.prefilled_here += len(in_flight) + len(unsent)
                in_flight, unsent = set(), []
            busy = engine.has_unfinished()
            try:
                transfer = self._exchange(seqs, unsent, in_flight, busy)
            except Exception:  # the pipe broke, or a transfer's shared memory is gone
                if not self._prefill_died():
                    raise
                continue
            if transfer is not None:
                request_id, done = self._admit(transfer, seqs[transfer.index])
                index_of[request_id] = transfer.index
                for out in done:
                    outputs[transfer.index] = out
                continue
            if busy:
                for out in engine.step():
                    if out.request_id in index_of:
                        outputs[index_of[out.request_id]] = out
            elif not in_flight and unsent:
                time.sleep(max(0.0, min(seqs[unsent[0]].arrival_s - engine.clock(), 1.0)))
        return [outputs[i] for i in range(len(seqs))]

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

    def _admit(self, transfer: KVTransfer, seq) -> tuple[int, list[RequestOutput]]:
        """Hand a transfer to the consumer connector and queue its request as an arrival
        (swapped in when it fits, its KV loaded through the connector), or, if its KV is
        bad, as a new request to recompute. Returns its id and its output if its first
        token ends it."""
        engine, stats = self.decode, self.stats
        stats.transfers += 1
        stats.bytes_moved += transfer.nbytes
        stats.prefill_s += transfer.prefill_s
        self.consumer.receive(seq, transfer)
        matched, _ = self.consumer.get_num_new_matched_tokens(seq, 0)
        if not matched:
            stats.rejected += 1
            engine.enqueue(seq)  # recomputed from its prompt: never decoded on bad KV
            return seq.request_id, []
        seq.output_ids.append(transfer.first_token)
        seq.num_computed = matched
        seq.first_token_s = engine.clock()
        seq.token_times.append(seq.first_token_s)
        reason = engine._finish_reason(seq, transfer.first_token)
        if reason:
            self.consumer.request_finished(seq, [])
            return seq.request_id, engine._retire(seq, reason, engine.clock())
        engine.scheduler.add_arrived(seq, self.consumer)
        return seq.request_id, []

    def close(self) -> None:
        """Stop the prefill process (`prefill_blocks_held`: its cache's count at exit, None
        if it died) and join it; close the decode engine. Idempotent."""
        if self.worker.is_alive():
            try:
                self.conn.send(("stop", None))
                self.prefill_blocks_held = self._expect("stopped")
            except (EOFError, OSError):
                pass  # it died meanwhile
            self.worker.join(timeout=30)
        self._stop()
        self.decode.close()


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
