"""Vision: the mmproj holds every vision/projector source tensor, recoverable bit for bit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_edits import read_tensors, write_tensors
from conftest import state_json
from judges import Source

from k3lab.cli import main
from k3lab.formats.numerics import f32_to_bf16_bits
from k3lab.kimi_k3.config import K3Config
from k3lab.kimi_k3.rules import VISION_RULES
from k3lab.kimi_k3.transforms import TRANSFORMS

# what llama.cpp reads for a Kimi-K2.5 (kimik25) projector, as its converter writes them
K25_KEYS = {
    "general.architecture",
    "general.name",
    "general.file_type",
    "clip.has_vision_encoder",
    "clip.projector_type",
    "clip.vision.projection_dim",
    "clip.vision.image_size",
    "clip.vision.patch_size",
    "clip.vision.embedding_length",
    "clip.vision.feed_forward_length",
    "clip.vision.block_count",
    "clip.vision.attention.head_count",
    "clip.vision.image_mean",
    "clip.vision.image_std",
    "vision.pos_emb_height",
    "vision.pos_emb_width",
    "vision.pos_emb_time",
    "clip.use_gelu",
    "clip.vision.attention.layer_norm_epsilon",
    "clip.vision.projector.scale_factor",
    "clip.vision.image_min_pixels",
    "clip.vision.image_max_pixels",
}
K3_KEYS = {
    "clip.vision.qkv_hidden_size",
    "clip.vision.merge_kernel_size",
    "clip.vision.merge_type",
    "clip.vision.mm_projector_type",
    "clip.vision.norm_type",
    "clip.vision.projector_hidden_act",
    "clip.vision.mm_hidden_size",
}


def _mmproj(src: Path, out: Path) -> Path:
    path = out / "mmproj-Kimi-K3-BF16.gguf"
    assert main(["vision", "--meta", str(src), "--out", str(path)]) == 0
    return path


def _rule_for(name: str):
    for rule in VISION_RULES:
        pattern = re.escape(rule.output).replace(r"\{bid\}", r"(\d+)")
        m = re.fullmatch(pattern, name)
        if m:
            return rule, (int(m.group(1)) if m.groups() else None)
    return None, None


def _k25_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's KimiK25Model.permute, restated: rows (head, d/4, 2, 2) -> (head, 2, d/4, 2)."""
    out_dim = w.shape[0]
    d = out_dim // n_head
    return w.reshape(n_head, d // 4, 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_recovers_everything(src_dir: Path, path: Path) -> None:
    src = Source(src_dir)
    cfg = K3Config.load(src_dir)
    wanted = {n for n in src.index if n.startswith(("vision_tower.", "mm_projector."))}
    recovered = set()
    for t in gguf.GGUFReader(path).tensors:
        rule, bid = _rule_for(t.name)
        assert rule is not None, f"output tensor {t.name} is unexplained"
        (source_name,) = rule.source_names(cfg, bid)
        original = src.raw(source_name)
        data = np.asarray(t.data)
        if t.tensor_type.name == "F32":  # widened exactly from BF16: narrow back
            assert original.dtype == np.uint16
            data = f32_to_bf16_bits(data.astype(np.float32))
        else:
            assert t.tensor_type.name == "BF16"
            data = data.view(np.uint16)
        shaped = data.reshape(TRANSFORMS[rule.transform].shape(original.shape, cfg=cfg))
        back = TRANSFORMS[rule.transform].inverse(shaped, cfg=cfg)
        assert back.shape == original.shape and np.array_equal(back, original), t.name
        if rule.transform == "qkv_rope_split":  # and the permutation is the one llama.cpp's converter makes
            q = original.shape[0] // 3
            heads = cfg.vision["vt_num_attention_heads"]
            expected = np.concatenate(
                [
                    _k25_permute(original[:q], heads),
                    _k25_permute(original[q : 2 * q], heads),
                    original[2 * q :],
                ]
            )
            assert np.array_equal(shaped, expected)
        recovered.add(source_name)
    assert recovered == wanted, sorted(wanted ^ recovered)[:3]


def test_mmproj_recovers_every_vision_tensor(tiny_src: Path, tmp_path: Path) -> None:
    path = _mmproj(tiny_src, tmp_path)
    _check_recovers_everything(tiny_src, path)
    r = gguf.GGUFReader(path)
    assert set(r.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"} == K25_KEYS | K3_KEYS
    assert r.fields["clip.projector_type"].contents() == "kimik25"
    assert r.fields["general.architecture"].contents() == "clip"
    assert r.fields["clip.vision.block_count"].contents() == 2
    assert r.fields["clip.vision.merge_type"].contents() == "sd2_tpool"
    rec = state_json(tmp_path / ".k3lab" / "mmproj.json")
    assert rec["kind"] == "vision" and len(rec["tensors"]) == len(r.tensors)
    assert main(["verify", str(tmp_path), "--quiet"]) == 0


def test_biases_that_are_present_are_converted(tiny_src: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    shard = src / "model-00011-of-000011.safetensors"
    ts = read_tensors(shard)
    extra = {"vision_tower.encoder.blocks.1.wqkv.bias": 192, "vision_tower.encoder.blocks.0.wo.bias": 64}
    rng = np.random.default_rng(0)
    for name, n in extra.items():
        ts.append([name, "BF16", (n,), f32_to_bf16_bits(rng.standard_normal(n).astype(np.float32)).tobytes()])
    write_tensors(shard, ts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: shard.name for n in extra})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    path = _mmproj(src, tmp_path / "out")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"v.blk.1.attn_qkv.bias", "v.blk.0.attn_out.bias"} <= names
    _check_recovers_everything(src, path)


def test_unknown_vision_tensor_is_an_error(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    shard = src / "model-00010-of-000011.safetensors"
    ts = read_tensors(shard)
    ts.append(["mm_projector.mystery.weight", "BF16", (4,), b"\0" * 8])
    write_tensors(shard, ts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["mm_projector.mystery.weight"] = shard.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out" / "mmproj.gguf"
    assert main(["vision", "--meta", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "mm_projector.mystery.weight" in err and not out.exists()
