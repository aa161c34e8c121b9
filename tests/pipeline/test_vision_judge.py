"""``check-vision`` against Moonshot's own torch forward: towers built by Moonshot's classes
(``MoonViT3dPretrainedModel`` + ``PatchMergerMLPV2``, eager attention, float32), saved by
transformers, converted by ``k3lab vision``; Moonshot's processor and forward on two images give the
embeddings the mmproj's must equal. A wrong transform is named at the stage it first moves."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import moonshot
import numpy as np
import pytest
from judges import Source, check_mmproj
from PIL import Image

from k3lab.cli import main
from k3lab.kimi_k3.check_vision import SAMPLE_IMAGE, image_prompt
from k3lab.kimi_k3.synth.presets import tiny_config, tiny_f32_config
from k3lab.request import Request, check_vision

IN_PATCH_LIMIT = 256  # small, so that the second image is scaled down as Moonshot's processor does
TOWERS = {
    # the published 0.40B's tower: 4 heads of 384 (qkv 1536 on a 256-wide tower)
    "0.40B": {
        "vt_hidden_size": 256,
        "vt_intermediate_size": 512,
        "vt_num_attention_heads": 4,
        "mm_hidden_size": 256,
    },
    # Kimi-K3's: 12 heads of 128 on 1024, at two blocks of its 27
    "K3": {
        "vt_hidden_size": 1024,
        "vt_intermediate_size": 4096,
        "vt_num_attention_heads": 12,
        "mm_hidden_size": 1024,
    },
}


def _config(tower: str) -> dict:
    cfg = tiny_f32_config()  # float32 throughout, as the judge runs
    vis = cfg["vision_config"]
    vis.update(TOWERS[tower])
    vis.update(
        {
            "vt_num_hidden_layers": 2,
            "qkv_hidden_size": 1536,
            "init_pos_emb_height": 64,
            "init_pos_emb_width": 64,
            "text_hidden_size": cfg["text_config"]["hidden_size"],
        }
    )
    return cfg


def _second_image(path: Path) -> Path:
    """640 x 400 of gradients and blocks: 45 x 28 patches, over the limit, so resized first."""
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:400, 0:640]
    img = np.stack([x * 255 // 639, y * 255 // 399, (x + y) % 256], axis=-1).astype(np.uint8)
    for _ in range(12):
        r, c = rng.integers(0, 360), rng.integers(0, 600)
        img[r : r + 40, c : c + 40] = rng.integers(0, 256, 3)
    Image.fromarray(img).save(path)
    return path


@pytest.fixture(scope="module", params=sorted(TOWERS))
def converted(request: pytest.FixtureRequest, tiny_src: Path, tmp_path_factory: pytest.TempPathFactory):
    """(tower, Moonshot's net, its checkpoint, the mmproj k3lab wrote from it)."""
    net = moonshot.build(_config(request.param), seed=11, dtype="float32")
    root = tmp_path_factory.mktemp(f"tower-{request.param}")
    src = moonshot.save(net, root / "src", "one-file", tokenizer_from=tiny_src)
    pre = {
        "media_proc_cfg": {
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "patch_size": 14,
            "merge_kernel_size": 2,
            "in_patch_limit": IN_PATCH_LIMIT,
            "patch_limit_on_one_side": 512,
            "fixed_output_tokens": None,
        }
    }
    (src / "preprocessor_config.json").write_text(json.dumps(pre))
    mmproj = root / "out" / "mmproj-Kimi-K3-F32.gguf"
    assert main(["vision", "--meta", str(src), "--out", str(mmproj)]) == 0
    return request.param, net, src, mmproj


def test_the_mmproj_is_moonshots_tower_value_for_value(converted) -> None:
    _, _, src, mmproj = converted
    check_mmproj(src, mmproj)


def test_a_run_names_the_mmproj_by_its_file_type(converted, tiny_src: Path) -> None:
    """The name a conversion gives the mmproj beside its set says the file type the file declares (an
    F32 checkpoint's is -F32, never -BF16)."""
    from k3lab.pipeline.writing.single import beside_names

    _, _, src, mmproj = converted
    model = Request(meta=str(src)).load_model()
    declared = gguf.GGUFReader(mmproj).fields["general.file_type"].contents()
    assert gguf.LlamaFileType(declared).name == "ALL_F32"
    assert beside_names(model, "Kimi-K3", model.load_config(src))["mmproj"] == "mmproj-Kimi-K3-F32.gguf"
    assert beside_names(model, "Kimi-K3", model.load_config(tiny_src))["mmproj"] == "mmproj-Kimi-K3-BF16.gguf"


def test_a_bf16_tower_saved_in_size_shards_is_converted_exactly(tiny_src: Path, tmp_path: Path) -> None:
    """Moonshot's classes in their own dtype (BF16), saved as transformers' size shards (the tower's
    tensors across files): the matrices stay BF16 byte for byte, the norms and tables widen."""
    src = moonshot.save(moonshot.build(tiny_config(), seed=3), tmp_path / "src", "by-size:300000", tiny_src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for n, f in index.items() if n.startswith(("vision_tower.", "mm_projector."))}) > 1
    mmproj = tmp_path / "out" / "mmproj.gguf"
    assert main(["vision", "--meta", str(src), "--out", str(mmproj)]) == 0
    check_mmproj(src, mmproj)
    assert check_vision(Request(meta=str(src)), str(mmproj)).ok


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("image", ["sample", "over the limit"])
def test_check_vision_agrees_with_moonshots_forward(converted, image: str, tmp_path: Path) -> None:
    tower, net, src, mmproj = converted
    path = SAMPLE_IMAGE if image == "sample" else _second_image(tmp_path / "wide.png")
    check = check_vision(Request(meta=str(src)), str(mmproj), str(path))
    patches, grid, embeddings = moonshot.vision_forward(net, src, Image.open(path))
    assert check.ok, check.table()
    assert check.image.grid == grid and check.image.tokens == embeddings.shape[0]
    if image == "sample":  # 200 x 150: not a multiple of 28, within the limit: padded only
        assert (check.image.resized, check.image.padded) == ((200, 150), (224, 168))
    else:  # 45 x 28 patches > 256: scaled to 288 x 180 (20 x 12 whole patches), then padded to 28s
        assert (check.image.resized, check.image.padded, check.image.grid) == (
            (288, 180),
            (308, 196),
            (14, 22),
        )
    assert np.max(np.abs(check.image.patches - patches)) < 1e-6  # Moonshot's processor, the same pixels
    processor = moonshot.modeling().vision_processing.KimiK3VisionProcessor(
        json.loads((src / "preprocessor_config.json").read_text())["media_proc_cfg"]
    )
    assert image_prompt(check.image) == processor.make_image_prompt(*check.image.original)
    assert (
        processor.media_tokens_calculator({"type": "image", "image": Image.open(path)}) == check.image.tokens
    )
    assert _rel(check.embeddings, embeddings) < 1e-4, (tower, image, _rel(check.embeddings, embeddings))
    assert _rel(check.reference, embeddings) < 1e-4


def _edit(mmproj: Path, out: Path, change) -> Path:
    """A copy of the mmproj with ``change(tensors by name)`` applied to its bytes in place."""
    out.write_bytes(mmproj.read_bytes())
    r = gguf.GGUFReader(out, "r+")
    change({t.name: t.data for t in r.tensors})
    del r
    return out


@pytest.mark.parametrize("converted", ["K3"], indirect=True)
def test_a_wrong_transform_is_named_at_its_stage(converted, tmp_path: Path) -> None:
    _, _, src, mmproj = converted
    source, blocks = Source(src), 2
    heads_kept = _edit(
        mmproj,
        tmp_path / "no-deinterleave.gguf",
        lambda t: [
            t[f"v.blk.{i}.attn_qkv.weight"].__setitem__(
                ...,
                source.f32(f"vision_tower.encoder.blocks.{i}.wqkv.weight").reshape(
                    t[f"v.blk.{i}.attn_qkv.weight"].shape
                ),
            )
            for i in range(blocks)
        ],
    )

    def swap_norms(t) -> None:
        a, b = t["v.blk.1.ln1.weight"], t["v.blk.1.ln2.weight"]
        a[...], b[...] = b.copy(), a.copy()

    def transpose_table(t) -> None:
        table = t["v.position_embd.weight"]
        table[...] = table.copy().swapaxes(0, 1)

    cases = {
        "block 0": heads_kept,
        "block 1": _edit(mmproj, tmp_path / "swapped-norms.gguf", swap_norms),
        "position table": _edit(mmproj, tmp_path / "transposed-table.gguf", transpose_table),
    }
    for stage, path in cases.items():
        check = check_vision(Request(meta=str(src)), str(path))
        assert check.failed and check.failed[0] == stage, (path.name, check.table())
        before = [s["stage"] for s in check.stages][: [s["stage"] for s in check.stages].index(stage)]
        assert all(s["ok"] for s in check.stages if s["stage"] in before)
