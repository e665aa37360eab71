"""The engine loop: one thread owns the engine; HTTP handlers talk to it through a queue.

The engine is not thread-safe, so every engine call happens on this thread. HTTP
handlers `submit` a validated, tokenized Job with a `Channel` (kvlab.serve.events) and
may `cancel` it; between steps the loop takes those commands and queues new requests (a
ValueError from the engine is a 400 on that request alone), runs `engine.step()` while
anything is unfinished (continuous batching), and after each step hands every request
its samples' new text through its Channel (`call_soon_threadsafe`: the event loop never
blocks on the engine). A cancel frees the request's blocks before the next step; stop
strings end a sample here, and the request is cancelled once all its samples are done.

The loop never dies of one request. What one request raises here (admission,
detokenizing) fails it alone, a 500 on its own channel, and the loop goes on; so does a
request the engine retired with finish_reason "error" (its forward or sampling raised).
Only an exception out of `engine.step()` itself (kvlab.integrity.EngineDead) means the
engine cannot go on: the loop is then `dead`, every request it held and every later one
gets a 503 at once, and /health says why.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvlab.build import Engine
from kvlab.engine.outputs import RequestOutput
from kvlab.sequence import RequestState, Sequence
from kvlab.serve.detokenize import TextStream
from kvlab.serve.events import Accepted, Channel, Delta, Done, Failed
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.protocol import Job

log = logging.getLogger("kvlab.serve")
# The engine's finish reasons in OpenAI's words ("stop" also for stop strings).
FINISH_REASONS = {"eos": "stop", "length": "length", "max_model_len": "length"}
HISTORY = 4096  # telemetry rows and scheduler events kept (a server runs for days)


@dataclass
class Tracked:
    """A request the loop serves: its job, channel, parent sequence and samples' text."""

    job: Job
    channel: Channel
    seq: Sequence
    texts: list[TextStream]  # per sample
    consumed: list[int] = field(init=False)  # per sample: tokens handed to its TextStream
    finish: list[str | None] = field(init=False)  # per sample: its finish reason once done
    last_token_s: list[float | None] = field(init=False)  # per sample
    admitted: bool = False

    def __post_init__(self) -> None:
        n = len(self.texts)
        self.consumed, self.finish, self.last_token_s = [0] * n, [None] * n, [None] * n


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServeMetrics | None = None, kv_events=None):
        """`kv_events`: the engine's KV event sink (kvlab.serve.kv_events), told after each
        step and each command that the events so far form a batch."""
        self.engine = engine
        self.metrics = metrics
        self.kv_events = kv_events
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[int, Tracked] = {}  # request id -> request
        self.by_channel: dict[int, int] = {}  # id(channel) -> request id
        self.steps = 0
        self.request_errors = 0  # requests failed by what they raised (the loop went on)
        self.dead: str | None = None  # why the engine cannot go on; None while it can
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)

    # --- the HTTP side (any thread) ----------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The loop runs and its engine can go on."""
        return self._thread.is_alive() and self.dead is None

    def submit(self, job: Job, channel: Channel) -> None:
        self.inbox.put(("add", job, channel))

    def cancel(self, channel: Channel, reason: str = "abort") -> None:
        self.inbox.put(("cancel", channel, reason))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the loop thread, between steps; its result via a Future."""
        future: Future = Future()
        self.inbox.put(("call", fn, future))
        return future

    # --- the loop thread -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            busy = self.dead is None and self.engine.has_unfinished()
            self._take_commands(block=not busy)
            self._end_events()
            if self._stopping or self.dead or not self.engine.has_unfinished():
                continue
            started = self.engine.clock()
            try:
                finished = self.engine.step()
            except Exception as error:  # EngineDead: no request to blame, it cannot go on
                self._die(error)
                continue
            self.steps += 1
            self._end_events()
            self._deliver(finished, started)
            self._trim()

    def _end_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.end_step()

    def _take_commands(self, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._do(command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _do(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1], command[2])
        elif kind == "cancel":
            self._cancel(command[1], command[2])
        elif kind == "call":
            fn, future = command[1], command[2]
            try:
                future.set_result(fn(self.engine))
            except Exception as error:
                future.set_exception(error)
        elif kind == "stop":
            self._stopping = True

    def _add(self, job: Job, channel: Channel) -> None:
        if self.dead:
            channel.put(Failed(f"the engine cannot go on: {self.dead}", 503))
            return
        engine = self.engine
        try:
            params = job.params
            if job.max_tokens is None:  # the rest of the context
                rest = max(1, engine.max_model_len - len(job.prompt_ids))
                params = replace(params, max_new_tokens=rest)
            seq = engine.make_sequence(job.prompt_ids, params, salt=job.salt)
            engine.enqueue(seq)
        except ValueError as error:  # the request asks what the engine cannot give
            channel.put(Failed(str(error)))
            return
        except Exception as error:  # noqa: BLE001 - it fails this request, never the loop
            self._blame(None, channel, "admission", error)
            return
        texts = [TextStream(engine.tokenizer, job.stop) for _ in range(params.n)]
        self.tracked[seq.request_id] = Tracked(job, channel, seq, texts)
        self.by_channel[id(channel)] = seq.request_id
        if self.metrics:
            self.metrics.request_added(params, job.tenant)
        channel.put(Accepted(seq.request_id, len(job.prompt_ids)))

    def _cancel(self, channel: Channel, reason: str) -> None:
        request_id = self.by_channel.get(id(channel))
        if request_id is None or request_id not in self.tracked:
            return
        tracked = self._forget(request_id)
        self.engine.cancel(request_id)  # frees its blocks now
        if self.metrics:
            self.metrics.request_aborted(reason, tracked.job.tenant)
            self.metrics.refresh(self.engine)

    def _forget(self, request_id: int) -> Tracked:
        tracked = self.tracked.pop(request_id)
        self.by_channel.pop(id(tracked.channel), None)
        return tracked

    def _blame(self, request_id: int | None, channel: Channel, stage: str, error) -> None:
        """Fail one request for what it raised at `stage` (500); the loop goes on."""
        self.request_errors += 1
        log.error("request %s failed at %s:\n%s", request_id, stage, traceback.format_exc())
        if request_id is not None and request_id in self.tracked:
            tenant = self._forget(request_id).job.tenant
            try:
                self.engine.cancel(request_id)
            except Exception:  # noqa: BLE001
                log.error("could not cancel request %d:\n%s", request_id, traceback.format_exc())
            if self.metrics:
                self.metrics.request_aborted("error", tenant)
        channel.put(Failed(f"{stage} failed: {type(error).__name__}: {error}", status=500))

    def _die(self, error: Exception) -> None:
        """The engine cannot go on: fail everything it held (503); refuse what comes."""
        self.dead = f"{type(error).__name__}: {error}"
        log.error("the engine cannot go on:\n%s", traceback.format_exc())
        for request_id in list(self.tracked):
            tracked = self._forget(request_id)
            tracked.channel.put(Failed(f"the engine cannot go on: {self.dead}", 503))

    # --- after each step -----------------------------------------------------------
    def _deliver(self, finished: list[RequestOutput], step_start: float) -> None:
        now, outputs = self.engine.clock(), {o.request_id: o for o in finished}
        for request_id, tracked in list(self.tracked.items()):
            output = outputs.get(request_id)
            try:
                if output is not None and output.finish_reason == "error":
                    self._engine_failed(request_id, tracked, output)
                else:
                    self._update(request_id, tracked, output, step_start, now)
            except Exception as error:  # noqa: BLE001 - it fails this request only
                self._blame(request_id, tracked.channel, "detokenizing", error)
        if self.metrics:
            self.metrics.step_done(self.engine)

    def _engine_failed(self, request_id: int, tracked: Tracked, output: RequestOutput) -> None:
        """The engine retired this request alone: its forward or sampling raised."""
        self.request_errors += 1
        self._forget(request_id)
        if self.metrics:
            self.metrics.request_aborted("error", tracked.job.tenant)
        message = getattr(output, "error", None) or "the engine failed this request"
        tracked.channel.put(Failed(f"engine error: {message}", status=500))

    def _update(self, request_id, tracked: Tracked, output, step_start: float, now) -> None:
        if not tracked.admitted and tracked.seq.status != RequestState.WAITING:
            tracked.admitted = True
            if self.metrics:
                self.metrics.request_admitted(tracked.seq, step_start, tracked.job.tenant)
        if output is not None:
            samples = [(s.token_ids, s.finish_reason) for s in output.samples]
        else:
            members = self.engine.samples(tracked.seq)
            samples = [(m.output_ids, m.finish_reason) for m in members]
        for index, (tokens, reason) in enumerate(samples):
            if tracked.finish[index] is None:
                self._advance(tracked, index, tokens, reason, now)
        if all(tracked.finish):
            self._complete(request_id, tracked, output, now)

    def _advance(self, tracked: Tracked, index: int, tokens, reason, now: float) -> None:
        new = tokens[tracked.consumed[index] :]
        if not new and reason is None:
            return
        if self.metrics and new:
            last = tracked.last_token_s[index]
            if index == 0 and last is None:
                self.metrics.first_token(tracked.seq, tracked.job.tenant)
            gap = None if last is None else now - last
            self.metrics.tokens(len(new), gap, tracked.job.tenant)
        tracked.consumed[index] = len(tokens)
        tracked.last_token_s[index] = now
        text = tracked.texts[index]
        text.add(new)
        finish = "stop" if text.stopped else FINISH_REASONS.get(reason) if reason else None
        delta = text.take(final=finish is not None)
        tracked.finish[index] = finish
        if delta or finish:
            tracked.channel.put(Delta(index, delta, finish))

    def _complete(self, request_id, tracked: Tracked, output: RequestOutput | None, now) -> None:
        seq = tracked.seq
        members = self.engine.samples(seq)
        preemptions = output.metrics.preemptions if output else sum(m.preemptions for m in members)
        if output is None:  # stop strings ended every sample: the engine still runs it
            self.engine.cancel(request_id)
        completion = sum(len(t.tokens) for t in tracked.texts)
        usage = {
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(seq.prompt_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": seq.prefix_hit_tokens},
        }
        extra = {
            "request_id": request_id,
            "prefix_hit_tokens": seq.prefix_hit_tokens,
            "preemptions": preemptions,
        }
        if self.metrics:
            tenant = tracked.job.tenant
            self.metrics.request_finished(seq, tracked.finish, completion, preemptions, now, tenant)
        self._forget(request_id)
        tracked.channel.put(Done(usage, extra))

    def _trim(self) -> None:
        """Drop history a long-running server does not need (outputs went to clients)."""
        engine = self.engine
        engine.finished.clear()
        for history in (engine.telemetry.records, engine.scheduler.events):
            if len(history) > 2 * HISTORY:
                del history[:-HISTORY]
        maps = engine.telemetry.block_maps
        if len(maps) > 2 * HISTORY:
            del maps[:-HISTORY]
