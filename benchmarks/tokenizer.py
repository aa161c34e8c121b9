"""The `tokenizer` row: GGUF vocabulary of the real size (163,840 ids) vs the straightforward per-token BPE
reconstruction (as upstream does it) on the same vocabulary; the merges must agree"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.common import row


@row
def bench_tokenizer() -> list[tuple[str, str, str]]:
    import base64
    import tempfile

    from k3lab.formats.bpe_merges import merges_reference
    from k3lab.kimi_k3.config import K3Config
    from k3lab.kimi_k3.synth.generate import write_tokenizer_files
    from k3lab.kimi_k3.synth.presets import real_config
    from k3lab.kimi_k3.tokenizer import build_vocabulary, token_to_unicode

    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp)
        raw = real_config()
        (meta / "config.json").write_text(json.dumps(raw))
        write_tokenizer_files(meta, K3Config.from_dict(raw), seed=0)
        build_vocabulary(meta)  # warm the compiled kernel's cache
        t = time.perf_counter()
        vocab = build_vocabulary(meta)
        t_fast = time.perf_counter() - t

        t = time.perf_counter()  # the straightforward way: per line, per token, per merge in Python
        tokens = [
            base64.b64decode(line.split()[0]) for line in (meta / "tiktoken.model").read_text().splitlines()
        ]
        strings = [token_to_unicode(tok) for tok in tokens]
        merges = [f"{token_to_unicode(a)} {token_to_unicode(b)}" for a, b in merges_reference(tokens)]
        t_ref = time.perf_counter() - t
    same = merges == vocab.merges and strings == vocab.tokens[: len(strings)]
    return [
        (
            f"tokenizer -> GGUF vocabulary, {len(vocab.tokens):,} ids, {len(merges):,} merges",
            f"{t_fast:.2f} s",
            f"merges identical: {same}",
        ),
        (
            "  vs straightforward per-token BPE reconstruction",
            f"{t_ref / t_fast:.1f}x faster",
            f"straightforward {t_ref:.2f} s",
        ),
    ]
