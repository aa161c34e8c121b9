"""Kimi-K3's chat format as a Jinja template: the one k3lab embeds, and the checks a template must pass.

Kimi-K3 ships its chat format as Python (Moonshot's ``encoding_k3.py``: ``build_chat_segments``, which
``tokenization_kimi.py``'s ``apply_chat_template`` encodes segment by segment), not as a template, so a
GGUF of it would carry none and llama.cpp would fall back to a format the model never saw.
``data/chat_template.jinja`` is k3lab's own rendering of that format. It renders exactly the text
Moonshot's encoder renders, for every argument the encoder takes, in Python's jinja2 (the sandbox
transformers uses) and in llama.cpp's own C++ engine; the tests hold it to both
(``tests/unit/test_chat_template.py``). What it cannot express it refuses, with Moonshot's words where
Moonshot refuses too:

- tool-call arguments given as a string that may be JSON (a template cannot parse JSON; pass the
  object, as llama-server does once it has parsed them); a string that cannot be JSON is the json block;
- ``image_prompts``: image parts render as ``<|kimi_image_placeholder|>``, as the encoder renders them
  without prompts; a runtime's own media marker part (llama.cpp's ``media_marker``) renders as its text.

Its defaults are those of Moonshot's tokenizer (``thinking`` on, ``thinking_effort`` "max": pass none
for no effort message), except ``add_generation_prompt``, false unless passed as in every chat
template (llama.cpp asks for it when it wants a reply, and tells the prompt from the reply by
rendering both ways).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

from k3lab.errors import K3LabError

TEMPLATE_FILE = "data/chat_template.jinja"
RENDER_TIMEOUT = 20.0  # seconds for a one-message chat: a real template takes milliseconds
RENDER_MEMORY = 1 << 30  # bytes of address space the rendering process may take beyond Python's own
ONE_MESSAGE = [{"role": "user", "content": "Hi"}]


class ChatTemplateError(K3LabError):
    """A chat template that cannot be embedded: not Jinja, or renders nothing for one message."""


@functools.lru_cache(maxsize=1)
def template() -> str:
    """k3lab's Kimi-K3 chat template (the text embedded when a checkpoint ships none)."""
    return resources.files("k3lab.kimi_k3").joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def template_sha256() -> str:
    return hashlib.sha256(template().encode()).hexdigest()


def describe(text: str | None) -> str:
    """Which chat template a file carries, in words (the card and the notes say it)."""
    if text is None:
        return "none"
    digest = hashlib.sha256(text.encode()).hexdigest()
    if text == template():
        return f"k3lab's Kimi-K3 template (SHA-256 {digest[:16]}: renders as Moonshot's encoding_k3.py)"
    return f"the checkpoint's own or one given with --chat-template (SHA-256 {digest[:16]})"


def card_paragraph(text: str | None) -> str:
    """What a set's card says of the chat template its file 1 carries (``text``; None: none)."""
    if text is None:
        return (
            "Chat template: none in the metadata; give llama.cpp one: `llama-server --jinja "
            "--chat-template-file TEMPLATE.jinja`."
        )
    if text != template():
        return f"Chat template: {describe(text)}, in the metadata: `llama-server --jinja` uses it."
    return (
        f"Chat template: {describe(text)}. Kimi-K3 ships its chat format as Python (Moonshot's "
        "`encoding_k3.py`); the template renders the same text, so llama.cpp chats with no "
        "`--chat-template-file` (`llama-server --jinja`). Moonshot's other keywords (`thinking`, "
        "`thinking_effort`, `tool_choice`, `response_format`) go in `chat_template_kwargs`. Two things differ "
        "from Moonshot's own pipeline by the runtime, not the template: llama.cpp tokenizes the prompt at once "
        "(special-token text a user types becomes a control token), and a llama.cpp that runs images puts "
        "`<|media_begin|>`, the embeddings, `<|media_end|>` where Moonshot's processor also writes "
        "`image {W}x{H}<|media_content|>` after `<|media_begin|>` (about 6 tokens fewer per image)."
    )


def environment() -> Any:
    """A jinja2 environment as transformers' ``apply_chat_template`` makes one: sandboxed and immutable,
    blocks trimmed, ``raise_exception``, ``tojson`` as ``json.dumps`` (no HTML escaping) and loop
    controls."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def render(messages: list[Any], text: str | None = None, **variables: Any) -> str:
    """A conversation rendered by a template (k3lab's when ``text`` is None) with jinja2, as transformers
    renders it: the variables are ``build_chat_segments``' keywords."""
    return _compiled(template() if text is None else text).render(messages=messages, **variables)


@functools.lru_cache(maxsize=4)
def _compiled(text: str) -> Any:
    return environment().from_string(text)


def check(text: str, origin: str | Path) -> None:
    """A template given to embed must be Jinja and render something for a one-message chat; one line
    naming ``origin`` otherwise. It is parsed and rendered in a process of its own, bounded in time,
    memory and recursion (a template is a program: one can loop for ever, build a string of any size,
    or nest deeper than a parser recurses), isolated from the folder k3lab runs in."""
    _check_once(hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), text, str(origin))


@functools.lru_cache(maxsize=8)
def _check_once(digest: str, text: str, origin: str) -> None:
    from k3lab.children import python_command

    try:
        done = subprocess.run(
            python_command(_RENDER_ONE, str(RENDER_MEMORY)),
            input=text.encode("utf-8", "surrogatepass"),
            capture_output=True,
            timeout=RENDER_TIMEOUT,
            env=child_environment(),
        )
    except subprocess.TimeoutExpired:
        raise ChatTemplateError(
            f"{origin}: the chat template is not parsed and rendered for a one-message chat within"
            f" {RENDER_TIMEOUT:.0f} s"
        ) from None
    answer = done.stdout[-4096:].decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    if done.returncode or not answer[0].startswith("{"):
        said = done.stderr[-4096:].decode("utf-8", "replace").strip().splitlines() or ["it stopped"]
        raise ChatTemplateError(
            f"{origin}: the chat template cannot render a one-message chat ({said[-1][:200]})"
        )
    result = json.loads(answer[0])
    if "syntax" in result:
        raise ChatTemplateError(f"{origin}: not a Jinja template ({result['syntax'][:200]})")
    if "error" in result:
        raise ChatTemplateError(
            f"{origin}: the chat template fails on a one-message chat ({result['error'][:200]})"
        )
    if not result.get("chars"):
        raise ChatTemplateError(f"{origin}: the chat template renders nothing for a one-message chat")


def child_environment() -> dict[str, str]:
    """What a child that runs a stranger's template sees of the environment: nothing of the user's
    (no token, no PYTHON* setting), a locale and a path."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}


# the child of ``check``: the template on stdin, one JSON line out ({"chars"}, {"syntax"} or {"error"});
# k3lab's own folder comes first in its path (the child runs isolated: ``k3lab.children``)
_RENDER_ONE = f"""
import json, resource, sys
limit = int(sys.argv[1])
with open("/proc/self/statm") as statm:  # (the address space taken so far, in pages)
    used = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + limit,) * 2)
from jinja2 import TemplateSyntaxError
from k3lab.kimi_k3.chat import environment, render
text = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
try:
    environment().parse(text)
    out = {{"chars": len(render({ONE_MESSAGE!r}, text, add_generation_prompt=True).strip())}}
except TemplateSyntaxError as e:
    out = {{"syntax": f"line {{e.lineno}}: {{e.message}}".replace(chr(10), " ")}}
except MemoryError:
    out = {{"error": "it takes more than 1 GiB"}}
except RecursionError:
    out = {{"error": "it nests deeper than Python's parser recurses"}}
except Exception as e:
    out = {{"error": f"{{type(e).__name__}}: {{e}}".replace(chr(10), " ")}}
print(json.dumps(out))
"""
