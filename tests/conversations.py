"""Hypothesis strategies for chats in every form Moonshot's ``build_chat_segments`` takes: system, user
and assistant turns (thinking on and off, ``reasoning_content`` and ``reasoning``), ``name`` attributes,
text and image parts, tools declared (and a system message's dynamic declare), tool calls (mapping
arguments of every JSON type, the JSON-block form, the flat form, calls with and without ids), tool
results in any order (by ``tool_call_id``, by name, by order), ``thinking_effort``, ``tool_choice``,
``response_format`` (``json_object``, ``json_schema``) and ``response_schema``, with text that holds
what a renderer must escape or leave alone (``&``, ``"``, special-token text, CJK, emoji, newlines).

A chat is drawn as ``(messages, tools, variables)``: the keywords both renderers take.

What is left out, and why (the README's chat section says the same):
- floats are k/64 or k/1000 (at most six decimals, magnitudes from 0.001 to 1e6): llama.cpp's engine
  prints a float with C's ``%f`` less its trailing zeros, where Python prints the shortest repr, so
  1/3 or 1e-05 render differently there (a llama.cpp limit, measured in the tests);
- integers within +-2**53 (what JSON carries between programs without loss);
- a reasoning or a string of arguments made only of whitespace outside ASCII: Python's ``strip``
  takes it for empty, llama.cpp's (C ``isspace``) does not;
- tool-call arguments as a JSON string: the template refuses them (it cannot parse JSON; llama-server
  parses them before rendering), tested on their own.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SPECIAL_TEXT = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|kimi_image_placeholder|>", "[EOS]"]
PIECES = ["&", '"', "&amp;", "'", "<", ">", "\n", "\t", " ", "  ", "=", '="', "{", "}", "```", "\\", "/"]

_chars = st.characters(
    codec="utf-8",
    exclude_categories=("Cs",),
    exclude_characters="\x00",
)
_plain = st.text(_chars, max_size=12)
_words = st.sampled_from(
    ["Hi", "hello", "Kimi", "天气", "北京", "🙂", "x", "42", "3.5", "It's", "OK", "café"]
)


def _is_unicode_blank(text: str) -> bool:
    """Blank to Python's ``strip`` but not to C's ``isspace``: renders differ by design (docstring)."""
    return not text.strip() and bool(text.strip(" \t\n\r\x0b\x0c"))


text = (
    # special-token text in about one piece of twenty (a user quoting the format)
    st.lists(
        st.one_of(_plain, _words, st.sampled_from(PIECES), st.sampled_from(SPECIAL_TEXT + [""] * 15)),
        max_size=6,
    )
    .map("".join)
    .filter(lambda t: not _is_unicode_blank(t))
)
name = st.one_of(
    st.sampled_from(["get_weather", "search", "a&b", 'say"hi"', "工具", "f"]), _plain.filter(bool)
)

_number = st.one_of(
    st.integers(-(2**53), 2**53),
    st.integers(-(10**6) * 64, 10**6 * 64).map(lambda k: k / 64),
    st.integers(-(10**6), 10**6).map(lambda k: k / 1000),
)
_key = st.one_of(st.sampled_from(["type", "B", "a", "Zeta", "alpha", "items", "名", "_x", "a b"]), _plain)
json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), _number, text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_key, inner, max_size=4)),
    max_leaves=12,
)
json_object = st.dictionaries(_key, json_value, max_size=5)


@st.composite
def tool(draw: Any) -> dict:
    function = {"name": draw(name)}
    if draw(st.booleans()):
        function["description"] = draw(text)
    if draw(st.booleans()):
        function["parameters"] = {
            "type": "object",
            "properties": draw(
                st.dictionaries(
                    _key, st.fixed_dictionaries({"type": st.sampled_from(["string", "number"])}), max_size=3
                )
            ),
            **draw(
                st.dictionaries(st.sampled_from(["required", "Additional", "$defs"]), json_value, max_size=2)
            ),
        }
    spec = {"type": "function", "function": function}
    spec |= draw(st.dictionaries(st.sampled_from(["strict", "Extra", "meta"]), json_value, max_size=1))
    return spec


tools = st.lists(tool(), min_size=1, max_size=3)

# arguments a template renders: an object (every JSON type), a string that cannot be JSON (the json
# block), an empty or blank string, none, or no key at all
_not_json = text.filter(
    lambda t: (
        t.strip()
        and t.strip(" \t\n\r")[:1] not in '{["-0123456789'
        and t.strip(" \t\n\r") not in ("true", "false", "null", "NaN", "Infinity")
    )
)
arguments = st.one_of(
    json_object, json_object, _not_json, st.sampled_from(["", "  "]), st.none(), st.just(...)
)


@st.composite
def tool_call(draw: Any, call_id: str | None) -> dict:
    fn: dict[str, Any] = {"name": draw(name)}
    args = draw(arguments)
    if args is not ...:
        fn["arguments"] = args
    if draw(st.integers(0, 5)) == 0:  # the flat form: name and arguments on the call itself
        call = dict(fn)
    else:
        call = {"type": "function", "function": fn}
    if call_id is not None:
        call["id"] = call_id
    return call


def content(draw: Any, parts_ok: bool = True) -> Any:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return None
    if kind <= 6 or not parts_ok:
        return draw(text)
    parts = draw(
        st.lists(
            st.one_of(
                st.builds(lambda t: {"type": "text", "text": t}, text),
                st.just({"type": "image"}),
                st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
            ),
            max_size=4,
        )
    )
    return parts


def _named(draw: Any, message: dict) -> dict:
    if draw(st.integers(0, 4)) == 0:
        message["name"] = draw(st.one_of(name, st.just("")))
    return message


@st.composite
def assistant_turn(draw: Any) -> list[dict]:
    """An assistant message, and when it calls tools, the results that follow (in any order)."""
    message: dict[str, Any] = {"role": "assistant", "content": content(draw)}
    which = draw(st.integers(0, 5))
    if which == 1:
        message["reasoning_content"] = draw(text)
    elif which == 2:
        message["reasoning"] = draw(text)
    elif which == 3:
        message["reasoning_content"] = ""
        message["reasoning"] = draw(text)
    _named(draw, message)
    if not draw(st.integers(0, 2)):
        return [message]
    n = draw(st.integers(1, 3))
    ids = [
        draw(st.one_of(st.none(), st.sampled_from([f"call_{k}", f"functions.f:{k}", "dup"])))
        for k in range(n)
    ]
    calls = [draw(tool_call(i)) for i in ids]
    message["tool_calls"] = calls
    results = []
    for call in calls:
        fn = call.get("function", call)
        result: dict[str, Any] = {"role": "tool", "content": content(draw, parts_ok=False)}
        how = draw(st.integers(0, 4))
        if how <= 1 and call.get("id") is not None:
            result["tool_call_id"] = call["id"]
        elif how == 2:
            result["tool_call_id"] = "unknown"
        if draw(st.integers(0, 3)) == 0:
            result["name"] = fn["name"]
        elif draw(st.integers(0, 5)) == 0:
            result["tool"] = draw(name)
        results.append(result)
    return [message, *draw(st.permutations(results))]


@st.composite
def chat(draw: Any) -> tuple[list[dict], list[dict] | None, dict]:
    messages: list[dict] = []
    if draw(st.booleans()):
        if draw(st.integers(0, 4)) == 0:
            messages.append({"role": "system", "tools": draw(tools), "content": ""})
        else:
            messages.append(_named(draw, {"role": "system", "content": content(draw)}))
    for _ in range(draw(st.integers(1, 4))):
        messages.append(_named(draw, {"role": "user", "content": content(draw)}))
        if draw(st.integers(0, 3)):
            messages.extend(draw(assistant_turn()))
    variables: dict[str, Any] = {"add_generation_prompt": draw(st.booleans())}
    optional = {
        "thinking": st.booleans(),
        "thinking_effort": st.sampled_from([None, "low", "high", "max"]),
        "tool_choice": st.sampled_from(["auto", "required", "none"]),
        "response_format": st.one_of(
            st.just({"type": "json_object"}),
            st.just({"type": "text"}),
            st.just("json_object"),
            st.builds(
                lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}, json_object
            ),
            st.builds(lambda s: {"type": "json_schema", "json_schema": s}, json_object),
        ),
        "response_schema": json_object,
    }
    for key, values in optional.items():
        if draw(st.integers(0, 2)) == 0:
            variables[key] = draw(values)
    return messages, (draw(tools) if draw(st.booleans()) else None), variables
