"""Request and response bodies of the OpenAI-compatible API (pydantic), as the `openai` client sends
and reads them. Unknown request fields are accepted and ignored, as most OpenAI-compatible servers do;
fields that would change the output in ways this server cannot honour (echo, suffix, best_of > n with stream,
tools for a model whose chat template has none) are refused with 400.

Extensions beyond OpenAI's fields: `service_tier` takes `standard`, `ultrafast` or `auto`; sampling
extras `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and constrained decoding's `structured_outputs`
(`json`, `regex`, `grammar`, `choice`) with its older `guided_*` spellings (as vLLM names them), and vLLM's
`cache_salt` (KV rows reused only between requests of one key and one salt); responses carry
`time_info` (as Cerebras': queue, prompt, completion and total time, plus decode tokens/s and tau).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from ..sampler import REPETITION_PENALTY_RANGE

MAX_N = 16
MAX_STOP = 4


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = Field(
        False, description="as vLLM's: with include_usage, every chunk carries the usage so far")


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# token id (a decimal string, as OpenAI's) -> bias; said in full, pydantic's own schema would admit other keys
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})]


class TextPart(BaseModel):
    """A content part: this server reads text only (an image or audio part is a 400)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """text, json_object (any JSON object) or json_schema (output matching the schema), enforced by constrained
    decoding."""
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(BaseModel):
    """vLLM's constrained-decoding extension: exactly one of these."""
    model_config = ConfigDict(extra="allow")
    json_: Optional[Union[dict[str, Any], bool, str]] = Field(None, alias="json")
    regex: Optional[NonEmptyStr] = None
    grammar: Optional[NonEmptyStr] = None  # EBNF (xgrammar's GBNF dialect)
    choice: Optional[Annotated[list[str], Field(min_length=1)]] = None


class _Sampling(_Request):
    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)], None] = None
    # a 64-bit integer; the document's bounds are the doubles nearest inside +-2**63, so that a JSON client
    # comparing as doubles (where 2**63 + 1 rounds to 2**63) never deems an out-of-range seed within them
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer",
                                json_schema_extra={"minimum": -(2**63) + 1024, "maximum": 2**63 - 1024})
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[LogitBias] = Field(
        None, description="token id -> bias added to its logit (ids past the model's vocabulary: 400)")
    user: Optional[str] = None
    service_tier: Optional[Literal["standard", "ultrafast", "auto", "default"]] = Field(
        None, description="standard (default; 'default' is its alias), ultrafast (sold separately) or auto (the "
                          "best tier the key may use)")
    # extensions (vLLM's names)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: Optional[bool] = False
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[NonEmptyStr] = None
    guided_grammar: Optional[NonEmptyStr] = None
    guided_choice: Optional[Annotated[list[str], Field(min_length=1)]] = None
    cache_salt: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        None, description="KV rows are reused only between requests of the same key and the same salt (vLLM's "
                          "name): a client isolates its runs, or keeps one run's prompts from warming another's")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None


class CompletionRequest(_Sampling):
    # a text, texts, token ids, or lists of token ids; never empty (ids past the model's vocabulary: 400)
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[Literal[False]] = Field(False, description="not supported")
    suffix: Optional[Annotated[str, Field(max_length=0, description="not supported")]] = None
    best_of: Optional[int] = Field(None, ge=1, description="candidates sampled per prompt, of which the n with the "
                                   "highest log probability per token are returned (all are billed); not with stream")


# ------------------------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


class TimeInfo(BaseModel):
    queue_time: float = Field(description="seconds from arrival to a KV slot")
    prompt_time: Optional[float] = Field(None, description="seconds of prefill")
    completion_time: float = Field(description="seconds from the first token to the end")
    total_time: float = Field(description="seconds from arrival to the end")
    created: int
    decode_tokens_per_s: Optional[float] = None
    tau: Optional[float] = Field(None, description="ultrafast: tokens per pass over the weights")
    drafters: Optional[dict[str, dict]] = Field(
        None, description="ultrafast: per drafter, its passes, drafted and accepted tokens (the first choice's)")
    choice_tokens: Optional[list[int]] = Field(
        None, description="completion tokens of each choice, in index order (n > 1: the longest sets the wall-clock)")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: str
    system_fingerprint: Optional[str] = None
    time_info: TimeInfo


class ChunkDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # {index, id, type, function: {name, arguments}} deltas


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    service_tier: str
    system_fingerprint: Optional[str] = None
    usage: Optional[Usage] = None
    time_info: Optional[TimeInfo] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: Optional[list[dict[str, float]]] = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    service_tier: str
    system_fingerprint: Optional[str] = None
    time_info: Optional[TimeInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ultrafast"
    max_context: Optional[int] = None
    service_tiers: list[str] = ["standard", "ultrafast"]
    pricing: Optional[dict[str, dict[str, float]]] = Field(
        None, description="$ per million tokens per tier: input, cached_input, output")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageRecord(BaseModel):
    key_id: Optional[str]
    key_name: Optional[str]
    model: str
    tier: str
    day: str
    requests: int
    cancelled: int
    interrupted: int = 0
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float


class UsageReport(BaseModel):
    object: Literal["usage"] = "usage"
    key_id: Optional[str]
    data: list[UsageRecord]
    total_cost_usd: float
    total_requests: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ------------------------------------------------------------------------------------ the Responses API


class InputContentPart(BaseModel):
    """A content part of an input message: text (an image or a file is a 400)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputContentPart]]


class FunctionCallItem(BaseModel):
    """A call the model made earlier (an output item sent back as input)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """A tool's result, answering the call with the same call_id."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: Union[str, list[InputContentPart]]


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(BaseModel):
    """A function tool as the Responses API spells it (flat: no `function` wrapper); other tool types: 400."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: FunctionName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    """text, json_object, or json_schema (with the schema beside the type, not under json_schema)."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, max_length=64)
    description: Optional[str] = None
    schema_: Optional[Union[dict[str, Any], bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: Optional[TextFormat] = None


class ResponsesRequest(_Request):
    """POST /v1/responses. Sampling extensions (seed, top_k, min_p, repetition_penalty, ...) are read as in chat
    completions."""
    model: str = Field(min_length=1)
    input: Union[NonEmptyStr, Annotated[list[InputItem], Field(min_length=1)]]
    instructions: Optional[str] = None
    previous_response_id: Optional[NonEmptyStr] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: Optional[bool] = False
    store: Optional[bool] = True
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    service_tier: Optional[Literal["standard", "ultrafast", "auto", "default"]] = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response: its output items are `message` (output_text parts) and `function_call` items."""
    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: Optional[float] = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[dict[str, Any]] = None
    model: str
    output: list[dict[str, Any]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    tools: list[dict[str, Any]] = []
    tool_choice: Union[str, dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {}
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_output_tokens: Optional[int] = None
    store: bool = True
    metadata: dict[str, str] = {}
    user: Optional[str] = None
    truncation: str = "disabled"
    reasoning: dict[str, Any] = {}
    service_tier: str
    usage: Optional[ResponseUsage] = None
    time_info: Optional[TimeInfo] = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
