"""Vision: the mmproj in the ``kimik3`` convention holds every tensor of the real tower, each
recoverable bit for bit, with the convention's keys; what is not the tower is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from checkpoint_edits import read_tensors, write_tensors
from conftest import run_cli, state_json
from judges import check_mmproj

from k3lab.cli import main

# the keys unsloth's fork (PR #70, tools/mtmd/clip.cpp for PROJECTOR_TYPE_KIMIK3) reads, and gguf's
KIMIK3_KEYS = {
    "general.architecture",
    "general.type",
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
    "clip.vision.attention.head_dim",
    "clip.vision.image_mean",
    "clip.vision.image_std",
    "clip.use_gelu",
    "clip.vision.attention.layer_norm_epsilon",
    "clip.vision.projector.scale_factor",
    "clip.vision.image_min_pixels",
    "clip.vision.image_max_pixels",
}
# what the convention cannot say, kept as keys of K3's own
K3_KEYS = {
    "clip.vision.block_norm_epsilon",
    "clip.vision.projector_gelu",
    "clip.vision.qkv_hidden_size",
    "clip.vision.merge_kernel_size",
    "clip.vision.merge_type",
    "clip.vision.mm_projector_type",
    "clip.vision.norm_type",
    "clip.vision.projector_hidden_act",
    "clip.vision.mm_hidden_size",
}


def mmproj(src: Path, out: Path) -> Path:
    path = out / "mmproj-Kimi-K3-BF16.gguf"
    assert main(["vision", "--meta", str(src), "--out", str(path)]) == 0
    return path


def test_the_mmproj_is_the_kimik3_convention(tiny_src: Path, tmp_path: Path) -> None:
    path = mmproj(tiny_src, tmp_path)
    check_mmproj(tiny_src, path)
    r = gguf.GGUFReader(path)
    assert set(r.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"} == KIMIK3_KEYS | K3_KEYS

    def value(key: str):
        return r.fields[key].contents()

    v = json.loads((tiny_src / "config.json").read_text())["vision_config"]
    assert (value("general.architecture"), value("general.type"), value("clip.projector_type")) == (
        "clip",
        "mmproj",
        "kimik3",
    )
    assert value("clip.vision.attention.head_dim") == v["qkv_hidden_size"] // v["vt_num_attention_heads"]
    assert value("clip.vision.embedding_length") == v["vt_hidden_size"]
    assert value("clip.vision.projection_dim") == v["text_hidden_size"]
    assert value("clip.vision.image_size") == 14 * v["init_pos_emb_height"]
    assert value("clip.vision.block_norm_epsilon") == 2.0**-7  # nn.RMSNorm(dim) in BF16
    assert value("clip.vision.projector_gelu") == "erf"
    assert value("clip.vision.image_max_pixels") == 16384 * 14 * 14
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    c = v["vt_hidden_size"]
    assert shapes["v.patch_embd.weight"] == [14, 14, 3, c]
    assert shapes["v.position_embd.weight"] == [c, v["init_pos_emb_width"], v["init_pos_emb_height"]]
    assert shapes["v.blk.0.attn_qkv.weight"] == [c, 3 * v["qkv_hidden_size"]]
    assert shapes["mm.post_norm.weight"] == [v["text_hidden_size"]]
    rec = state_json(tmp_path / ".k3lab" / "mmproj.json")
    assert rec["kind"] == "vision" and len(rec["tensors"]) == len(r.tensors)
    assert main(["verify", str(tmp_path), "--quiet"]) == 0


def _edited(tiny_src: Path, tmp_path: Path, edit, holder: str) -> Path:
    """A copy of tiny whose shard holding ``holder`` ``edit`` changes (the index kept in step)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][holder]
    ts = edit(read_tensors(shard))
    write_tensors(shard, ts)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name}
    index["weight_map"].update({t[0]: shard.name for t in ts})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


@pytest.mark.parametrize(
    ("what", "edit", "said"),
    [
        (
            "foreign",
            lambda ts: [*ts, ["mm_projector.pre_norm.weight", "BF16", (4,), b"\0" * 8]],
            "mm_projector.pre_norm.weight",
        ),
        (
            "a bias the tower has not",
            lambda ts: [*ts, ["vision_tower.encoder.blocks.0.wqkv.bias", "BF16", (4,), b"\0" * 8]],
            "vision_tower.encoder.blocks.0.wqkv.bias",
        ),
        (
            "missing",
            lambda ts: [t for t in ts if t[0] != "mm_projector.post_norm.weight"],
            "mm_projector.post_norm.weight",
        ),
        (
            "tampered shape",
            lambda ts: [
                [n, d, (s[0] // 2, *s[1:]), b[: len(b) // 2]]
                if n.endswith("blocks.1.wo.weight")
                else [n, d, s, b]
                for n, d, s, b in ts
            ],
            "vision_tower.encoder.blocks.1.wo.weight",
        ),
        (
            "F16 in a BF16 checkpoint",
            lambda ts: [[n, "F16" if n.endswith("0.mlp.fc0.weight") else d, s, b] for n, d, s, b in ts],
            "vision_tower.encoder.blocks.0.mlp.fc0.weight",
        ),
    ],
)
def test_what_is_not_the_tower_is_one_line(
    tiny_src: Path, tmp_path: Path, what: str, edit, said: str
) -> None:
    holder = (
        said
        if what in ("missing", "tampered shape", "F16 in a BF16 checkpoint")
        else "vision_tower.patch_embed.proj.weight"
    )
    src = _edited(tiny_src, tmp_path, edit, holder)
    out = tmp_path / "out" / "mmproj.gguf"
    done = run_cli(None, "vision", "--meta", str(src), "--out", str(out))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (what, done.stderr)
    assert said in lines[0] and "safetensors" in lines[0], (what, lines[0])
    assert not out.exists() and not any((tmp_path / "out").glob("*.gguf"))


def test_check_vision_says_ok_and_names_a_wrong_stage(tiny_src: Path, tmp_path: Path) -> None:
    """The command's verdict: OK on the file ``vision`` wrote; on one whose block 1 norms are swapped
    (bytes moved in place), FAILED at block 1, the stages before it still agreeing."""
    path = mmproj(tiny_src, tmp_path)
    done = run_cli(None, "check-vision", "--meta", str(tiny_src), "--mmproj", str(path))
    assert done.returncode == 0, done.stderr
    assert "image 200x150 -> resized 200x150, padded 224x168: 16x12 patches, 48 tokens" in done.stdout
    assert done.stdout.strip().endswith("check-vision OK")
    r = gguf.GGUFReader(path, "r+")
    t = {x.name: x for x in r.tensors}
    ln1, ln2 = t["v.blk.1.ln1.weight"].data, t["v.blk.1.ln2.weight"].data
    ln1[...], ln2[...] = ln2.copy(), ln1.copy()
    del r
    done = run_cli(None, "check-vision", "--meta", str(tiny_src), "--mmproj", str(path))
    assert done.returncode == 1
    assert done.stdout.strip().endswith("check-vision FAILED at block 1")
    rows = {
        line.split()[0] + (" " + line.split()[1] if line.startswith("block") else ""): line
        for line in done.stdout.splitlines()
    }
    assert rows["block 0"].endswith(" ok") and rows["block 1"].endswith("DIFFERS")


def test_check_vision_refuses_what_is_missing(tiny_src: Path, tmp_path: Path) -> None:
    done = run_cli(None, "check-vision", "--meta", str(tiny_src), "--mmproj", str(tmp_path / "none.gguf"))
    assert (
        done.returncode == 2
        and done.stderr.strip() == f"k3lab: error: {tmp_path / 'none.gguf'}: no such mmproj file"
    )


def test_check_vision_refuses_what_is_no_mmproj_of_this_tower(tiny_src: Path, tmp_path: Path) -> None:
    """Each in one line naming the file (and the tensor), exit 2: a file that is no GGUF, one cut
    short, an mmproj of another tower (the layer preset's: one block, not two), an image that is none."""
    good = mmproj(tiny_src, tmp_path / "good")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:3000])
    toy = tmp_path / "toy"
    from k3lab.kimi_k3.synth import synthesize

    synthesize("layer", toy, seed=0)
    other = mmproj(toy, tmp_path / "other")
    noise = tmp_path / "noise.png"
    noise.write_bytes(bytes(range(256)) * 4)
    cases = {
        "config": (str(tiny_src / "config.json"), None, "config.json: not a GGUF file (no GGUF magic)"),
        "cut": (str(cut), None, "cut.gguf: tensor v.patch_embd.weight: its bytes"),
        "other": (str(other), None, "tensor v.blk.1.ln1.weight (vision_tower.encoder.blocks.1.norm0.weight"),
        "noise": (str(good), str(noise), "noise.png: not an image PIL reads"),
        "folder": (str(good), str(tmp_path), f"{tmp_path}: not a regular file"),
    }
    for what, (file, image, said) in cases.items():
        args = ["check-vision", "--meta", str(tiny_src), "--mmproj", file] + (
            ["--image", image] if image else []
        )
        done = run_cli(None, *args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (what, done.stderr)
        assert said in done.stderr, (what, done.stderr)


def test_verify_re_derives_the_mmproj_from_the_source(tiny_src: Path, tmp_path: Path) -> None:
    """``verify OUT --src`` makes the mmproj's tensors again: its own source agrees, another seed's
    differs, tensor by tensor."""
    from k3lab.kimi_k3.synth import synthesize

    mmproj(tiny_src, tmp_path / "out")
    done = run_cli(None, "verify", str(tmp_path / "out"), "--src", str(tiny_src), "--quiet")
    assert done.returncode == 0 and "re-derived from the source" in done.stdout, done.stdout + done.stderr
    synthesize("tiny", tmp_path / "other", seed=1)
    bad = run_cli(None, "verify", str(tmp_path / "out"), "--src", str(tmp_path / "other"), "--quiet")
    assert bad.returncode == 1
    n = 6 * 2 + 6  # every tensor of tiny's two-block tower
    said = f"{n} problems: tensors the source re-derives differently (1 files: mmproj-Kimi-K3-BF16.gguf)"
    assert said in bad.stdout, bad.stdout
