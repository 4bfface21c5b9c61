"""A fuzz run of the OpenAI-compatible routes: schemathesis generates requests, valid and invalid, from the
served ``/openapi.json`` and sends them to a real ``weir serve``. No answer may be a 5xx, every 4xx is
OpenAI's error envelope, and no 2xx carries an error."""

from __future__ import annotations

import re
from collections import defaultdict

import httpx
import schemathesis
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.api.server import ApiServer

EXAMPLES = 100  # per operation, valid and invalid cases together; derandomized, not shrunk
MAX_OUTPUT_TOKENS = 16  # the tenant's limit bounds every generation, and is the completions' default
BODIES = ("ChatCompletionRequest", "CompletionRequest")
DEFAULTS_ONLY = (
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "suffix",
    "best_of",
)
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
ERROR_LINE = re.compile(r'^(data: )?\{"error"', re.MULTILINE)  # an error body, or an error event in a stream


def openai_error_envelope(ctx: schemathesis.CheckContext, response: schemathesis.Response, case) -> None:
    """A 4xx is ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an error envelope: {response.text}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and error["message"], f"no message: {response.text}"


def no_error_in_answer(ctx: schemathesis.CheckContext, response: schemathesis.Response, case) -> None:
    """A 2xx carries no error, not even as an event of a stream that had started."""
    if 200 <= response.status_code < 300:
        assert not ERROR_LINE.search(response.text), f"an error in a {response.status_code}: {response.text}"


def _document(server: ApiServer) -> dict:
    """The served document narrowed so that valid bodies can succeed: the served model, and the free-form
    fields (tools, logit_bias, ...) and the fields Weir accepts only at their defaults (logprobs, penalties,
    echo, ...) null, since Weir refuses most of their values; negative cases still send other values there."""
    document = httpx.get(f"{server.base_url}/openapi.json").raise_for_status().json()
    model = httpx.get(f"{server.base_url}/readyz").json()["model"]
    for name in BODIES:
        properties = document["components"]["schemas"][name]["properties"]
        properties["model"] = {"enum": [model]}
        properties.update({field: {"type": "null"} for field, schema in properties.items() if schema == {}})
        properties.update({field: {"type": "null"} for field in DEFAULTS_ONLY if field in properties})
    return document


def test_fuzz_v1_routes(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(max_output_tokens=MAX_OUTPUT_TOKENS)
    schema = schemathesis.openapi.from_dict(_document(api_server))
    schema.config.update(base_url=api_server.base_url)
    schema.config.generation.update(with_security_parameters=False)  # every request carries the key
    statuses: dict[str, set[int]] = defaultdict(set)

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call_and_validate(
            headers={"Authorization": f"Bearer {key}"},
            checks=[not_a_server_error, openai_error_envelope, no_error_in_answer],
        )
        statuses[case.operation.label].add(response.status_code)

    for operation in schema.get_all_operations():
        given(case=st.one_of(operation.ok().as_strategy(mode) for mode in MODES))(fuzz)()
    # the run reached the handlers: some bodies were answered, others refused
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert {200, 400} <= statuses[label], dict(statuses)
