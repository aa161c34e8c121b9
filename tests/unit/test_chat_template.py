"""k3lab's Kimi-K3 chat template against Moonshot's own encoder, in two renderers.

The judge is Moonshot's ``tokenization_kimi.TikTokenTokenizer.apply_chat_template`` (``encoding_k3``'s
``build_chat_segments``, the segments joined; from the llmcompressor 0.14.0.1 wheel, tests/moonshot.py).
The template is rendered by Python's jinja2 in the sandbox transformers uses (``chat.render``, and
transformers' own ``render_jinja_template`` once) and by llama.cpp's own C++ engine (``common/jinja``
of the tree llama-cpp-python vendors, and of unsloth's fork, the llama.cpp that runs K3's vision:
tests/llama_tree.py). Every conversation of
``tests/conversations.py`` must render to Moonshot's text in both, byte for byte; where Moonshot
refuses a chat, both refuse it too.

Tokens: llama.cpp tokenizes the rendered text at once (special tokens parsed), Moonshot encodes it
segment by segment; ``test_token_agreement`` measures where the ids differ and why, on the same
conversations, and prints the figure the README gives.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import moonshot as judges
import pytest
from conversations import SPECIAL_TEXT, chat
from hypothesis import HealthCheck, given, settings
from llama_support import needs_llama

from k3lab.kimi_k3 import chat as k3chat

EXAMPLES = 500
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def moonshot(tiny_src: Path) -> Any:
    """Moonshot's tokenizer on the tiny checkpoint's vocabulary."""
    return judges.tokenizer(tiny_src)


@pytest.fixture(scope="module", params=["upstream", "unsloth-fork"])
def engine(request: pytest.FixtureRequest) -> Any:
    """llama.cpp's engine: upstream's (the tree llama-cpp-python vendors) and unsloth's fork's (the
    llama.cpp that runs Kimi-K3's vision; skipped loudly where its tree is not)."""
    from llama_tree import JinjaEngine, fork_tree

    return JinjaEngine(k3chat.template(), fork_tree() if request.param == "unsloth-fork" else None)


def moonshot_text(tok: Any, messages: list, tools: list | None, variables: dict) -> str | Exception:
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, **variables)
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        return e


def template_text(messages: list, tools: list | None, variables: dict) -> str | Exception:
    from jinja2.exceptions import TemplateError

    try:
        return k3chat.render(messages, tools=tools, **variables)
    except TemplateError as e:
        return e


def context(messages: list, tools: list | None, variables: dict) -> dict:
    return {"messages": messages, "tools": tools, **variables}


class Corpus:
    """The conversations one run draws, with Moonshot's text (or its refusal) for each."""

    def __init__(self) -> None:
        self.cases: list[tuple[list, list | None, dict, str | Exception]] = []


@pytest.fixture(scope="module")
def corpus(moonshot: Any) -> Corpus:
    """The same EXAMPLES conversations for every test here (derandomized: the same in every run),
    each checked against jinja2 as it is drawn (hypothesis shrinks a difference to its smallest)."""
    found = Corpus()

    @SETTINGS
    @given(chat())
    def draw(drawn: tuple[list, list | None, dict]) -> None:
        messages, tools, variables = drawn
        expected = moonshot_text(moonshot, messages, tools, variables)
        got = template_text(messages, tools, variables)
        if isinstance(expected, Exception):
            assert isinstance(got, Exception), f"Moonshot refuses ({expected}); the template renders {got!r}"
        else:
            assert got == expected, f"{json.dumps(context(messages, tools, variables), ensure_ascii=False)}"
        found.cases.append((messages, tools, variables, expected))

    draw()
    return found


def test_jinja2_renders_moonshots_text_for_every_conversation(corpus: Corpus) -> None:
    rendered = [c for c in corpus.cases if isinstance(c[3], str)]
    refused = len(corpus.cases) - len(rendered)
    print(
        f"\njinja2: {len(rendered)} conversations rendered as Moonshot's encoder, {refused} refused by both"
    )
    assert len(corpus.cases) >= EXAMPLES and len(rendered) >= 0.8 * EXAMPLES


def test_llama_cpps_engine_renders_moonshots_text_for_every_conversation(corpus: Corpus, engine: Any) -> None:
    answers = engine.render([context(m, t, v) for m, t, v, _ in corpus.cases])
    differ = []
    for (messages, tools, variables, expected), answer in zip(corpus.cases, answers):
        if isinstance(expected, Exception):
            if "error" not in answer:
                differ.append(
                    f"Moonshot refuses ({expected}), llama.cpp renders: {context(messages, tools, variables)}"
                )
        elif answer.get("text") != expected:
            differ.append(
                f"{json.dumps(context(messages, tools, variables), ensure_ascii=False)}\n"
                f"  Moonshot: {expected!r}\n  llama.cpp: {answer}"
            )
    print(f"\nllama.cpp's engine: {len(answers) - len(differ)} of {len(answers)} as Moonshot's encoder")
    assert not differ, f"{len(differ)} differ; the first:\n{differ[0]}"


def test_transformers_renders_it_as_chat_render_does(corpus: Corpus) -> None:
    """transformers' own entry (``render_jinja_template``, what ``apply_chat_template`` calls) gives the
    text ``chat.render`` gives: the environment k3lab builds is transformers'."""
    from transformers.utils.chat_template_utils import render_jinja_template

    for messages, tools, variables, expected in corpus.cases[:60]:
        if isinstance(expected, Exception):
            continue
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, chat_template=k3chat.template(), **variables
        )
        assert rendered[0] == expected


def test_llama_server_sees_what_the_template_needs(engine: Any, request: pytest.FixtureRequest) -> None:
    """The capabilities llama-server derives from the template: tools, tool calls with object
    arguments (so it parses a JSON string of arguments before rendering), typed content, system role."""
    caps = engine.caps
    for cap in ("supports_tools", "supports_tool_calls", "supports_object_arguments", "supports_system_role",
                "supports_string_content"):  # fmt: skip
        assert caps[cap], (cap, caps)
    # typed content (a message's content as a list of parts): upstream's probe finds it; the fork's
    # older probe does not, and its server then joins the parts into a string first (rendered alike)
    assert caps["supports_typed_content"] == (request.node.callspec.params["engine"] == "upstream"), caps


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"city": "Paris"}', "may be JSON: pass them as an object"),
        ("  [1, 2]", "may be JSON"),
        ("42", "may be JSON"),
        ("true", "may be JSON"),
        ([1, 2], "must be a dict or a JSON object string"),
    ],
)
def test_what_the_template_cannot_express_is_refused(arguments: Any, message: str, engine: Any) -> None:
    """A template cannot parse JSON: arguments as a string that may be JSON are refused (Moonshot
    parses them: an object becomes argument tags, anything else it refuses itself), in both engines."""
    from jinja2.exceptions import TemplateError

    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]},
    ]  # fmt: skip
    with pytest.raises(TemplateError, match=re.escape(message)):
        k3chat.render(messages)
    (answer,) = engine.render([{"messages": messages}])
    assert message in answer["error"]


def test_defaults_are_moonshots_tokenizers(moonshot: Any, engine: Any) -> None:
    """No keywords: thinking on, effort "max", as ``apply_chat_template``; thinking_effort=None gives
    ``build_chat_segments``' own default (no effort message); llama.cpp's enable_thinking stands in for
    ``thinking``."""
    messages = [{"role": "user", "content": "Hi"}]
    for variables in ({}, {"thinking_effort": None}, {"thinking": False}):
        expected = moonshot.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **variables
        )
        assert k3chat.render(messages, add_generation_prompt=True, **variables) == expected
    assert "thinking_effort=max" in k3chat.render(messages)
    off = moonshot.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    (answer,) = engine.render(
        [{"messages": messages, "add_generation_prompt": True, "enable_thinking": False}]
    )
    assert answer["text"] == off and off.endswith("<|open|>response<|sep|>")


def test_the_openai_apis_reasoning_effort_is_thinking_effort(moonshot: Any, engine: Any) -> None:
    """llama-server passes an OpenAI client's ``reasoning_effort`` to the template (it says it can: its
    caps): it is Moonshot's ``thinking_effort``, which wins when both are given; a value Moonshot
    does not know is refused with Moonshot's words."""
    messages = [{"role": "user", "content": "Hi"}]
    assert engine.caps.get("supports_reasoning_effort", True), engine.caps  # (the fork's probe has none)
    for effort in ("low", "high"):
        expected = moonshot.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, thinking_effort=effort
        )
        contexts = [{"messages": messages, "add_generation_prompt": True, "reasoning_effort": effort},
                    {"messages": messages, "add_generation_prompt": True, "reasoning_effort": "max",
                     "thinking_effort": effort}]  # fmt: skip
        assert [a.get("text") for a in engine.render(contexts)] == [expected, expected]
        assert k3chat.render(messages, add_generation_prompt=True, reasoning_effort=effort) == expected
    (answer,) = engine.render([{"messages": messages, "reasoning_effort": "medium"}])
    assert "Unsupported thinking_effort=medium" in answer["error"], answer


@needs_llama
def test_token_agreement(corpus: Corpus, moonshot: Any, tiny_src: Path, tmp_path_factory: Any) -> None:
    """llama.cpp's ids for the rendered text (as llama-server tokenizes a prompt: at once, special
    tokens parsed) against Moonshot's (segment by segment, text never special). Each difference is
    put down to its causes by re-encoding Moonshot's segments step by step towards llama.cpp's way:
    1. consecutive text segments joined (Moonshot encodes an attribute's `="`, its value and its `"`
       apart): a change here is a boundary between text segments;
    2. the whole text with special-token text parsed as special (tiktoken): a change here is
       special-token text inside a message;
    3. llama.cpp's own tokenizer on that text: a change here is its pre-tokenizer against tiktoken's
       regex on rare characters (a llama.cpp matter, not the chat format's)."""
    import llama_cpp

    from k3lab.request import Request, tokenizer

    gguf_path = tmp_path_factory.mktemp("chat-tok") / "tok.gguf"
    tokenizer(Request(meta=str(tiny_src)), str(gguf_path))
    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    build = judges.chat().encoding.build_chat_segments
    causes: Counter[str] = Counter()
    boundaries: Counter[str] = Counter()
    rendered = [c for c in corpus.cases if isinstance(c[3], str)]
    differing = plain = plain_differing = 0
    for messages, tools, variables, text in rendered:
        ids = moonshot.apply_chat_template(messages, tools=tools, tokenize=True, **variables)
        theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
        drawn = json.dumps([messages, tools, variables], ensure_ascii=False)
        is_plain = not any(t in drawn for t in SPECIAL_TEXT) and '"type": "image' not in drawn
        plain += is_plain
        if theirs == ids:
            continue
        differing += 1
        plain_differing += is_plain
        segments = build(messages, tools, **{"thinking_effort": "max", **variables})
        joined = _encode_joined(moonshot, segments)
        whole = moonshot.model.encode(text, allowed_special="all")
        if joined != ids:
            causes["boundary"] += 1
            boundaries.update(_split_boundaries(moonshot, segments))
        if whole != joined:
            causes["special text"] += 1
            assert any(t in json.dumps([messages, tools, variables]) for t in SPECIAL_TEXT[:4] + ["[EOS]"])
        if theirs != whole:
            causes["pre-tokenizer"] += 1
    with_special = sum(
        any(t in json.dumps(c[:3], ensure_ascii=False) for t in SPECIAL_TEXT) for c in rendered
    )
    print(
        f"\ntokens: {differing} of {len(rendered)} conversations get other ids from llama.cpp than from "
        f"Moonshot's encoder; causes (a conversation may have several): {dict(causes)} "
        f"(special-token text was drawn into {with_special}); boundaries: {dict(boundaries)}; "
        f"chats with no special-token text and no image: {plain_differing} of {plain} differ"
    )
    # the template's own text never splits otherwise: only an attribute value's edges and the seam of
    # two parts of one message's content do
    assert set(boundaries) <= {
        "after an attribute's =\"",
        "before an attribute's closing \"",
        "between two text parts of one message",
        "around an image placeholder",
    }, boundaries


def _is_token(tok: Any, segment: Any) -> bool:
    """A control segment that is one special token (``<|kimi_image_placeholder|>`` is a control
    segment, but text to the vocabulary)."""
    return segment.allow_special and segment.text in tok.model.special_tokens_set


def _encode_joined(tok: Any, segments: list) -> list[int]:
    """Moonshot's segments encoded with the text between two special tokens joined into one."""
    ids: list[int] = []
    run = ""
    for s in segments:
        if _is_token(tok, s):
            ids += tok.model.encode(run, disallowed_special=()) if run else []
            run = ""
            ids += tok.model.encode(s.text, allowed_special="all")
        else:
            run += s.text
    return ids + (tok.model.encode(run, disallowed_special=()) if run else [])


def _split_boundaries(tok: Any, segments: list) -> list[str]:
    """Each seam of two segments that are not special tokens where encoding them apart differs from
    encoding them together."""
    labels = []
    for a, b in zip(segments, segments[1:]):
        if _is_token(tok, a) or _is_token(tok, b):
            continue
        apart = tok.model.encode(a.text, disallowed_special=()) + tok.model.encode(
            b.text, disallowed_special=()
        )
        if apart != tok.model.encode(a.text + b.text, disallowed_special=()):
            if a.allow_special or b.allow_special:
                labels.append("around an image placeholder")
            elif a.text == '="':
                labels.append("after an attribute's =\"")
            elif b.text == '"':
                labels.append("before an attribute's closing \"")
            else:  # (the tags' and attributes' own texts split alike: what is left is two parts' texts)
                labels.append("between two text parts of one message")
    return labels


def test_special_token_text_in_a_message_is_plain_text_to_moonshot(moonshot: Any) -> None:
    """The one difference no template can avoid, pinned: Moonshot encodes a user's "<|open|>" as
    text, llama.cpp's whole-prompt tokenization as the control token."""
    messages = [{"role": "user", "content": SPECIAL_TEXT[0]}]
    text = moonshot.apply_chat_template(messages, tokenize=False)
    ids = moonshot.apply_chat_template(messages, tokenize=True)
    open_id = moonshot.model.encode("<|open|>", allowed_special="all")[0]
    assert text.count("<|open|>") == 5 and ids.count(open_id) == 4  # the tags' four, not the text's


def test_the_calibration_texts_conversations_are_moonshots_and_its_file_is_its_module(moonshot: Any) -> None:
    """k3lab's calibration text (``k3lab imatrix`` without --calibration) holds Kimi-K3's chat format
    as Moonshot's encoder writes it, and the packaged file is what its module makes (regenerate:
    ``python -m k3lab.kimi_k3.calibration_text > k3lab/kimi_k3/data/calibration-v1.txt``)."""
    from k3lab.kimi_k3 import calibration_text as calib

    for c, rendered in zip(calib.CHATS, calib.chats()):
        variables = {
            "add_generation_prompt": False,
            **{k: v for k, v in c.items() if k not in ("messages", "tools")},
        }
        assert rendered == moonshot_text(moonshot, c["messages"], c.get("tools"), variables)
    assert calib.FILE.read_text(encoding="utf-8") == calib.text()
    assert all(rendered in calib.text() for rendered in calib.chats())
