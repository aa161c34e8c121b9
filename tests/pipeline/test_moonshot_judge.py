"""k3lab's reference forward (``check-logits``' NumPy model) against Moonshot's own text forward
(``moonshot_text``: the wheel's ``modeling_kimi_linear.py`` on CPU in float32, its KDA served by
fla-core's torch references): every layer's attention and FFN output and the logits agree within
1e-8 NMSE, with Kimi-K3's gate lower bound and without it (the 0.40B's form); a reading of the model
broken in a copy of the reference is named at the first layer it reaches."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from k3lab.kimi_k3 import reference
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.reference import Reference
from k3lab.kimi_k3.synth.presets import tiny_config
from k3lab.pipeline.sources.local import LocalSource

NMSE = 1e-8  # float32 both ways; measured ~1e-10 at the last layer, 6e-11 on the logits
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 1700, 16)]


def _nmse(want: np.ndarray, have: np.ndarray) -> float:
    return float(((want - have) ** 2).sum() / max(float((want**2).sum()), 1e-30))


def _order(name: str) -> tuple[int, int]:
    kind, layer = name.rsplit("-", 1)
    return int(layer), 0 if kind != "ffn_out" else 1


@pytest.fixture(scope="module", params=["lower-bound", "no-lower-bound"])
def judged(request, tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint folder, Moonshot's logits, its per-layer trace) for a checkpoint made by Moonshot's
    classes: Kimi-K3's config shape (``gate_lower_bound`` -5), or the 0.40B's (none)."""
    moonshot = pytest.importorskip("moonshot")
    moonshot_text = pytest.importorskip("moonshot_text")
    raw = tiny_config()
    if request.param == "no-lower-bound":
        raw["text_config"]["linear_attn_config"].pop("gate_lower_bound", None)
    net = moonshot.build(raw, seed=7, dtype="float32")
    out = tmp_path_factory.mktemp(request.param)
    shutil.rmtree(out)
    moonshot.save(net, out, "one-file")
    logits, trace = moonshot_text.forward(moonshot_text.text_model(net), TOKENS)
    return out, logits, trace


def _first_apart(src: Path, trace: dict[str, np.ndarray]) -> tuple[str | None, dict[str, float]]:
    mine: dict[str, np.ndarray] = {}
    Reference(K3Config.load(src), LocalSource(src), mode="f32").logits(TOKENS, mine)
    figures = {name: _nmse(trace[name], mine[name]) for name in sorted(trace, key=_order)}
    apart = [name for name, v in figures.items() if not v <= NMSE]  # (NaN is apart too)
    return (apart[0] if apart else None), figures


def test_the_reference_is_moonshots_forward_at_every_layer(judged) -> None:
    src, logits, trace = judged
    first, figures = _first_apart(src, trace)
    assert first is None, (first, figures)
    assert len(figures) == 2 * K3Config.load(src).n_layer
    mine = Reference(K3Config.load(src), LocalSource(src), mode="f32").logits(TOKENS)
    assert _nmse(logits, mine) < NMSE, _nmse(logits, mine)
    assert (logits.argmax(-1) == mine.argmax(-1)).all()
    print(f"\nworst layer NMSE {max(figures.values()):.1e}, logits {_nmse(logits, mine):.1e}")


def test_a_broken_attnres_fusion_is_named_at_its_first_mix(judged, monkeypatch) -> None:
    """The AttnRes score read as the projection alone (its norm's weight not fused in): Moonshot's
    forward parts from it at the first layer that mixes a banked checkpoint."""
    src, _, trace = judged
    monkeypatch.setattr(Reference, "res_score", lambda self, p: self.w(f"{p}_proj.weight").reshape(-1))
    first, _ = _first_apart(src, trace)
    assert first is not None and _order(first)[0] <= 1, first


def test_a_broken_gate_form_is_named_at_layer_0(judged, monkeypatch) -> None:
    """The KDA gate's activation wrong (softplus and sigmoid as the identity): named at layer 0's KDA."""
    src, _, trace = judged
    monkeypatch.setattr(reference, "softplus", lambda x: x)
    monkeypatch.setattr(reference, "sigmoid", lambda x: 1.0 / (1.0 + np.exp(-2.0 * x)))
    first, figures = _first_apart(src, trace)
    assert first == "kda_out-0", (first, figures)


def test_a_broken_kv_split_is_named_at_the_first_mla_layer(judged, monkeypatch) -> None:
    """kv_b's rows read as values first, keys after (the split swapped): named at the first MLA layer."""
    src, _, trace = judged
    cfg = K3Config.load(src)
    first_mla = next(il for il in range(cfg.n_layer) if cfg.is_mla(il))
    real = reference.Weights.__call__

    def swapped(self, name: str) -> np.ndarray:
        w = real(self, name)
        if name.endswith("kv_b_proj.weight"):
            heads = int(cfg.text["num_attention_heads"])
            per = w.reshape(heads, -1, w.shape[-1])
            return np.ascontiguousarray(per[:, ::-1]).reshape(w.shape)
        return w

    monkeypatch.setattr(reference.Weights, "__call__", swapped)
    first, _ = _first_apart(src, trace)
    assert first == f"mla_out-{first_mla}", first
