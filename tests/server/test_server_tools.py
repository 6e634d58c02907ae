"""Tools through the official openai client, on a checkpoint with a Qwen3.5-style template.

The rendered prompt must equal transformers' ``apply_chat_template`` for the same messages
and tools; ``tool_choice`` "required" or a named tool constrains decoding, so even this
random-weight model returns calls whose arguments validate against the tool's schema;
streamed calls assemble to the same calls as a whole response.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_helpers import ENGINE_OPTIONS, MODEL_NAME, LiveServer, start_server, wait_idle

from hybridkv.engine import EngineConfig, LLMEngine

TEMPLATE = (Path(__file__).parent / "qwen_tools_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
HISTORY = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def tool_server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = tmp_path_factory.mktemp("tools_ckpt")
    shutil.copytree(checkpoint, model_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    # A byte-level tokenizer makes the tools block ~900 tokens: a longer context than the
    # other server tests need.
    options = {**ENGINE_OPTIONS, "max_model_len": 2048, "cache_memory_gib": 0.3}
    server = start_server(LLMEngine(EngineConfig(model=str(model_dir), **options)))
    yield server
    server.stop()


@pytest.fixture
def tools_client(tool_server: LiveServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def tools_http(tool_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tool_server.base_url, timeout=120) as client:
        yield client


def transformers_render(
    model_dir: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    return hf.apply_chat_template(
        messages, tools=tools, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )


def rendered_prompt(http: httpx.Client, messages: list[Any], tools: list[Any] | None) -> str:
    tokens = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
    return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


@pytest.mark.parametrize("messages", [QUESTION, HISTORY], ids=["question", "history"])
def test_prompt_with_tools_equals_transformers(
    tool_server: LiveServer, tools_http: httpx.Client, messages: list[dict[str, Any]]
) -> None:
    ours = rendered_prompt(tools_http, messages, TOOLS)
    theirs = transformers_render(tool_server.engine.config.model, messages, TOOLS)
    assert ours == theirs
    tools_block = theirs[theirs.index("# Tools") : theirs.rindex("</tools>")]
    assert len(tools_block) > 400 and json.dumps(WEATHER) in tools_block
    without = rendered_prompt(tools_http, messages, None)
    assert "# Tools" not in without
    if messages is HISTORY:  # the call and its result are in the next prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in ours
        assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in ours


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_choice_returns_a_valid_call(tools_client: Any, seed: int) -> None:
    response = tools_client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        seed=seed,
    )
    [choice] = response.choices
    [call] = choice.message.tool_calls
    check_call(call, "get_weather")
    assert choice.finish_reason == "tool_calls"


def test_required_tool_choice_calls_one_of_the_tools(tools_client: Any) -> None:
    for seed in range(3):
        response = tools_client.chat.completions.create(
            model=MODEL_NAME,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            seed=seed,
        )
        [call] = response.choices[0].message.tool_calls
        check_call(call)


def test_tool_result_goes_back_and_the_conversation_continues(tools_client: Any) -> None:
    first = tools_client.chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
        temperature=0,
    )
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    second = tools_client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_tool_calls_assemble_to_the_same_calls(tools_client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = tools_client.chat.completions.create(**kwargs)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in tools_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == whole.choices[0].finish_reason == "tool_calls"


def test_auto_parses_calls_the_model_writes(tool_server: LiveServer) -> None:
    """Parsing with tool_choice auto: the tool parser on text as a model writes it."""
    from hybridkv.server.tool_parsers import get_tool_parser

    parser = get_tool_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": 1}}\n</tool_call>'
    )
    found = parser.extract(text)
    assert found.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("get_time", {"zone": 1}),
    ]
    stream = parser.stream()
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    content, calls, seen = "", [], ""
    for i, piece in enumerate(pieces):
        seen += piece
        new_content, new_calls = stream.feed(seen, final=i == len(pieces) - 1)
        content += new_content
        calls += new_calls
    assert content.strip() == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in found.calls]
    assert parser.extract("no calls here").calls == []
    assert parser.extract("<tool_call>not json</tool_call>").content == (
        "<tool_call>not json</tool_call>"
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(
    tools_http: httpx.Client, body: dict[str, Any], words: str
) -> None:
    response = tools_http.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": QUESTION, **body}
    )
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_legacy_functions_are_tools(tools_client: Any, tools_http: httpx.Client) -> None:
    response = tools_http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": QUESTION,
            "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"},
            "max_tokens": 120,
        },
    )
    assert response.status_code == 200, response.text
    [call] = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    wait_idle(tools_http)
