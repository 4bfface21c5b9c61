"""The OpenAPI document served at ``/openapi.json``."""

from __future__ import annotations

import httpx

from tests.api.server import ApiServer


def test_document_describes_the_v1_routes(api_server: ApiServer) -> None:
    response = httpx.get(f"{api_server.base_url}/openapi.json")  # no key needed
    assert response.status_code == 200, response.text
    document = response.json()
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
    }
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["security"] == [{"bearer": []}]

    chat = document["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = document["components"]["schemas"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    assert chat_fields["tools"] == {} and chat_fields["response_format"] == {}  # free-form JSON
    assert chat_fields["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert "user" in schemas["ChatMessage"]["properties"]["role"]["enum"]
    completion = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert completion["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    assert set(schemas["CompletionRequest"]["required"]) == {"model", "prompt"}

    retrieve = document["paths"]["/v1/models/{model_id}"]["get"]
    assert retrieve["parameters"] == [
        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    assert "requestBody" not in retrieve
    error = retrieve["responses"]["default"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/Error"}
    assert schemas["Error"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]
