"""The chat template in a real llama.cpp chat entry point: ``llama-server --jinja`` of the tree
llama-cpp-python vendors (built once, tests/llama_tree.py), on a set k3lab converted with no
``--chat-template``: it takes the embedded template, renders OpenAI-API chats to Moonshot's text
(``POST /apply-template``), and answers a chat.

What llama-server does to a request before the template sees it is its own (common/chat.cpp): a
tool declared without ``description`` gets an empty one, message-level ``tools`` and a tool result's
``tool`` key are dropped, JSON-string arguments are parsed into objects, ``developer`` becomes
``system``; ``thinking``, ``thinking_effort``, ``tool_choice`` and ``response_format`` reach the
template only through ``chat_template_kwargs``. The chats here are what the API carries losslessly.

Slow: building llama-server takes several minutes on two cores the first time.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import moonshot as judges
import pytest
from conftest import wait_until

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Weather for a city ("today")',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "units": null, "detail": 0.5}'}}  # fmt: skip
CHATS: list[tuple[dict, dict]] = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, {}),
    (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi & bye"}]},
        {"thinking": False},
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Call the tool.",
                    "tool_calls": [CALL],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "user", "content": "Thanks. 北京呢?"},
            ],
            "tools": TOOLS,
        },
        {"thinking_effort": "low", "tool_choice": "required"},
    ),
    (
        {"messages": [{"role": "user", "content": "JSON please"}]},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object"}},
            }
        },
    ),
]


def _moonshots(tok: Any, body: dict, kwargs: dict) -> str:
    """Moonshot's text for the chat as the API carries it (arguments parsed, as llama-server does)."""
    messages = json.loads(json.dumps(body["messages"]))
    for m in messages:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return tok.apply_chat_template(
        messages, tools=body.get("tools"), tokenize=False, add_generation_prompt=True, **kwargs
    )


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def server(tiny_one: Path, tmp_path_factory: pytest.TempPathFactory):
    from llama_tree import llama_server

    binary = llama_server()
    (gguf_file,) = tiny_one.glob("*.gguf")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(gguf_file), "--jinja", "--host", "127.0.0.1", "--port", str(port), "-c", "1024"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:

        def up() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return proc.poll() is not None

        assert wait_until(up, 120) and proc.poll() is None, log.read_text()[-2000:]
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("k", range(len(CHATS)))
def test_llama_server_renders_moonshots_text_with_the_embedded_template(
    server: int, tiny_src: Path, k: int
) -> None:
    body, kwargs = CHATS[k]
    expected = _moonshots(judges.tokenizer(tiny_src), body, kwargs)
    answer = _post(server, "/apply-template", {**body, "chat_template_kwargs": kwargs})
    assert answer["prompt"] == expected


def test_llama_server_chats_with_it(server: int) -> None:
    """A chat completion with no --chat-template: the reply comes back in the think channel the
    template opens (llama-server's parser takes it as reasoning)."""
    answer = _post(
        server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    )
    message = answer["choices"][0]["message"]
    assert answer["usage"]["completion_tokens"] == 6 and (
        message.get("reasoning_content") or message.get("content")
    )
    started = time.time()
    off = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "chat_template_kwargs": {"thinking": False},
        },
    )
    assert off["choices"][0]["message"].get("content") is not None and time.time() - started < 60
