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

import contextlib
import json
import shlex
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
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


@contextlib.contextmanager
def _serving(command: str, cwd: Path, log: Path) -> Iterator[int]:
    """``command`` (a llama-server line, its ``--port 8080`` given a free port) run by bash in ``cwd``,
    until it answers /health; stopped on leaving. Yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {command.replace('--port 8080', f'--port {port}')}"], cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
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


@pytest.fixture(scope="module", params=["upstream", "unsloth-fork"])
def server(
    request: pytest.FixtureRequest, tiny_src: Path, tiny_one: Path, tmp_path_factory: pytest.TempPathFactory
):
    """llama-server on a set k3lab converted: upstream's, and unsloth's fork's (the one that runs K3's
    vision; it is given the set's mmproj too, which it loads at start: skipped loudly where its tree is
    not)."""
    from llama_tree import fork_server, llama_server

    from k3lab.cli import main

    binary = fork_server() if request.param == "unsloth-fork" else llama_server()
    (gguf_file,) = tiny_one.glob("*.gguf")
    extra: list[str] = []
    if request.param == "unsloth-fork":
        mmproj = tmp_path_factory.mktemp("mmproj") / "mmproj-Kimi-K3-BF16.gguf"
        assert main(["vision", "--meta", str(tiny_src), "--out", str(mmproj)]) == 0
        extra = ["--mmproj", str(mmproj)]
    command = shlex.join([str(binary), "-m", str(gguf_file), "--jinja", "--host", "127.0.0.1", "--port", "8080",
                          "-c", "1024", *extra])  # fmt: skip
    folder = tmp_path_factory.mktemp("server")
    with _serving(command, folder, folder / "server.log") as port:
        yield port


@pytest.mark.parametrize("k", range(len(CHATS)))
def test_llama_server_renders_moonshots_text_with_the_embedded_template(
    server: int, tiny_src: Path, k: int
) -> None:
    body, kwargs = CHATS[k]
    expected = _moonshots(judges.tokenizer(tiny_src), body, kwargs)
    answer = _post(server, "/apply-template", {**body, "chat_template_kwargs": kwargs})
    assert answer["prompt"] == expected


EMPTY_THINKING = "<|open|>think<|sep|><|close|>think<|sep|>"
WHOLE_CHARACTERS = "root ::= [^\\x00]*"  # GBNF: any character but NUL (docs/running.md's, for the fork)


@pytest.mark.parametrize("thinking", [True, False])
def test_a_trailing_assistant_message_is_prefilled_as_moonshot_writes_it(
    server: int, tiny_src: Path, thinking: bool
) -> None:
    """A chat ending in an assistant message (a prefill): llama-server renders the messages before it
    and builds the assistant's opening itself (common/chat-auto-parser-generator.cpp, from the reasoning
    markers it found in the template), so the template never sees that message. Measured: with
    thinking on it is Moonshot's text of the whole chat, cut where the message would close; with
    thinking off llama-server still opens and closes an empty thinking channel that Moonshot's text
    has not (the runtime's own: docs/chat-template.md says so)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    whole = judges.tokenizer(tiny_src).apply_chat_template(messages, tokenize=False, thinking=thinking)
    cut = whole[: whole.index("The answer is") + len("The answer is")]
    answer = _post(
        server, "/apply-template", {"messages": messages, "chat_template_kwargs": {"thinking": thinking}}
    )
    if thinking:
        assert answer["prompt"] == cut
    else:
        at = cut.index("<|open|>response<|sep|>")
        assert EMPTY_THINKING not in cut and answer["prompt"] == cut[:at] + EMPTY_THINKING + cut[at:]


def test_llama_server_chats_with_it(server: int, request: pytest.FixtureRequest) -> None:
    """A chat completion with no --chat-template: the reply comes back in the think channel the
    template opens (llama-server's parser takes it as reasoning). The fork's parser refuses a reply
    holding malformed UTF-8 (HTTP 500, "does not match the expected peg-native format"), which the
    demo's random weights make at once: there the grammar docs/running.md gives keeps it to whole
    characters."""
    ascii_only = {"grammar": WHOLE_CHARACTERS} if request.node.callspec.params["server"] != "upstream" else {}
    answer = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **ascii_only},
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
            **ascii_only,
        },
    )
    assert off["choices"][0]["message"].get("content") is not None and time.time() - started < 60


def _page_blocks(name: str) -> list[str]:
    import re

    from conftest import ROOT

    return re.findall(r"^```sh\n(.*?)^```", (ROOT / name).read_text(), re.S | re.M)


def test_the_running_pages_commands_chat_with_the_demos_set(tmp_path: Path) -> None:
    """docs/running.md as a user follows it after `make demo`: its `llama-server` command (this tree's
    build, another port) on the demo's set, then its `curl` chats, as written: each answers a chat.
    (Its vision commands: the next test.)"""
    import os
    import sys

    from llama_tree import llama_server

    binary = llama_server()
    demo = subprocess.run([sys.executable, "-m", "k3lab.cli", "demo"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-2000:]
    blocks = _page_blocks("docs/running.md")
    (start,) = [b for b in blocks if b.startswith("llama-server ")]
    assert start in _page_blocks("README.md")  # (the README's Run it: the same command)
    (chats,) = [b for b in blocks if b.startswith("curl ")]
    command = start.strip().replace("llama-server", str(binary), 1)
    with _serving(command, tmp_path, tmp_path / "server.log") as port:
        said = subprocess.run(["bash", "-e", "-c", chats.replace("127.0.0.1:8080", f"127.0.0.1:{port}")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=os.environ)  # fmt: skip
    assert said.returncode == 0, said.stderr
    answers, text, decoder = [], said.stdout.strip(), json.JSONDecoder()
    while text:  # (curl -s prints each answer without a newline after it)
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].strip()
    assert len(answers) == 2 and all(a["choices"][0]["message"] for a in answers), said.stdout[-2000:]


def test_the_running_pages_vision_commands_run_in_unsloths_fork(tmp_path: Path) -> None:
    """docs/running.md's vision commands, as written, on the demo's set and mmproj with unsloth's fork
    built from its tree (its clone and build lines aside: the tests build the same targets from the
    tree they hold, ``K3LAB_FORK_TREE``): llama-mtmd-cli encodes the image through the mmproj and
    answers; llama-server takes an image in a chat and counts its embeddings in the prompt."""
    import base64
    import sys

    import numpy as np
    from llama_tree import fork_server
    from PIL import Image

    bin_dir = fork_server("llama-mtmd-cli").parent
    fork_server()
    demo = subprocess.run([sys.executable, "-m", "k3lab.cli", "demo"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-2000:]
    pixels = np.random.default_rng(0).integers(0, 256, (120, 160, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.png")
    (block,) = [b for b in _page_blocks("docs/running.md") if b.startswith("unsloth-llama.cpp/build/bin/")]
    commands = block.replace("\\\n", " ").replace("unsloth-llama.cpp/build/bin/", f"{bin_dir}/").splitlines()
    (cli,) = [c for c in commands if "/llama-mtmd-cli " in c]
    (serve,) = [c for c in commands if "/llama-server " in c]
    ran = subprocess.run(["bash", "-c", cli], cwd=tmp_path, capture_output=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]
    assert b"mtmd batch encoding done" in ran.stderr  # (the image went through the mmproj)
    with _serving(serve, tmp_path, tmp_path / "fork-server.log") as port:
        image = "data:image/png;base64," + base64.b64encode((tmp_path / "photo.png").read_bytes()).decode()
        asked = [{"type": "text", "text": "What is in this picture?"}]
        ascii_only = {"max_tokens": 4, "grammar": WHOLE_CHARACTERS}  # (see test_llama_server_chats_with_it)
        text = _post(
            port, "/v1/chat/completions", {"messages": [{"role": "user", "content": asked}], **ascii_only}
        )
        seen = _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, *asked]}], **ascii_only})  # fmt: skip
        _the_forks_requests_answer_as_the_page_says(port, tmp_path)
    assert (
        seen["choices"][0]["message"] and seen["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"] + 4
    )


def _the_forks_requests_answer_as_the_page_says(port: int, cwd: Path) -> None:
    """docs/running.md's requests for the fork, as written: each answers (with the grammar); the same
    without it either answers or is refused as the page says, for the reason it says: the server's own
    log shows the reply it refused, and it is malformed UTF-8."""
    import os
    import urllib.error

    (block,) = [b for b in _page_blocks("docs/running.md") if b.startswith("# unsloth's fork")]
    said = subprocess.run(["bash", "-e", "-c", block.replace("127.0.0.1:8080", f"127.0.0.1:{port}")], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=os.environ)  # fmt: skip
    assert said.returncode == 0, said.stderr
    answers, text, decoder = [], said.stdout.strip(), json.JSONDecoder()
    while text:
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].strip()
    assert len(answers) == 2 and "error" not in answers[0] and "error" not in answers[1], said.stdout[-2000:]
    chat, completion = answers
    assert chat["choices"][0]["message"].get("reasoning_content") and completion["content"]
    assert WHOLE_CHARACTERS in block.replace("\\\\", "\\")
    refused = 0
    for k in range(6):
        body = {"messages": [{"role": "user", "content": f"Hi {k}"}], "max_tokens": 32}
        try:
            answer = _post(port, "/v1/chat/completions", body)
        except urllib.error.HTTPError as e:
            assert e.code == 500
            message = json.loads(e.read())["error"]["message"]
            assert message == "The model produced output that does not match the expected peg-native format"
            refused += 1
            continue
        assert "choices" in answer
    log = (cwd / "fork-server.log").read_bytes()
    unparsed = [
        line.split(b"output: ", 1)[1] for line in log.splitlines() if b"unparsed peg-native output: " in line
    ]
    assert len(unparsed) >= refused
    for reply in unparsed:
        with pytest.raises(UnicodeDecodeError):
            reply.decode("utf-8")
    print(f"the fork without the grammar: {refused} of 6 replies refused, each malformed UTF-8")
