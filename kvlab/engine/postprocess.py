"""After the forward: logits become tokens, tokens become finished requests.

For each row of the batch that ran (`Postprocess._postprocess`):

1. its computed tokens count (`num_computed += n`); a prompt chunk yields nothing more
   until the whole prompt is in;
2. **speculation**: a row carrying drafts is verified (the accepted drafts and one token);
   the others sample one token each (a sampling error fails its request alone);
3. **forks**: a request with n > 1 forks its other samples at its first token;
4. the tokens are emitted up to the first that finishes the request, and speculation
   rolls the cache back past the rejected drafts;
5. finished samples retire (their blocks are freed, their session records them);
6. **retention**: each running sequence's policy may drop blocks now.

Tier work (saving released blocks, loading held ones) happens inside the cache, in
`free` and `stage` (kvlab.cache.tiers).
"""

from __future__ import annotations

import torch

from kvlab.engine.isolation import NEVER_ISOLATED, describe, group_of, sample_isolated
from kvlab.engine.outputs import RequestMetrics, RequestOutput, Sample
from kvlab.engine.sampler import sample
from kvlab.engine.scheduler import Batch
from kvlab.sequence import RequestState, Sequence


class Postprocess:
    """EngineCore's post-processing (a mixin: it reads the core's parts and queues)."""

    def _postprocess(self, batch: Batch, logits: list[torch.Tensor]) -> list[RequestOutput]:
        now, finished, failed = self.clock(), [], []
        for seq, n in batch:
            seq.num_computed += n
        ready = [row for row, seq in enumerate(batch.seqs) if seq.num_pending <= 0]
        tokens = self._tokens(batch, logits, ready, failed)
        for row in ready:
            seq = batch.seqs[row]
            speculated = bool(seq.draft_ids) or seq.spec_room > 0
            members = self._fork_at_first_token(seq, logits[row], tokens, row, failed)
            if row in tokens and not any(seq is f for f, _ in failed):
                finished += self._emit_all(seq, members, tokens[row], speculated, now)
            elif speculated:
                self.speculator.rollback(seq)
        for seq, error in failed:  # sampling, verification or a fork raised for these alone
            finished += self._retire_request(group_of(seq), "error", now, error)
        for seq in self.scheduler.running:  # a retention policy may drop blocks now (forks
            self.cache.retain(seq)  # made this step included: they copied a whole table)
        self.finished.extend(finished)
        return finished

    def _tokens(self, batch: Batch, logits: list, ready: list[int], failed: list) -> dict:
        """Row -> the tokens it emits: one sampled token, or (speculation) the accepted
        drafts and one more. Rows whose sampling or verification raised go to `failed`."""
        plain = [row for row in ready if not batch.seqs[row].draft_ids]
        sampled = {}
        if plain:  # (every row may have failed in the forward, or carry drafts)
            rows = torch.cat([logits[row] for row in plain])
            sampled, lost = sample_isolated(sample, rows, [batch.seqs[row] for row in plain])
            failed += lost
        tokens = {plain[i]: [token] for i, token in sampled.items()}
        for row in ready:
            seq = batch.seqs[row]
            if seq.draft_ids:
                try:
                    tokens[row] = self.speculator.verify(seq, logits[row])
                except NEVER_ISOLATED:
                    raise
                except Exception as error:
                    failed.append((seq, describe(error)))
        return tokens

    def _fork_at_first_token(self, seq, logits, tokens, row, failed) -> list[Sequence]:
        """The request's samples: `seq`, and (n > 1, at its first token) its new forks."""
        if row not in tokens or seq.first_token_s is not None:
            return [seq]
        try:
            return [seq, *self._fork(seq, logits[-1])]
        except NEVER_ISOLATED:
            raise
        except Exception as error:
            failed.append((seq, describe(error)))
            return [seq]

    def _emit_all(self, seq, members: list, tokens: list[int], speculated: bool, now) -> list:
        """Emit a row's tokens (speculation then rolls back past the rejected drafts);
        retire every sample (the row's and its new forks) that finished."""
        before = len(seq.output_ids)  # 0: this is the request's first token
        reason = self._emit(seq, tokens, now)
        if self.speculator and before:
            self.speculator.count_decode(len(seq.output_ids) - before)
        if speculated:
            self.speculator.rollback(seq)
        finished = []
        for member in members:
            member.first_token_s = member.first_token_s or now
            if member is not seq:
                reason = self._finish_reason(member, member.output_ids[-1])
            if reason:
                finished += self._retire(member, reason, now)
        return finished

    def _emit(self, seq: Sequence, tokens: list[int], now: float) -> str | None:
        """Append a row's tokens (one, or verified drafts + one) up to the first that
        finishes the request; return the finish reason, if any."""
        for token in tokens:
            seq.output_ids.append(token)
            seq.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason:
                return reason
        return None

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "eos"
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "max_model_len"
        return None

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> list[Sequence]:
        """n > 1: children that share the parent's prompt blocks, each with its first token."""
        children = []
        for i in range(1, parent.params.n):
            seed = None if parent.params.seed is None else parent.params.seed + i
            child = self._new_sequence(parent.prompt_ids, parent.params, seed)
            child.inherit(parent)
            child.output_ids.append(sample(logits[None], [child])[0])
            self.cache.fork(parent, child)
            self.scheduler.adopt(child)
            self.sessions.on_add(child, self.clock())
            children.append(child)
        self._groups[parent.request_id] = [parent, *children]
        return children

    # --- retiring ----------------------------------------------------------------------
    def _retire(
        self, seq: Sequence, reason: str, now: float, error: str | None = None
    ) -> list[RequestOutput]:
        """Finish one sample (its blocks are freed now); the request's output once every
        sample of it has finished."""
        seq.finish_s, seq.finish_reason, seq.error = now, reason, error
        seq.first_token_s = seq.first_token_s or now
        state = RequestState.CANCELLED if reason == "cancelled" else RequestState.FINISHED
        self.scheduler.finish(seq, state, now)
        self.sessions.on_finish(seq, now)
        group_id = group_of(seq)
        group = self._groups.get(group_id, [seq])
        if not all(m.is_finished for m in group):
            return []
        self._groups.pop(group_id, None)
        return [self._output(group)]

    def _members(self, request_id: int) -> list[Sequence]:
        """The unfinished samples of a request, wherever they wait or run."""
        queues = self.scheduler.waiting + self.scheduler.running + self.scheduler.swapped
        return [s for s in queues if request_id in (s.request_id, s.parent_id)]

    def _retire_request(
        self, request_id: int, reason: str, now: float, error: str | None = None
    ) -> list[RequestOutput]:
        """Retire every unfinished sample of a request (cancelled, or failed with `error`)."""
        members = self._members(request_id)
        return [out for seq in members for out in self._retire(seq, reason, now, error)]

    def _output(self, group: list[Sequence]) -> RequestOutput:
        samples = [
            Sample(
                list(m.output_ids),
                self.tokenizer.decode(m.output_ids, skip_special_tokens=True),
                m.finish_reason,
            )
            for m in group
        ]
        first = group[0]
        metrics = RequestMetrics(
            first.arrival_s,
            min(m.first_token_s for m in group),
            max(m.finish_s for m in group),
            len(first.output_ids),
            len(first.prompt_ids),
            first.prefix_hit_tokens,
            sum(m.preemptions for m in group),
            max(m.stall_s for m in group),
            tuple(first.token_times),
        )
        return RequestOutput(
            first.request_id,
            first.prompt_ids,
            samples[0].token_ids,
            samples[0].text,
            samples[0].finish_reason,
            metrics,
            samples,
            tuple(note for m in group for note in m.notes),
            next((m.error for m in group if m.error), None),
        )
