"""Request bodies of the OpenAI-compatible routes as msgspec structs (unknown fields are ignored)."""

from __future__ import annotations

from typing import Annotated, ClassVar, TypeVar

import msgspec

from api.errors import bad_request, from_decode_error

T = TypeVar("T")
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # per stop sequence
MAX_MESSAGES = 1024
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _null() -> msgspec.Raw:
    """JSON null: the default of the free-form fields (a factory, so msgspec can write their JSON schema)."""
    return msgspec.Raw(b"null")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    # the enum is for the JSON schema; chat_messages() checks the role with a clearer error
    role: Annotated[str, msgspec.Meta(extra_json_schema={"enum": sorted(CHAT_ROLES)})]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields both completion routes share."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted only with values that leave the response as Weir produces it (see unsupported()).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: msgspec.Raw = msgspec.field(default_factory=_null)
    tool_choice: msgspec.Raw = msgspec.field(default_factory=_null)
    functions: msgspec.Raw = msgspec.field(default_factory=_null)
    function_call: msgspec.Raw = msgspec.field(default_factory=_null)
    response_format: msgspec.Raw = msgspec.field(default_factory=_null)
    logit_bias: msgspec.Raw = msgspec.field(default_factory=_null)

    @property
    def max_tokens_param(self) -> str:
        """The name the client used for the output limit (for error messages)."""
        return "max_tokens"

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences.", param="stop")
        if any(not s for s in stops):
            raise bad_request("'stop' sequences must be non-empty strings.", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise bad_request(
                f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long.", param="stop"
            )
        return tuple(stops)

    def unsupported(self) -> list[str]:
        """The fields set to something that would change the response in ways Weir does not implement."""
        names = [n for n in ("logprobs", "top_logprobs") if getattr(self, n) not in (None, False, 0)]
        names += [n for n in ("presence_penalty", "frequency_penalty") if getattr(self, n) not in (None, 0)]
        raw = {
            name: msgspec.json.decode(getattr(self, name))
            for name in (
                "tools",
                "tool_choice",
                "functions",
                "function_call",
                "response_format",
                "logit_bias",
            )
        }
        names += [n for n in ("tools", "functions", "logit_bias") if raw[n] not in (None, [], {})]
        names += [n for n in ("tool_choice", "function_call") if raw[n] not in (None, "none", "auto")]
        if raw["response_format"] not in (None, {"type": "text"}):
            names.append("response_format")
        return names

    def check_common(self) -> None:
        unsupported = self.unsupported()
        if unsupported:
            raise bad_request(
                f"Weir does not support {', '.join(repr(n) for n in unsupported)} with these values; "
                "remove them from the request.",
                param=unsupported[0],
                code="unsupported_parameter",
            )
        if self.n not in (None, 1):
            raise bad_request("Only n=1 is supported: one choice per request.", param="n")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    # minItems is for the JSON schema; chat_messages() checks it with a clearer error
    messages: Annotated[list[ChatMessage], msgspec.Meta(extra_json_schema={"minItems": 1})]
    max_completion_tokens: PositiveInt | None = None

    default_max_tokens: ClassVar[int | None] = None  # the rest of the context (see api/output_allowance.py)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as plain role/content dicts for the chat template; text parts only."""
        if not self.messages:
            raise bad_request("'messages' must contain at least one message.", param="messages")
        if len(self.messages) > MAX_MESSAGES:
            raise bad_request(f"'messages' may hold at most {MAX_MESSAGES} messages.", param="messages")
        out = []
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise bad_request(
                    f"Invalid role '{message.role}'; expected one of {', '.join(sorted(CHAT_ROLES))}.",
                    param=f"messages[{i}].role",
                )
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise bad_request(
                        "Only text content parts are supported.", param=f"messages[{i}].content"
                    )
                content = "".join(part.text or "" for part in content)
            out.append(
                {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
            )
        return out


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        return names + [
            n for n in ("echo", "suffix", "best_of") if getattr(self, n) not in (None, False, "", 1)
        ]

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's; capped by the context and the key's limit

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        """The one prompt as text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list):
            if all(isinstance(p, str) for p in prompt) and len(prompt) == 1:
                prompt = prompt[0]
            elif any(isinstance(p, str) for p in prompt):
                raise bad_request(
                    "Only one prompt per request is supported: a string or a list of token ids.",
                    param="prompt",
                )
        if not prompt:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return prompt


def decode_body(body: bytes, struct: type[T]) -> T:
    """Decode a request body, turning every malformed or invalid input into a 400 envelope."""
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    except RecursionError:
        raise bad_request("The JSON body is nested too deeply.", code="invalid_json") from None
