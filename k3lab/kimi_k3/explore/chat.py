"""A conversation three ways (notebook 04): as Moonshot's encoder renders it and encodes it (segment by
segment), as k3lab's chat template renders it, and as llama.cpp tokenizes that text (at once, special
tokens parsed), with the special tokens marked."""

from __future__ import annotations

import html
import re
import tempfile
from pathlib import Path
from typing import Any

from k3lab.kimi_k3 import chat, moonshot
from k3lab.kimi_k3.tokenizer import read_specials, read_tiktoken

SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SAMPLE_CHAT = [
    {"role": "system", "content": "You are Kimi."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this picture, and the weather in Paris?"},
            {"type": "image"},
        ],
    },  # fmt: skip
    {
        "role": "assistant",
        "reasoning_content": "A cat. The weather needs the tool.",
        "content": "A cat on a sofa.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],  # fmt: skip
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
]
SPECIAL = re.compile(r"<\|[a-z_]+\|>|\[[A-Z]+\]")


def chat_three_ways(
    meta: str | Path, messages: list | None = None, tools: list | None = None, **variables: Any
) -> dict:
    """The conversation (default: ``SAMPLE_CHAT`` with its tool) rendered and tokenized three ways.
    ``moonshot`` is None when Moonshot's encoder is not on this machine (``note`` says how to get it);
    llama.cpp's tokens come from llama-cpp-python when it is installed, else from tiktoken with the
    special tokens parsed, which tokenizes as llama.cpp does (the tests hold them equal)."""
    messages = SAMPLE_CHAT if messages is None else messages
    tools = SAMPLE_TOOLS if tools is None and messages is SAMPLE_CHAT else tools
    variables.setdefault("add_generation_prompt", True)
    ours = chat.render(messages, tools=tools, **variables)
    encoding = moonshot.encoding()
    theirs, their_ids, note = None, None, ""
    enc = _tiktoken(meta)
    if encoding is None:
        note = moonshot.missing()
    else:
        segments = encoding.build_chat_segments(messages, tools, **{"thinking_effort": "max", **variables})
        theirs = "".join(s.text for s in segments)
        their_ids = [
            i
            for s in segments
            for i in (
                enc.encode(s.text, allowed_special="all")
                if s.allow_special
                else enc.encode(s.text, disallowed_special=())
            )
        ]
    llama_ids, by = _llama_tokens(meta, ours)
    if llama_ids is None:
        llama_ids, by = (
            enc.encode(ours, allowed_special="all"),
            "tiktoken (llama-cpp-python is not installed)",
        )
    return {
        "template": ours,
        "moonshot": theirs,
        "same text": None if theirs is None else theirs == ours,
        "moonshot ids": their_ids,
        "llama.cpp ids": llama_ids,
        "tokenized by": by,
        "pieces": {i: enc.decode_single_token_bytes(i) for i in set(llama_ids) | set(their_ids or [])},
        "special ids": {enc.encode_single_token(t) for t in enc.special_tokens_set},
        "note": note,
    }


def _tiktoken(meta: str | Path) -> Any:
    import tiktoken

    from k3lab.kimi_k3.tokenizer import KIMI_PAT_STR

    ranked = read_tiktoken(Path(meta) / "tiktoken.model")
    specials, _ = read_specials(Path(meta) / "tokenizer_config.json")
    return tiktoken.Encoding(
        "k3",
        pat_str=KIMI_PAT_STR,
        mergeable_ranks={t: r for r, t in enumerate(ranked)},
        special_tokens={t: i for i, t in specials.items()},
    )


def _llama_tokens(meta: str | Path, text: str) -> tuple[list[int] | None, str]:
    try:
        import llama_cpp
    except ImportError:
        return None, ""
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.writing.single import convert_tokenizer

    with tempfile.TemporaryDirectory(prefix="k3lab-chat-") as tmp:
        path = convert_tokenizer(MODEL, meta, Path(tmp) / "tokenizer.gguf")
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        return llm.tokenize(text.encode(), add_bos=False, special=True), "llama.cpp (llama-cpp-python)"


def marked_html(text: str) -> str:
    """The rendered text with its special tokens marked (bold, coloured), newlines kept."""
    out, last = [], 0
    for m in SPECIAL.finditer(text):
        out.append(html.escape(text[last : m.start()]))
        out.append(f"<b style='color:#b5179e'>{html.escape(m.group())}</b>")
        last = m.end()
    out.append(html.escape(text[last:]))
    return f"<pre style='white-space:pre-wrap;font-size:smaller'>{''.join(out)}</pre>"


def tokens_html(ids: list[int], pieces: dict[int, bytes], specials: set[int]) -> str:
    """Token ids as boxes: each its piece, special tokens marked."""
    boxes = []
    for i in ids:
        piece = pieces[i].decode("utf-8", "replace")
        style = "color:#b5179e;font-weight:bold" if i in specials else ""
        boxes.append(
            f"<span title='{i}' style='border:1px solid #ccc;margin:1px;padding:0 2px;{style}'>"
            f"{html.escape(piece).replace(' ', '&middot;').replace(chr(10), '&#8629;')}</span>"
        )
    return f"<div style='line-height:1.9;font-family:monospace;font-size:smaller'>{''.join(boxes)}</div>"


def chat_differences(ways: dict) -> list[dict]:
    """Rows for a table: where Moonshot's ids and llama.cpp's part, and what each has there."""
    a, b = ways["moonshot ids"], ways["llama.cpp ids"]
    if a is None or a == b:
        return []
    start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    end_a, end_b = len(a), len(b)
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a, end_b = end_a - 1, end_b - 1

    def show(ids: list[int]) -> str:
        return repr(b"".join(ways["pieces"][i] for i in ids).decode("utf-8", "replace"))

    return [
        {
            "from position": start,
            "Moonshot's ids": a[start:end_a],
            "llama.cpp's ids": b[start:end_b],
            "text": show(a[start:end_a]),
        }
    ]
