"""Generation judged: llama.cpp decoding one token at a time (a batch of one, its KDA state and MLA
cache carried from token to token) over the prompt and N tokens it generates (greedy), each position's
logits against llama.cpp's own prefill of the same tokens (the chunked path and the recurrent one must
agree: the verdict) and, with the judge, against Moonshot's full forward (information: llama.cpp's
own choices part them, ``runtime``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3lab.errors import K3LabError
from k3lab.kimi_k3.moonshot_judge import nmse

# decode and prefill are the same graph on the same weights: they part by accumulation order (the KDA
# recurrence against its chunked form); on an F32 set 2e-13, but on BF16 and MXFP4 weights an order
# difference flips the odd BF16 or Q8_0 rounding of a matmul input and, the whole model end to end,
# that compounds (1e-4, up to 4e-3 at the median position on the tests' random draws of BF16 and MXFP4
# weights), and where a router is near a tie it may choose other experts on the two paths, moving that
# one position by up to O(1). So the verdict is on the median position: a decode that loses its state
# or cache is 0.8-2 at every position.
DECODE_THRESHOLD = 1e-1


@dataclass
class Generation:
    tokens: list[int]  # the prompt, then what llama.cpp generated
    prompt: int
    decode_vs_prefill: list[float]  # per position
    decode_vs_moonshot: list[float] = field(default_factory=list)  # per position, with the judge
    threshold: float = DECODE_THRESHOLD

    @property
    def median(self) -> float:
        return float(np.median(self.decode_vs_prefill)) if self.decode_vs_prefill else 0.0

    @property
    def apart(self) -> list[int]:
        """The positions past the threshold (a near-tie decided otherwise; information)."""
        return [i for i, v in enumerate(self.decode_vs_prefill) if not v <= self.threshold]

    @property
    def failed(self) -> bool:
        return not self.median <= self.threshold

    def table(self) -> str:
        judged = bool(self.decode_vs_moonshot)
        lines = [
            f"{'position':>8} {'token':>7} {'decode vs prefill':>18}"
            + (f" {'vs Moonshot':>12}" if judged else "")
        ]
        for i, t in enumerate(self.tokens):
            kind = "prompt" if i < self.prompt else "generated"
            other = f" {self.decode_vs_moonshot[i]:>12.3e}" if judged else ""
            bad = "  <-- apart" if i in self.apart else ""
            lines.append(f"{i:>8} {t:>7} {self.decode_vs_prefill[i]:>18.3e}{other}  {kind}{bad}")
        return "\n".join(lines)

    def summary(self) -> str:
        worst = max(self.decode_vs_prefill, default=0.0)
        line = (
            f"generation: {self.prompt} prompt + {len(self.tokens) - self.prompt} generated positions, decoded one "
            f"token at a time: against llama.cpp's prefill median {self.median:.2e} (the verdict, threshold "
            f"{self.threshold:g}), worst {worst:.2e}, {len(self.apart)} positions apart (a router's near-tie)"
        )
        if self.decode_vs_moonshot:
            line += (
                f"; against Moonshot's full forward worst {max(self.decode_vs_moonshot):.2e}, median "
                f"{float(np.median(self.decode_vs_moonshot)):.2e} (information: llama.cpp's own choices)"
            )
        return line


def _llama(gguf: str | Path, n_ctx: int) -> Any:
    import llama_cpp

    # an F32 KV cache: the MLA cache is not rounded to F16 (as the stage check's reference assumes)
    return llama_cpp.Llama(
        str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2, logits_all=True, verbose=False,
        type_k=0, type_v=0,
    )  # fmt: skip


def check_generation(gguf: str | Path, prompt: list[int], n_new: int, moonshot: Any = None) -> Generation:
    """``prompt`` then ``n_new`` greedy tokens, decoded one at a time by llama.cpp, each position against
    llama.cpp's prefill of the whole sequence and (``moonshot``: a callable, tokens -> logits)
    Moonshot's full forward."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise K3LabError("check-logits needs llama-cpp-python (`make test` installs it)") from None
    if not prompt:
        raise K3LabError("check-logits: the prompt gives no tokens")
    n_ctx = len(prompt) + n_new + 8
    llm = _llama(gguf, n_ctx)
    tokens = list(prompt)
    decoded = []
    for i in range(len(prompt) + n_new):
        if i >= len(prompt):
            tokens.append(int(np.argmax(decoded[-1])))
        llm.eval([tokens[i]])  # (one token: the recurrent path, the state and cache carried)
        decoded.append(np.array(llm.scores[i], dtype=np.float32))
    del llm
    whole = _llama(gguf, n_ctx)
    whole.eval(tokens)
    prefill = np.array(whole.scores[: len(tokens)], dtype=np.float32)
    del whole
    out = Generation(
        tokens, len(prompt), [nmse(prefill[i : i + 1], decoded[i][None]) for i in range(len(tokens))]
    )
    if moonshot is not None:
        theirs = moonshot(tokens)
        out.decode_vs_moonshot = [nmse(theirs[i : i + 1], decoded[i][None]) for i in range(len(tokens))]
    return out
