"""What a published repo holds besides the set: the model card and ``TENSOR_MAP.md``, assembled here
and only here, for any model: its ``Guide`` gives the template and the base model, this module the
fields (every one derived from the plan, the records and the target, never from the maker's
machine), and the pipeline commits the bytes with the set's last files.

The card of a set is a function of the set: ``convert --push-to`` and ``publish`` of the same set
write the same card. "How it was made" is the conversion as the plan records it (source repo and
commit, or a local copy's fingerprint; the options that decide the bytes), with placeholders for
the maker's paths.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from string import Template
from typing import Any

from k3lab import __version__
from k3lab.errors import K3LabError
from k3lab.pipeline.model import Model
from k3lab.pipeline.publishing.upload import PushTarget
from k3lab.pipeline.state.record import MANIFEST_NAME, Record

CARD_NAME, TENSOR_MAP_NAME = "README.md", "TENSOR_MAP.md"
EXTRA_NAMES = (CARD_NAME, TENSOR_MAP_NAME)  # what ``extra_files`` makes
SCALAR_TYPES = (str, int, float, bool)
UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def size_unit(largest: int) -> tuple[str, int]:
    """The one unit a table of sizes is shown in: the largest that keeps its largest size >= 1."""
    return next(((u, n) for u, n in UNITS if largest >= n), UNITS[-1])


def in_unit(n: int, unit: tuple[str, int]) -> str:
    name, size = unit
    return f"{n:,} B" if size == 1 else f"{n / size:,.2f} {name}"


def files_table(records: list[Record]) -> str:
    unit = size_unit(max((r.size for r in records), default=0))
    rows = [f"| file | size ({unit[0]}) | tensors | SHA-256 |", "| --- | ---: | ---: | --- |"]
    for r in sorted(records, key=lambda r: (not r.is_text, r.number, r.file)):
        rows.append(f"| `{r.file}` | {in_unit(r.size, unit).split()[0]} | {len(r.tensors)} | `{r.sha256}` |")
    return "\n".join(rows)


def metadata_table(kvs: list[Any]) -> str:
    """File 1's keys, one row each (arrays shown by their length, long strings cut)."""
    rows = []
    for kv in kvs:
        value = kv.value
        if isinstance(value, (list, tuple)):
            shown = f"array of {len(value)}"
        elif isinstance(value, SCALAR_TYPES):
            shown = str(value).replace("\n", " ").replace("|", "\\|")
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
        else:
            shown = type(value).__name__
        rows.append(f"| `{kv.key}` | {shown} |")
    return "\n".join(rows)


def source_license(repo: str, endpoint: str | None, token: str | None) -> dict[str, str]:
    """The source repo's license as its card's front matter gives it: ``license`` and, for
    ``other``, ``license_name`` and ``license_link``; ``unknown`` when it says none or cannot be read."""
    try:
        from huggingface_hub import HfApi

        from k3lab.pipeline.hub import transport

        transport.install()
        card = HfApi(endpoint=endpoint, token=token).model_info(repo).card_data
    except Exception:  # the card is a courtesy: any failure reading it means "not said"
        return {"license": "unknown"}
    data = card.to_dict() if card is not None else {}
    found = {k: str(data[k]) for k in ("license", "license_name", "license_link") if data.get(k)}
    return found if "license" in found else {"license": "unknown"}


def _front_matter(model: Model, license: dict[str, str], has_mmproj: bool) -> str:
    base = model.guide.base_model if model.guide else ""
    lines = ["---"]
    if base:
        lines += [f"base_model: {base}", "base_model_relation: quantized"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in license.items()]
    lines += [
        "library_name: gguf",
        f"pipeline_tag: {'image-text-to-text' if has_mmproj else 'text-generation'}",
        "tags:",
        "- gguf",
        f"- {model.name}",
        "- llama.cpp",
        "- k3lab",
        "---",
    ]
    return "\n".join(lines)


def conversion_command(plan: Any) -> str:
    """The conversion as the plan records it: what decides the bytes, the maker's paths as placeholders."""
    pinned = plan.inputs.get("pinned") or {}
    options = plan.inputs.get("options") or {}
    cmd = ["k3lab", "convert"]
    if plan.model.guide is None or plan.model.module != "k3lab.kimi_k3.model":
        cmd += ["--model", plan.model.module]
    if pinned.get("repo"):
        cmd += ["--repo", pinned["repo"], "--revision", pinned["commit"], "--meta", "META"]
    else:
        cmd += ["--meta", "META", "--src", "SOURCE"]
    cmd += ["--out-dir", "OUT"]
    if options.get("outtype", "auto") != "auto":
        cmd += ["--outtype", options["outtype"]]
    if options.get("basename") not in (None, plan.model.default_basename):
        cmd += ["--name", options["basename"]]
    if options.get("chat_template"):
        cmd += ["--chat-template", "TEMPLATE.jinja"]
    return shlex.join(cmd)


def provenance(plan: Any) -> str:
    """Where the set's source was: a repo at a commit, or a local copy by its fingerprint."""
    pinned = plan.inputs.get("pinned") or {}
    if pinned.get("repo"):
        return f"`{pinned['repo']}` at commit `{pinned['commit']}`"
    shards = json.dumps(plan.inputs.get("files") or {}, sort_keys=True).encode()
    return (
        "a local copy (not read from the Hub; its files' fingerprint, SHA-256 of their sizes and header "
        f"hashes: `{hashlib.sha256(shards).hexdigest()[:16]}`)"
    )


def card_fields(
    model: Model,
    plan: Any,
    records: list[Record],
    kvs: list[Any],
    repo: str,
    license: dict[str, str],
    variants: dict[str, tuple[list[Record], str]] | None = None,
) -> dict[str, Any]:
    text = sorted((r for r in records if r.is_text), key=lambda r: r.number)
    others = sorted((r for r in records if not r.is_text), key=lambda r: r.file)
    mmproj = next((r.file for r in others if r.kind == "vision"), "")
    tokenizer = next((r.file for r in others if r.kind == "tokenizer"), "")
    imatrix = next((r.file for r in others if r.kind == "imatrix"), "")
    total = sum(r.size for r in text)
    pattern = text[0].file if len(text) == 1 else f"{plan.basename}-{plan.label}-*-of-*.gguf"
    local = f"{plan.basename}-GGUF"

    def download(*patterns: str) -> str:
        return (
            f"hf download {repo} " + " ".join(f'--include "{p}"' for p in patterns) + f" --local-dir {local}"
        )

    text_only = download(pattern)
    with_mmproj = download(pattern, mmproj) if mmproj else ""
    to_verify = download(pattern, MANIFEST_NAME, *(r.file for r in others))
    return {
        "front_matter": _front_matter(model, license, bool(mmproj)),
        "basename": plan.basename,
        "label": plan.label,
        "version": __version__,
        "base_model": model.guide.base_model if model.guide else "",
        "n_files": len(text),
        "total_size": in_unit(total, size_unit(total)),
        "n_tensors": plan.n_tensors,
        "extra_note": f", and {', '.join(f'`{r.file}`' for r in others)}" if others else "",
        "files_table": files_table(records),
        "command": conversion_command(plan),
        "provenance": provenance(plan),
        "repo": repo,
        "local": local,
        "pattern": pattern,
        "first_file": text[0].file if text else "",
        "mmproj": mmproj,
        "tokenizer": tokenizer,
        "download_text": text_only,
        "download_mmproj": with_mmproj,
        "download_verify": to_verify,
        "chat_template": model.guide.chat_template_words(
            next((kv.value for kv in kvs if kv.key == "tokenizer.chat_template"), None)
        )
        if model.guide
        else "",
        "singles_section": _singles_section(
            model, local, text[0].file if text else "", mmproj, tokenizer, with_mmproj, imatrix
        ),
        "metadata_table": metadata_table(kvs),
        "variants_section": variants_section(repo, local, variants or {}),
        "set_words": (
            f"One GGUF file (no split keys), {in_unit(total, size_unit(total))}"
            if len(text) == 1
            else f"One llama.cpp split set of {len(text)} files, {in_unit(total, size_unit(total))}"
        ),
        "split_words": (
            "the whole text model in one file"
            if len(text) == 1
            else "whole layers per output file (never a layer across two), whatever the source's files"
        ),
        "run_words": (
            "Download the text model (one file), then point llama.cpp at it:"
            if len(text) == 1
            else "Download the text model (the split set), then point llama.cpp at the first file; it finds "
            "the others:"
        ),
    }


def variants_section(repo: str, local: str, variants: dict[str, tuple[list[Record], str]]) -> str:
    """The card's part on the quantised variants the repo holds (each in its folder): a row each, with
    its size, bits per weight, what it takes to run and the ``llama-quantize`` command that makes the
    same bytes from the set above (empty when there are none)."""
    if not variants:
        return ""
    from k3lab.pipeline.quantizing.quality import measured_of, predicted_of

    largest = max(sum(r.size for r in recs) for recs, _ in variants.values())
    unit = size_unit(largest)
    rows = [
        f"| variant | files | size ({unit[0]}) | bits per weight | predicted loss | KL 99.9% / same top | download |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    made = []
    for label, (recs, command) in sorted(variants.items()):
        size = sum(r.size for r in recs)
        weights = sum(_count(t.ne) for r in recs for t in r.tensors)
        rows.append(
            f"| `{label}` | {len(recs)} | {in_unit(size, unit).split()[0]} | {8 * size / max(weights, 1):.2f} | "
            f"{predicted_of(command) or '-'} | {measured_of(command) or '-'} | "
            f'`hf download {repo} --include "{label}/*" --local-dir {local}` |'
        )
        if command:
            made += [f"`{label}`:", "", "```bash", command, "```", ""]
    return "\n".join(
        [
            "## Quantised variants",
            "",
            "Made from the set above, file by file, by llama.cpp's own quantiser (ggml's kernels, its rules for "
            "each tensor's type): each is byte for byte what `llama-quantize` makes with the command below, "
            "run in a folder holding the set. A folder per variant, its own `MANIFEST.json` in it (each "
            "tensor's SHA-256, type and the reason for it). llama.cpp maps the files: a machine runs a variant "
            "with about its size in memory (RAM, or RAM and VRAM), plus the context's cache; with the routed "
            "experts kept in RAM (`-ot exps=CPU`) a GPU needs only the rest. The predicted loss, where k3lab "
            "measured the set's cost tables (`k3lab quantize --fit`), is every tensor's expected squared change "
            "of its output under its type, summed: lower loses less; it compares the variants of one set. The KL, "
            "where k3lab measured it (`k3lab quantize --kl-text`), is `llama-perplexity --kl-divergence`'s: its "
            "99.9th percentile and the share of positions whose top token stays (the command's comment says on "
            "which text).",
            "",
            *rows,
            "",
            *made,
        ]
    )


def _count(ne: tuple[int, ...]) -> int:
    n = 1
    for d in ne:
        n *= d
    return n


def _singles_section(
    model: Model, local: str, first: str, mmproj: str, tokenizer: str, download: str, imatrix: str = ""
) -> str:
    """The card's part on the files beside the set (empty when there are none)."""
    parts = []
    if mmproj:
        note = model.guide.vision_note if model.guide else ""
        parts += [
            f"`{mmproj}` holds the vision tower and projector as a llama.cpp `clip` mmproj. {note}",
            "",
            "```bash",
            download,
            f'llama-mtmd-cli -m {local}/{first} --mmproj {local}/{mmproj} --image IMAGE.jpg -p "Describe the image."',
            "```",
            "",
        ]
    if tokenizer:
        parts += [
            f"`{tokenizer}` holds the vocabulary and every hyperparameter, no weights: for tools that only "
            "tokenize or read the metadata (llama.cpp's `vocab_only` loading).",
            "",
        ]
    if imatrix:
        parts += [
            f"`{imatrix}` is this set's importance matrix in llama-imatrix's format, computed by `k3lab imatrix` "
            "a layer at a time (the same sums as `llama-imatrix` on the same text, bit for bit); its calibration "
            "text's source and SHA-256 are in its metadata (`k3lab.calibration.source`, `k3lab.calibration.sha256`). "
            "The IQ variants need one:",
            "",
            "```bash",
            f"llama-quantize --imatrix {local}/{imatrix} {local}/{first} OUT.gguf IQ2_XXS",
            "```",
            "",
        ]
    return ("## Beside the set\n\n" + "\n".join(parts)) if parts else ""


def render_card(template: str, fields: dict[str, Any]) -> str:
    """``template`` with ``$name`` fields filled in; a field the template names and the run does not
    give is an error, never a blank."""
    try:
        return Template(template).substitute({k: str(v) for k, v in fields.items()})
    except (KeyError, ValueError) as e:
        raise K3LabError(f"model card template: no value for ${e.args[0]}") from None


def card_files(
    model: Model,
    plan: Any,
    records: list[Record],
    kvs: list[Any],
    repo: str,
    license: dict[str, str],
    variants: dict[str, tuple[list[Record], str]] | None = None,
) -> dict[str, bytes]:
    """The card and the tensor map of a published set (and of the variants its repo holds)."""
    from k3lab.pipeline.publishing.tensor_map import tensor_map_markdown

    if model.guide is None:
        raise K3LabError(f"{model.name}: the model brings no card (its Guide)")
    fields = card_fields(model, plan, records, kvs, repo, license, variants)
    return {
        CARD_NAME: render_card(model.guide.card_template(), fields).encode(),
        TENSOR_MAP_NAME: tensor_map_markdown(model).encode(),
    }


def extra_files(
    model: Model,
    plan: Any,
    records: list[Record],
    kvs: list[Any],
    target: PushTarget,
    variants: dict[str, tuple[list[Record], str]] | None = None,
) -> dict[str, bytes]:
    """What the last commit of a whole set adds beside it: the card (with the license of the source's
    repo, or of the model's base repo for a local copy) and the tensor map."""
    pinned = plan.inputs.get("pinned") or {}
    base = pinned.get("repo") or (model.guide.base_model if model.guide else "")
    license = source_license(base, target.endpoint, target.token) if base else {"license": "unknown"}
    return card_files(model, plan, records, kvs, target.repo, license, variants)
