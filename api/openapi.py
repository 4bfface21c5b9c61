"""The OpenAPI document of the OpenAI-compatible routes (``/v1/...``), served at ``GET /openapi.json``.

Paths, methods and path parameters come from the app's routing table. A route's request body is the msgspec
struct named in its handler's ``opt[REQUEST_BODY]``, for the document only: the handler still reads the raw
body and decodes it itself, so every refusal stays in OpenAI's envelope. The bodies' JSON schema is msgspec's
own, so it describes exactly what the decoder accepts (``msgspec.Raw`` fields are free-form JSON, ``{}``).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import msgspec
from litestar import Litestar, Request, get
from litestar.handlers import HTTPRouteHandler
from litestar.routes import HTTPRoute

REQUEST_BODY = "request_body"  # handler opt key: the msgspec struct that describes the route's body
_PREFIX = "/v1/"
_REF = "#/components/schemas/{name}"
_BEARER = {"type": "http", "scheme": "bearer", "description": "A Weir API key (wk-...)."}
_NULLABLE_STRING = {"type": ["string", "null"]}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def openapi_document(app: Litestar) -> dict[str, Any]:
    """The document for ``app``'s routes under ``/v1/``, each behind a bearer API key."""
    handlers = [
        (route, handler)
        for route in app.routes
        if isinstance(route, HTTPRoute) and route.path_format.startswith(_PREFIX)
        for handler in route.route_handlers
        if handler.resolve_include_in_schema()
    ]
    paths: dict[str, dict[str, Any]] = {}
    for route, handler in handlers:
        for method in handler.http_methods:
            paths.setdefault(route.path_format, {})[method.lower()] = _operation(route, handler)
    bodies = [handler.opt[REQUEST_BODY] for _, handler in handlers if REQUEST_BODY in handler.opt]
    _, schemas = msgspec.json.schema_components(bodies, ref_template=_REF)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Weir", "version": version("weir")},
        "paths": paths,
        "components": {
            "schemas": {**schemas, "Error": _ERROR},
            "securitySchemes": {"bearer": _BEARER},
        },
        "security": [{"bearer": []}],
    }


def _operation(route: HTTPRoute, handler: HTTPRouteHandler) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": handler.handler_name,
        "parameters": [
            {"name": p.name, "in": "path", "required": True, "schema": msgspec.json.schema(p.type)}
            for p in route.path_parameters.values()
        ],
        "responses": {
            "200": {"description": "Success."},
            "default": {
                "description": "A refusal in OpenAI's error envelope.",
                "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}},
            },
        },
    }
    if body := handler.opt.get(REQUEST_BODY):
        ref = {"$ref": _REF.format(name=body.__name__)}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    return operation


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> dict[str, Any]:
    """The OpenAPI document (no key needed)."""
    return openapi_document(request.app)
