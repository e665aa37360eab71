"""The engine loop: one thread owns the engine; HTTP handlers talk to it through a queue.

The engine is not thread-safe, so every engine call happens on this thread. HTTP
handlers (on the asyncio event loop) `submit` a parsed Job with a `Channel`, and may
`cancel` it; the loop thread takes those commands between steps, validates and queues
new requests (a ValueError from the engine becomes a 400 on that request alone), runs
`engine.step()` while anything is unfinished (continuous batching: requests that arrive
while others run join the next step), and after each step hands every request the text
its samples produced, through its Channel (`call_soon_threadsafe`, so the event loop
never blocks on the engine).

A cancel (the client went away) calls `engine.cancel`, which frees the request's blocks
before the next step. Stop strings end a sample here too: when every sample of a
request has finished, the request is cancelled in the engine at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvlab.engine.engine import Engine
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.sequence import RequestState, Sequence
from kvlab.model.prompts import encode_messages
from kvlab.serve.detokenize import TextStream
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.protocol import Job

log = logging.getLogger("kvlab.serve")
# The engine's finish reasons in OpenAI's words ("stop" also for stop strings).
FINISH_REASONS = {"eos": "stop", "length": "length", "max_model_len": "length"}
HISTORY = 4096  # telemetry rows and scheduler events kept (a server runs for days)


# --- what the loop hands back, in order, through a request's Channel -----------------
@dataclass(frozen=True)
class Accepted:
    request_id: int
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    index: int  # the sample
    text: str  # its new text this step
    finish_reason: str | None  # "stop" | "length" once the sample is done


@dataclass(frozen=True)
class Done:
    usage: dict  # prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details
    kvlab: dict  # kvlab's own fields: prefix hits, preemptions


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 400


class Channel:
    """The asyncio side of one request: the loop thread puts events, a handler awaits."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    async def get(self):
        return await self._queue.get()


@dataclass
class Tracked:
    """A request the loop serves: its job, channel, parent sequence and samples' text."""

    job: Job
    channel: Channel
    seq: Sequence
    texts: list[TextStream]
    consumed: list[int]  # per sample: output tokens handed to its TextStream
    finish: list[str | None]  # per sample: its finish reason once done
    last_token_s: list[float | None] = field(default_factory=list)
    admitted: bool = False


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServeMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[int, Tracked] = {}  # request id -> request
        self.by_channel: dict[int, int] = {}  # id(channel) -> request id
        self.steps = 0
        self.step_errors = 0
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
        return self._thread.is_alive()

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
            busy = self.engine.has_unfinished()
            self._take_commands(block=not busy)
            if self._stopping or not self.engine.has_unfinished():
                continue
            started = self.engine.clock()
            try:
                finished = self.engine.step()
            except Exception as error:  # keep serving: fail what was running, go on
                self._fail_all(error)
                continue
            self.steps += 1
            self._deliver(finished, started)
            self._trim()

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
        engine = self.engine
        try:
            if job.kind == "chat":
                ids = encode_messages(engine.tokenizer, job.prompt)
            else:
                ids = engine.encode(job.prompt, chat=False)
            params = job.params
            if job.max_tokens is None:  # the rest of the context
                params = replace(params, max_new_tokens=max(1, engine.max_model_len - len(ids)))
            seq = engine.make_sequence(ids, params)
        except ValueError as error:
            channel.put(Failed(str(error)))
            return
        engine.enqueue(seq)
        n = params.n
        self.tracked[seq.request_id] = Tracked(
            job,
            channel,
            seq,
            [TextStream(engine.tokenizer, job.stop) for _ in range(n)],
            [0] * n,
            [None] * n,
            [None] * n,
        )
        self.by_channel[id(channel)] = seq.request_id
        if self.metrics:
            self.metrics.request_added(params)
        channel.put(Accepted(seq.request_id, len(ids)))

    def _cancel(self, channel: Channel, reason: str) -> None:
        request_id = self.by_channel.get(id(channel))
        if request_id is None or request_id not in self.tracked:
            return
        self.engine.cancel(request_id)  # frees its blocks now
        self._forget(request_id)
        if self.metrics:
            self.metrics.request_aborted(reason)
            self.metrics.refresh(self.engine)

    def _forget(self, request_id: int) -> None:
        tracked = self.tracked.pop(request_id)
        self.by_channel.pop(id(tracked.channel), None)

    # --- after each step -----------------------------------------------------------
    def _deliver(self, finished: list[RequestOutput], step_start: float) -> None:
        now, outputs = self.engine.clock(), {o.request_id: o for o in finished}
        for request_id, tracked in list(self.tracked.items()):
            output = outputs.get(request_id)
            if not tracked.admitted and tracked.seq.status != RequestState.WAITING:
                tracked.admitted = True
                if self.metrics:
                    self.metrics.request_admitted(tracked.seq, step_start)
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
        if self.metrics:
            self.metrics.step_done(self.engine)

    def _advance(self, tracked: Tracked, index: int, tokens, reason, now: float) -> None:
        new = tokens[tracked.consumed[index] :]
        if not new and reason is None:
            return
        if self.metrics and new:
            last = tracked.last_token_s[index]
            if index == 0 and last is None:
                self.metrics.first_token(tracked.seq)
            self.metrics.tokens(len(new), None if last is None else now - last)
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
            self.metrics.request_finished(seq, tracked.finish, completion, preemptions, now)
        self._forget(request_id)
        tracked.channel.put(Done(usage, extra))

    def _fail_all(self, error: Exception) -> None:
        self.step_errors += 1
        log.error("engine step failed:\n%s", traceback.format_exc())
        for request_id, tracked in list(self.tracked.items()):
            try:
                self.engine.cancel(request_id)
            except Exception:
                log.error("could not cancel request %d after the failure", request_id)
            self._forget(request_id)
            tracked.channel.put(Failed(f"engine error: {error}", status=500))

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
