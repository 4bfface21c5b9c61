"""From a validated body to an admitted ``Job``: tokenize, bound the output, reserve, and shed what the
engine cannot serve within the tenant's TTFT target (docs/architecture.md, "A request's path", steps 4-6).
The shed checks also run before tokenizing, on a lower bound of the prompt, so that most refusals under
overload cost neither tokenization nor a reservation."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from functools import partial
from typing import TYPE_CHECKING

from api.backends import PromptSource
from api.errors import bad_request
from api.metering import Job
from api.openai_format import ResponseShape
from api.output_allowance import OutputAllowance
from api.refusals import overloaded
from api.schemas import ChatCompletionRequest, CompletionRequest
from api.settings import Settings
from api.tenant_store import TenantStore
from engine.cost import CostWeights, worst_case_cost
from engine.types import EngineStats, SamplingParams, TTFTEstimate
from tenants.auth import Principal

if TYPE_CHECKING:
    from api.services import ServedModel
    from engine import AsyncEngine
    from engine.tokenizer import Tokenizer

log = logging.getLogger("weir.api")


INLINE_TOKENIZE_CHARS = 8192  # larger inputs are tokenized on a worker thread, off the event loop
# Characters per token of context beyond which a prompt is refused before tokenizing: no text averages more
# (SmolLM2's longest token is 81 bytes of whitespace, ordinary text is about 4 characters a token).
MAX_CHARS_PER_TOKEN = 64
MAX_ESTIMATE_CORRECTION = 3.0  # the most the TTFT estimate is scaled up by its measured error


async def _prompt_ids(
    engine: AsyncEngine, body: ChatCompletionRequest | CompletionRequest
) -> tuple[list[int], str]:
    """The prompt's token ids and the parameter name to blame for it; a text the tokenizer or the chat
    template rejects is a 400, and one too long for the context is refused before it is tokenized."""
    tokenizer = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = body.chat_messages()
        param = "messages"
        size = sum(len(m["content"]) + len(m["role"]) + 16 for m in messages)  # 16: the template's markers
        tokenize = partial(tokenizer.apply_chat_template, messages)
    else:
        prompt = body.prompt_input()
        param = "prompt"
        if not isinstance(prompt, str):
            vocab = engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise bad_request(f"Token ids in 'prompt' must be in [0, {vocab}).", param=param)
            return list(prompt), param
        size = len(prompt)
        tokenize = partial(tokenizer.encode, prompt)
    context = engine.max_model_len
    if size > MAX_CHARS_PER_TOKEN * context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, and the {param} holds {size} "
            f"characters, more than that many tokens can hold. Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    try:
        ids = await asyncio.to_thread(tokenize) if size > INLINE_TOKENIZE_CHARS else tokenize()
    except Exception as exc:
        log.warning("could not tokenize the %s: %s", param, exc)
        raise bad_request(f"The {param} could not be tokenized: {exc}", param=param) from None
    return list(ids), param


def _prompt_tokens_at_least(body: ChatCompletionRequest | CompletionRequest) -> int:
    """A lower bound of the prompt's token count, known without tokenizing: exact for token ids, and for
    text its length over the most characters a token can average."""
    if isinstance(body, ChatCompletionRequest):
        size = sum(len(m["content"]) for m in body.chat_messages())
    else:
        prompt = body.prompt_input()
        if not isinstance(prompt, str):
            return len(prompt)
        size = len(prompt)
    return size // MAX_CHARS_PER_TOKEN


def _max_tokens(
    context: int,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    prompt_param: str,
) -> int:
    requested, param = body.requested_max_tokens(), body.max_tokens_param
    room = context - prompt_len
    limit = principal.quotas.max_output_tokens
    if room < 1 or (requested is not None and requested > room):
        asked = f"{prompt_len} in the prompt" + (f" + {requested} {param}" if requested is not None else "")
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested {asked}. "
            f"Please reduce the length of the {prompt_param} or {param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is not None and limit is not None and requested > limit:
        raise bad_request(
            f"{param} is too large: {requested}. This key allows at most {limit} output tokens.",
            param=param,
            code="invalid_value",
        )
    if requested is not None:
        return requested
    return min(room, limit or room, body.default_max_tokens or room)


def _output_allowance(
    weights: CostWeights,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    max_tokens: int,
) -> OutputAllowance:
    """All of ``max_tokens`` when the client set it (and for completions, whose default is 16); for a chat
    request without it, an allowance that grows with the answer."""
    if not isinstance(body, ChatCompletionRequest) or body.requested_max_tokens() is not None:
        return OutputAllowance.fixed(max_tokens)
    return OutputAllowance.growing(max_tokens, prompt_len, principal.quotas.cost_per_minute, weights)


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
    )


def _source(body: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer) -> PromptSource:
    if isinstance(body, ChatCompletionRequest):
        # special-token text in a message stays text on a backend that applies its own template, as here
        messages = [{**m, "content": tokenizer.plain_text(m["content"])} for m in body.chat_messages()]
        return PromptSource(messages=messages)
    return PromptSource(prompt=body.prompt_input())


def _estimate_correction(stats: EngineStats, estimate: TTFTEstimate) -> float:
    """What the TTFT estimate is multiplied by before it is held against a target: the 95th percentile of
    the recent actual / predicted ratios of the tenant's own requests when it has enough of them, else the
    engine's, else (right after a start, with too few for a tail) the engine's median, when the estimate
    has run short, capped at ``MAX_ESTIMATE_CORRECTION``. An estimate that runs long is left as it is
    (admission then errs towards running a request). The tail and not the median: under overload most
    admitted requests are predicted just within the target, and with the median half of them ended past
    it (TTFT p99 2.1-2.3 s against 2 s in a 3x load; 1.9 s with the 95th percentile)."""
    ratio = estimate.tenant_ratio_tail or stats.ttft_estimate_ratio_p95 or stats.ttft_estimate_ratio_p50
    return 1.0 if ratio is None else min(MAX_ESTIMATE_CORRECTION, max(1.0, ratio))


def _slo_limit(target_s: float, share_ratio: float) -> float:
    """The predicted TTFT beyond which a request is shed: the tenant's target, divided by how far its recent
    service exceeds its fair share. A tenant over its share is shed before the engine's queue reaches the
    target, which leaves the tenants under their share room to be admitted and served within theirs."""
    return target_s / max(1.0, share_ratio)


class Admission:
    """Admits requests to ``engine`` against the tenant store's quotas and the engine's bounds."""

    def __init__(
        self, engine: AsyncEngine, model: ServedModel, store: TenantStore, settings: Settings
    ) -> None:
        self._engine = engine
        self._model = model
        self._store = store
        self._max_waiting = settings.max_waiting
        self._deadline_grace_s = settings.deadline_grace_s
        self._fair = settings.engine.policy == "fair"
        self._weights = settings.weights

    async def admit(self, principal: Principal, body: ChatCompletionRequest | CompletionRequest) -> Job:
        """Validate, tokenize, reserve and admit one request; raises ``APIError`` for every refusal."""
        body.check_common()
        self._model.check(body.model)
        # Shed before any work, on a lower bound of the prompt's length (the checks grow with it): a refusal
        # under overload costs neither tokenization nor a reservation.
        self._shed(principal, _prompt_tokens_at_least(body))
        prompt_ids, prompt_param = await _prompt_ids(self._engine, body)
        max_tokens = _max_tokens(self._engine.max_model_len, principal, body, len(prompt_ids), prompt_param)
        output = _output_allowance(self._weights, principal, body, len(prompt_ids), max_tokens)
        params = _sampling(body, max_tokens)
        reservation = await self._store.reserve(
            principal, worst_case_cost(len(prompt_ids), output.reserved, self._weights)
        )
        try:
            # the prefill this request will compute: its prompt but what the prefix cache holds now
            cached = self._engine.cached_prefix_tokens(prompt_ids, str(principal.tenant_id))
            self._shed(principal, len(prompt_ids) - cached)
            rate_limit_headers = await self._store.rate_limit_headers(principal)
        except BaseException:
            self._store.release(reservation)
            raise
        chat = isinstance(body, ChatCompletionRequest)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        return Job(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            tenant_name=principal.tenant_name,
            key_id=principal.key_id,
            prompt_ids=prompt_ids,
            params=params,
            shape=ResponseShape(chat=chat, model=body.model, include_usage=body.include_usage, id=request_id),
            stream=bool(body.stream),
            reservation=reservation,
            output=output,
            rate_limit_headers=rate_limit_headers,
            tpot_target_s=principal.tenant.tpot_target_s,
            weight=principal.tenant.weight,
            start_within_s=principal.tenant.ttft_target_s + self._deadline_grace_s,
            source=_source(body, self._engine.tokenizer),
        )

    def _shed(self, principal: Principal, prompt_len: int) -> None:
        """Refuse now (503) what would queue past the tenant's TTFT target or past the engine's bounds;
        ``prompt_len`` is the prefill the request would compute."""
        stats = self._engine.stats()
        tenant = str(principal.tenant_id)
        reason = None
        retry_after = 1.0
        if self._queue_full(stats, tenant):
            reason = "queue"
        elif (
            stats.kv_blocks_total  # a pool of OpenAI-compatible servers reports no KV memory
            and self._waiting_ahead(stats, tenant)
            and math.ceil(prompt_len / stats.block_size) > stats.kv_blocks_free
        ):
            reason = "kv"  # requests served before it already wait for memory its prefill would need too
        else:
            # Shedding protects the work in the engine (prefill queued ahead, requests running: their decodes
            # share every step); on an idle engine, or with an estimate that rests on one step size only, the
            # request runs even if it would miss its target alone.
            estimate = self._engine.estimate_ttft(prompt_len, tenant, principal.tenant.weight)
            predicted = estimate.seconds * _estimate_correction(stats, estimate)
            limit = _slo_limit(principal.tenant.ttft_target_s, estimate.share_ratio)
            busy = estimate.queued_tokens > 0 or stats.running > 0
            if busy and estimate.reliable and predicted > limit:
                reason = "slo"
                retry_after = max(1.0, predicted - limit)
        if reason is None:
            return
        self._store.record_shed(principal.tenant_id, reason)
        raise overloaded(reason, retry_after)

    def _queue_full(self, stats: EngineStats, tenant: str) -> bool:
        """The engine's queue holds ``max_waiting`` requests and, under the fair policy, the tenant already
        has its share of the places (``max_waiting`` over the tenants waiting, itself included): a tenant
        flooding the queue cannot lock the others out of it (it may then exceed the cap by one place for
        each tenant)."""
        if stats.waiting < self._max_waiting:
            return False
        if not self._fair:
            return True
        tenants = len(stats.waiting_by_tenant.keys() | {tenant})
        return stats.waiting_by_tenant.get(tenant, 0) >= math.ceil(self._max_waiting / tenants)

    def _waiting_ahead(self, stats: EngineStats, tenant: str) -> int:
        """Waiting requests that the policy serves before a new one of ``tenant``: all of them first come
        first served; under the fair policy its own (the fair order takes it ahead of tenants over their
        share)."""
        return stats.waiting_by_tenant.get(tenant, 0) if self._fair else stats.waiting
