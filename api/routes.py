"""The OpenAI-compatible routes and the health probes."""

from __future__ import annotations

import logging

from litestar import Request, Response, get, post
from litestar.exceptions import InternalServerException
from litestar.types import ASGIApp

from api import tracing
from api.connection_slots import mark_authenticated
from api.errors import APIError
from api.openapi import REQUEST_BODY
from api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, decode_body
from api.services import Services
from api.sse_response import CompletionResponse
from tenants.auth import Principal

log = logging.getLogger("weir.api")


async def _read_body(request: Request) -> bytes:
    """The whole body. A client that leaves before sending it (or is cut off by the body deadline) is
    logged at INFO; the 400 raised goes nowhere."""
    try:
        return await request.body()
    except InternalServerException:  # Litestar's word for a disconnect while the body streams in
        log.info("%s %s: client left before sending the whole body", request.method, request.url.path)
        raise APIError(400, "The request body was not received in full.", code="incomplete_body") from None


async def _authenticate(request: Request, services: Services) -> Principal:
    """The caller's principal (or a 401); its connection then counts as authenticated (a kept slot)."""
    principal = await services.store.authenticate(request.headers.get("authorization"))
    mark_authenticated(request.scope)
    return principal


async def _completion(request: Request, struct: type[SamplingFields], operation: str) -> ASGIApp:
    services: Services = request.app.state.services
    services.check_accepting()
    services.drain.enter()  # the response leaves the drain once it has ended
    try:
        telemetry = tracing.begin(request.app.state.telemetry, operation)
        with telemetry.child("auth"):
            principal = await _authenticate(request, services)
        async with services.store.rate_limit_headers_on_refusal(principal):
            body = decode_body(await _read_body(request), struct)
            with telemetry.generation(body, principal):
                job = await services.admission.admit(principal, body)
    except BaseException:
        services.drain.leave()
        raise
    return CompletionResponse(
        job, services.engine, services.settlement, services.drain, services.settings.client_timeout_s
    )


@post("/v1/chat/completions", status_code=200, opt={REQUEST_BODY: ChatCompletionRequest})
async def chat_completions(request: Request) -> ASGIApp:
    return await _completion(request, ChatCompletionRequest, "chat")


@post("/v1/completions", status_code=200, opt={REQUEST_BODY: CompletionRequest})
async def completions(request: Request) -> ASGIApp:
    return await _completion(request, CompletionRequest, "text_completion")


@get("/v1/models")
async def list_models(request: Request) -> dict:
    services: Services = request.app.state.services
    services.check_accepting()
    await _authenticate(request, services)
    return {"object": "list", "data": [services.model.card()]}


@get("/v1/models/{model_id:str}")
async def retrieve_model(request: Request, model_id: str) -> dict:
    services: Services = request.app.state.services
    services.check_accepting()
    await _authenticate(request, services)
    services.model.check(model_id)
    return services.model.card()


@get("/healthz")
async def healthz() -> dict:
    """The process is up (the model may still be loading)."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready once the model is loaded and the database answers, until a stop signal starts the drain."""
    services: Services = request.app.state.services
    draining = services.drain.draining
    database = await services.store.reachable() if services.ready else False
    ready = services.ready and database and not draining
    body = {
        "ready": ready,
        "model": services.model.name if services.ready else None,
        "database": database,
        "draining": draining,
        "in_flight": services.drain.open,  # completion requests admitted or in admission
    }
    return Response(body, status_code=200 if ready else 503)


ROUTES = [chat_completions, completions, list_models, retrieve_model, healthz, readyz]
