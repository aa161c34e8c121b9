"""A set checked against a manifest that names tensors only, as the seed kit that first converted
Kimi-K3 writes one: ``{"tensors": {NAME: {"sha256": HEX, "type": GGML_TYPE_NUMBER, "ne": [...]}}}``.
Every GGUF file in the folder is read tensor by tensor (whatever its split); each named tensor must be
found once, with that type, shape and SHA-256. k3lab's own manifest carries this view too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from k3lab.formats.files import hash_span
from k3lab.pipeline.checking.report import Report
from k3lab.pipeline.state.record import ManifestError


def kit_view(manifest: str | Path | None) -> dict[str, Any] | None:
    """A manifest in the seed kit's format (``{"tensors": {NAME: {"sha256", "type", "ne"}}}`` and no
    k3lab records): its tensors by name; None for a k3lab manifest (or none)."""
    from k3lab.formats.files import InputFileError, parse_json, read_bounded
    from k3lab.pipeline.state.record import MANIFEST_LIMIT

    if manifest is None:
        return None
    try:
        man = parse_json(read_bounded(manifest, MANIFEST_LIMIT, "manifest"), str(manifest))
    except InputFileError as e:
        raise ManifestError(str(e)) from None
    if not isinstance(man, dict) or "files" in man or not isinstance(man.get("tensors"), dict):
        return None
    for name, t in man["tensors"].items():
        ok = isinstance(t, dict) and isinstance(t.get("sha256"), str) and isinstance(t.get("type"), int)
        if not ok or not (isinstance(t.get("ne"), list) and all(isinstance(n, int) for n in t["ne"])):
            raise ManifestError(f"{manifest}: tensor {name!r}: needs sha256, type (a number) and ne")
    return man["tensors"]


def verify_by_tensors(out_dir: Path, kit: dict[str, Any], choice: Any) -> Report:
    """Every GGUF file in ``out_dir`` tensor by tensor against a manifest that names tensors only
    (how the seed kit writes one): each tensor's type, shape and SHA-256; every named tensor found
    exactly once."""
    from k3lab.formats import gguf_header
    from k3lab.formats.files import read_chunks

    report, seen = Report(), {}
    for path in sorted(out_dir.glob("*.gguf")):
        head = b""
        for chunk in read_chunks(path, path.stat().st_size, "GGUF file"):
            head += chunk
            try:
                header = gguf_header.parse(head, (), path.stat().st_size)
                break
            except gguf_header.NeedMore:
                continue
            except gguf_header.GGUFHeaderError as e:
                report.add("junk", path.name, f"{path.name}: {e}")
                header = None
                break
        else:
            report.add("junk", path.name, f"{path.name}: its header does not end")
            continue
        if header is None:
            continue
        report.files += 1
        sizes = {t.name: t.nbytes for t in header.tensors}
        chosen = set(choice.pick(path.name, sizes)) if choice is not None else set(sizes)
        with open(path, "rb") as fh:
            for t in header.tensors:
                want = kit.get(t.name)
                if t.name in seen:
                    report.add("set", path.name, f"{path.name}: tensor {t.name}: also in {seen[t.name]}")
                seen[t.name] = path.name
                if want is None:
                    report.add("stray", path.name, f"{path.name}: tensor {t.name}: not in the manifest")
                    continue
                if (gguf.GGMLQuantizationType(want["type"]).name, list(want["ne"])) != (t.type, list(t.ne)):
                    report.add(
                        "tensor",
                        path.name,
                        f"{path.name}: tensor {t.name}: {t.type} {list(t.ne)}, the manifest says type {want['type']} {want['ne']}",
                    )
                if t.name not in chosen:
                    continue
                fh.seek(t.offset)
                digest = hash_span(fh, t.nbytes)
                report.tensors += 1
                report.bytes += t.nbytes
                if digest != want["sha256"]:
                    report.add(
                        "tensor",
                        path.name,
                        f"{path.name}: tensor {t.name}: SHA-256 differs from the manifest",
                    )
    for name in sorted(kit.keys() - seen.keys())[:20]:
        report.add("missing", "", f"tensor {name}: in the manifest, in no file of {out_dir}")
    return report
