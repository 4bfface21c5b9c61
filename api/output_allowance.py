"""The output tokens a request has reserved, and the engine's deltas held to them.

A request with ``max_tokens`` (or a completion, whose default is 16) reserves all of it and the engine stops
there. A chat request without one reserves a default allowance and extends it ahead of the engine while the
answer grows; once an extension is refused, exactly the reserved tokens reach the client and the bill, and
the answer ends with ``finish_reason: "length"`` (docs/api.md, "Output allowance").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.cost import CostWeights, request_cost
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.types import RequestOutput

CHAT_ALLOWANCE = 256  # output tokens reserved up front for a chat request without max_tokens
EXTENSION = 256  # output tokens added per extension
EXTEND_AHEAD = 32  # extend once the output comes this close to the reserved count


@dataclass
class OutputAllowance:
    """``reserved`` output tokens, never more than ``ceiling`` (the engine's own ``max_tokens``)."""

    reserved: int
    ceiling: int
    step: int = 0  # tokens per extension
    refused: bool = False  # an extension was refused: the output ends at ``reserved``
    ended: bool = False  # the last delta was let through; what the engine sends after is dropped
    _ids: list[int] = field(default_factory=list)  # output token ids let through
    _texts: list[str] = field(default_factory=list)  # and their text

    @classmethod
    def fixed(cls, max_tokens: int) -> OutputAllowance:
        """All of ``max_tokens``, reserved up front."""
        return cls(max_tokens, max_tokens)

    @classmethod
    def growing(
        cls, ceiling: int, prompt_tokens: int, per_minute: float | None, weights: CostWeights
    ) -> OutputAllowance:
        """``CHAT_ALLOWANCE`` tokens, or fewer when a minute's cost allowance affords fewer beside the prompt
        (at least one), extended by ``EXTENSION`` tokens, or by as many as a minute affords."""
        unit = request_cost(0, 0, 1, weights)
        if unit == 0:
            return cls.fixed(ceiling)
        affordable = step = ceiling
        if per_minute is not None:
            affordable = math.floor((per_minute - request_cost(prompt_tokens, 0, 0, weights)) / unit)
            step = math.floor(per_minute / unit)
        return cls(max(1, min(ceiling, CHAT_ALLOWANCE, affordable)), ceiling, max(1, min(EXTENSION, step)))

    def wanted(self, produced: int) -> int:
        """Tokens to add to the reservation now to stay ``EXTEND_AHEAD`` ahead of ``produced`` (0: none)."""
        done = self.ended or self.refused or self.reserved >= self.ceiling
        if done or produced + EXTEND_AHEAD < self.reserved:
            return 0
        return min(self.ceiling - self.reserved, max(self.step, produced + EXTEND_AHEAD - self.reserved))

    def grant(self, extra: int, granted: bool) -> None:
        """Record the answer to extending the reservation by ``extra`` tokens (a refusal is final)."""
        if granted:
            self.reserved += extra
        else:
            self.refused = True

    def bound(self, out: RequestOutput, tokenizer: Tokenizer, prompt_ids: list[int]) -> RequestOutput | None:
        """``out`` as far as the reservation covers it; ``None`` for what comes after the output was cut.
        A delta that reaches ``reserved`` before the engine ended is the last one (the caller aborts)."""
        if self.ended:
            return None
        if out.output_tokens > self.reserved or (out.output_tokens == self.reserved and not out.finished):
            return self._cut(out, tokenizer, prompt_ids)
        self._ids.extend(out.token_ids)
        self._texts.append(out.text)
        self.ended = out.finished
        return out

    def _cut(self, out: RequestOutput, tokenizer: Tokenizer, prompt_ids: list[int]) -> RequestOutput:
        """The last delta: the tokens up to ``reserved`` and their text as the engine would have ended it at
        that length."""
        keep = self.reserved - len(self._ids)
        self._ids.extend(out.token_ids[:keep])
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        text = detokenizer.push(self._ids) + detokenizer.flush()
        sent = "".join(self._texts)
        self.ended = True
        return dataclasses.replace(
            out,
            text=text[len(sent) :] if text.startswith(sent) else "",
            token_ids=out.token_ids[:keep],
            token_times=out.token_times[:keep],
            finished=True,
            finish_reason="length",
            output_tokens=self.reserved,
            error=None,
        )
