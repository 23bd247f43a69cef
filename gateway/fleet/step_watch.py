"""A replica's engine steps, as its streams show them.

vLLM V1 gives every decoding request one token per engine step, so a token on a stream marks a
step's end (vllm/v1/core/sched/scheduler.py, `update_from_output`: one sampled token per running
request per step). The gateway keeps the last step end it saw on each replica and how long a
step of decodes alone lasts there: a request sent while only decodes run waits for the step
under way (routing/prefill_steps.py `decode_step_rest_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_STEP_EWMA_WEIGHT = 0.1  # ~the last 10 gaps between two tokens of a stream
MIN_STEP_S = 0.001
# Two tokens closer than this are one engine step's (several streams, or one read split in
# two): no vLLM step is that short, a decode step alone reads every weight from HBM (3.4 ms for
# Llama-3.1-8B on an H200, loadtest/sim/steps.py STEP_OVERHEAD_S).
SAME_STEP_SHARE = 0.5  # tokens within half a decode step of the last step end seen are its


@dataclass(slots=True)
class StepWatch:
    end_s: float | None = None  # perf_counter of the last step end seen
    decode_s: float = 0.0  # moving average of a step of decodes alone (0: none seen)
    streams: int = 0  # streams past their first token and before their last: decoding
    until_s: float = 0.0  # when they will all have had their last token, at the latest

    def token(self, at_s: float, decode_since_s: float | None) -> None:
        """A token came at `at_s`; `decode_since_s`: the same stream's previous token, when
        only decodes ran between the two (the gap is then a decode step), else None."""
        last = self.end_s
        if last is None or at_s - last >= max(MIN_STEP_S, SAME_STEP_SHARE * self.decode_s):
            self.end_s = at_s  # the first token read of a step is nearest its end
        if decode_since_s is None:
            return
        gap = at_s - decode_since_s
        if gap < MIN_STEP_S:
            return
        if self.decode_s <= 0.0:
            self.decode_s = gap
        else:
            self.decode_s += DECODE_STEP_EWMA_WEIGHT * (gap - self.decode_s)

    def stream_started(self, at_s: float, tokens_left: float) -> None:
        self.streams += 1
        self.decoding(at_s, tokens_left)

    def decoding(self, at_s: float, tokens_left: float) -> None:
        """A stream has up to `tokens_left` tokens to come after the one at `at_s` (inf:
        unbounded); tokens come a decode step apart (or slower, beside prefills)."""
        self.until_s = max(self.until_s, at_s + tokens_left * self.decode_s)

    def stream_ended(self) -> None:
        self.streams -= 1
        if self.streams <= 0:
            self.until_s = 0.0

    def seen(self, now_s: float) -> tuple[float | None, float, float]:
        """What routing.cost.Load takes of it at `now_s`: how long ago the last step end was
        seen (None: never), a decode step's length while some stream decodes (0 when none
        does: answers not streamed are not seen, and count as not decoding), and for how long
        the streams may still decode. One call: it is asked per candidate per decision."""
        end_s = self.end_s
        ago_s = None if end_s is None else max(0.0, now_s - end_s)
        step_s = self.decode_s if self.streams > 0 else 0.0
        return ago_s, step_s, max(0.0, self.until_s - now_s)


def mid_stream_token(chunk: bytes) -> bool:
    """Does the chunk carry a token that does not end its choice? Such a token came at the end
    of an engine step. The events after the last token (its finish, the usage, [DONE]) may come
    much later (an engine writing the KV out first) and mark no step. vLLM and SGLang write
    their chunks as compact JSON; a spaced writer is read too."""
    return b'"finish_reason":null' in chunk or b'"finish_reason": null' in chunk


def last_token(chunk: bytes) -> bool:
    """Does the chunk end a choice (a finish reason)? Its stream decodes no more. With n > 1
    choices the first to end counts for the stream."""
    return b'"finish_reason":"' in chunk or b'"finish_reason": "' in chunk
