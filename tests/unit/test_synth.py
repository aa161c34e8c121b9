"""The synthetic checkpoints are structurally the real Kimi-K3: names, dtypes, shapes, shard plan."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from safetensors import safe_open

from k3lab.kimi_k3.synth import synthesize
from k3lab.kimi_k3.synth.bpe import KIMI_PAT_STR, TINY_RANKS, corpus, format_tiktoken, shipped_tiktoken, train
from k3lab.kimi_k3.synth.presets import real_config

H, HEADS, KDA_HD, NOPE, ROPE, V, QL, KVL = 128, 4, 32, 32, 16, 32, 64, 64
E, FF_E, LAT, FF, SHARED, VOCAB = 8, 64, 96, 256, 2, 1792
LM = "language_model.model."


def _expected_layer(i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer i of tiny, written out from the facts file (not from k3lab's layout code)."""
    p = f"{LM}layers.{i}."
    t = {p + "input_layernorm.weight": ("BF16", (H,)), p + "post_attention_layernorm.weight": ("BF16", (H,))}
    for pair in ("self_attention_res", "mlp_res"):
        t[p + f"{pair}_norm.weight"] = ("BF16", (H,))
        t[p + f"{pair}_proj.weight"] = ("BF16", (1, H))
    a = p + "self_attn."
    if i + 1 in (4, 8):  # MLA
        t.update(
            {
                a + "q_a_proj.weight": ("BF16", (QL, H)),
                a + "q_a_layernorm.weight": ("BF16", (QL,)),
                a + "q_b_proj.weight": ("BF16", (HEADS * (NOPE + ROPE), QL)),
                a + "kv_a_proj_with_mqa.weight": ("BF16", (KVL + ROPE, H)),
                a + "kv_a_layernorm.weight": ("BF16", (KVL,)),
                a + "kv_b_proj.weight": ("BF16", (HEADS * (NOPE + V), KVL)),
                a + "g_proj.weight": ("BF16", (HEADS * V, H)),
                a + "o_proj.weight": ("BF16", (H, HEADS * V)),
            }
        )
    else:  # KDA
        d = HEADS * KDA_HD
        for x in "qkv":
            t[a + f"{x}_proj.weight"] = ("BF16", (d, H))
            t[a + f"{x}_conv1d.weight"] = ("BF16", (d, 1, 4))
        t.update(
            {
                a + "g_proj.weight": ("BF16", (d, H)),
                a + "f_a_proj.weight": ("BF16", (KDA_HD, H)),
                a + "f_b_proj.weight": ("BF16", (d, KDA_HD)),
                a + "b_proj.weight": ("BF16", (HEADS, H)),
                a + "o_norm.weight": ("BF16", (KDA_HD,)),
                a + "o_proj.weight": ("BF16", (H, d)),
                a + "dt_bias": ("F32", (d,)),
                a + "A_log": ("F32", (HEADS,)),
            }
        )
    if i == 0:
        t.update(
            {
                p + "mlp.gate_proj.weight": ("BF16", (FF, H)),
                p + "mlp.up_proj.weight": ("BF16", (FF, H)),
                p + "mlp.down_proj.weight": ("BF16", (H, FF)),
            }
        )
        return t
    m = p + "block_sparse_moe."
    t.update(
        {
            m + "gate.weight": ("BF16", (E, H)),
            m + "gate.e_score_correction_bias": ("F32", (E,)),
            m + "shared_experts.gate_proj.weight": ("BF16", (FF_E * SHARED, H)),
            m + "shared_experts.up_proj.weight": ("BF16", (FF_E * SHARED, H)),
            m + "shared_experts.down_proj.weight": ("BF16", (H, FF_E * SHARED)),
            m + "routed_expert_down_proj.weight": ("BF16", (LAT, H)),
            m + "routed_expert_up_proj.weight": ("BF16", (H, LAT)),
            m + "routed_expert_norm.weight": ("BF16", (LAT,)),
        }
    )
    for e in range(E):
        for w, (r, c) in {"w1": (FF_E, LAT), "w2": (LAT, FF_E), "w3": (FF_E, LAT)}.items():
            t[m + f"experts.{e}.{w}.weight_packed"] = ("U8", (r, c // 2))
            t[m + f"experts.{e}.{w}.weight_scale"] = ("U8", (r, c // 32))
    return t


def _read(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def test_tiny_matches_the_facts_shard_by_shard(tiny_src: Path) -> None:
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{k:05d}-of-000011.safetensors" for k in range(1, 12)]
    for k in range(1, 9):  # shard k holds exactly layer k-1
        assert _read(tiny_src / files[k - 1]) == _expected_layer(k - 1), f"shard {k}"
    assert _read(tiny_src / files[8]) == {
        LM + "embed_tokens.weight": ("BF16", (VOCAB, H)),
        LM + "norm.weight": ("BF16", (H,)),
        "language_model.lm_head.weight": ("BF16", (VOCAB, H)),
        LM + "output_attn_res_norm.weight": ("BF16", (H,)),
        LM + "output_attn_res_proj.weight": ("BF16", (1, H)),
    }
    assert all(n.startswith("mm_projector.") for n in _read(tiny_src / files[9]))
    vision = _read(tiny_src / files[10])
    assert all(n.startswith("vision_tower.") for n in vision)
    assert {n for n in vision if ".blocks." in n} == {
        f"vision_tower.encoder.blocks.{i}.{t}.weight"
        for i in range(2)
        for t in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")
    }
    # the index agrees with the files, and total_size with the data
    total = sum(
        np.prod(s) * {"BF16": 2, "F32": 4, "U8": 1}[d] for f in files for d, s in _read(tiny_src / f).values()
    )
    assert index["metadata"]["total_size"] == total


def test_config_has_every_real_key(tiny_src: Path) -> None:
    cfg = json.loads((tiny_src / "config.json").read_text())
    real = real_config()

    def keys(d: dict, prefix: str = "") -> set[str]:
        return {prefix + k for k in d} | {
            x
            for k, v in d.items()
            if isinstance(v, dict) and k != "config_groups"
            for x in keys(v, f"{prefix}{k}.")
        }

    assert keys(cfg) == keys(real)
    t = cfg["text_config"]
    assert t["linear_attn_config"]["full_attn_layers"] == [4, 8]
    assert t["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert (t["num_experts"], t["num_experts_per_token"], t["num_shared_experts"]) == (8, 2, 2)
    assert real["text_config"]["linear_attn_config"]["full_attn_layers"][-3:] == [88, 92, 93]
    assert len(real["text_config"]["linear_attn_config"]["kda_layers"]) == 69


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path, tiny_src: Path) -> None:
    synthesize("tiny", tmp_path / "a", seed=0)
    synthesize("tiny", tmp_path / "b", seed=1)
    name = "model-00002-of-000011.safetensors"
    assert (tmp_path / "a" / name).read_bytes() == (tiny_src / name).read_bytes()
    assert (tmp_path / "b" / name).read_bytes() != (tiny_src / name).read_bytes()


def test_scales_look_trained_and_differ_by_layer_and_projection(tiny_src: Path) -> None:
    means = {}
    for k in (2, 5):
        with safe_open(str(tiny_src / f"model-{k:05d}-of-000011.safetensors"), framework="numpy") as f:
            for w in ("w1", "w2"):
                s = np.concatenate(
                    [
                        f.get_tensor(
                            f"{LM}layers.{k - 1}.block_sparse_moe.experts.{e}.{w}.weight_scale"
                        ).ravel()
                        for e in range(E)
                    ]
                )
                means[(k, w)] = s.mean()
                assert 100 < s.mean() < 127 and s.std() > 0.4 and len(np.unique(s)) >= 4
    assert len({round(float(v), 2) for v in means.values()}) == 4


def test_tokenizer_files(tiny_src: Path) -> None:
    ranks = {
        base64.b64decode(t): int(r)
        for t, r in (line.split() for line in (tiny_src / "tiktoken.model").read_text().splitlines())
    }
    assert len(ranks) == VOCAB - 256 and sorted(ranks.values()) == list(range(VOCAB - 256))
    added = json.loads((tiny_src / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert sorted(int(i) for i in added) == list(range(VOCAB - 256, VOCAB))
    assert (
        added[str(VOCAB - 256)]["content"] == "[BOS]"
        and added[str(VOCAB - 254)]["content"] == "<|end_of_msg|>"
    )
    assert (
        added[str(VOCAB - 256 + 21)]["content"] == "<|media_pad|>"
        and added[str(VOCAB - 1)]["content"] == "[PAD]"
    )
    enc = tiktoken.Encoding("k3", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    text = "The converter streams each tensor to the output file. 人工智能正在改变世界。"
    ids = enc.encode(text)
    assert enc.decode(ids) == text
    assert len(text.encode()) / len(ids) > 3  # merges are meaningful on real text


def test_shipped_vocabulary_is_what_the_trainer_makes() -> None:
    assert format_tiktoken(train(corpus(), TINY_RANKS)) == shipped_tiktoken()


def test_full_preset_is_the_real_96_shard_plan(full_src: tuple[Path, object]) -> None:
    full, result = full_src
    index = json.loads((full / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 96 and result.n_shards == 96
    with safe_open(str(full / files[5]), framework="numpy") as f:  # layer 5
        names = list(f.keys())
        assert len([n for n in names if ".experts." in n]) == 896 * 6
        sl = f.get_slice(f"{LM}layers.5.block_sparse_moe.experts.895.w2.weight_packed")
        assert (sl.get_dtype(), sl.get_shape()) == ("U8", [3584, 1536])
    size = (full / files[5]).stat().st_size
    assert size > 15e9  # the real layer size, held as a hole
    assert result.disk_bytes < 200e6
    assert abs(index["metadata"]["total_size"] - 1_560_860_324_864) / 1_560_860_324_864 < 1e-4


@pytest.mark.parametrize("preset", ["tiny-f32"])
def test_unquantized_preset_has_plain_float_experts(tmp_path: Path, preset: str) -> None:
    synthesize(preset, tmp_path / preset)
    got = _read(tmp_path / preset / "model-00002-of-000011.safetensors")
    assert got[f"{LM}layers.1.block_sparse_moe.experts.3.w2.weight"] == ("F32", (LAT, FF_E))
    assert not any(re.search(r"weight_(packed|scale)$", n) for n in got)
    cfg = json.loads((tmp_path / preset / "config.json").read_text())
    assert "gate_lower_bound" not in cfg["text_config"]["linear_attn_config"]
    assert "quantization_config" not in cfg["text_config"]
