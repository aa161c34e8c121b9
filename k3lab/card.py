"""What a published repo holds besides the set: the model card (``kimi_k3/card.md`` filled in from
the plan, the records and the command) and ``TENSOR_MAP.md``. The front makes them; the pipeline
commits them with the set's last files."""

from __future__ import annotations

import shlex
import sys
from importlib import resources
from typing import Any

from k3lab import __version__
from k3lab.pipeline.publishing.publish import COMMIT_EVERY, Publication, PushTarget, files_table, render_card
from k3lab.pipeline.writing.record import Record
from k3lab.util import human_bytes

SCALAR_TYPES = (str, int, float, bool)


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


DEFAULT_BASE_MODEL = "moonshotai/Kimi-K3"


def source_license(repo: str | None, endpoint: str | None, token: str | None) -> str:
    """The source repo's license as its card says (``other`` when it says none or cannot be read)."""
    if not repo:
        return "other"
    try:
        from huggingface_hub import HfApi

        card = HfApi(endpoint=endpoint, token=token).model_info(repo).card_data
        found = getattr(card, "license", None) if card is not None else None
    except Exception:  # the card is a courtesy: any failure reading it means "not said"
        return "other"
    return str(found) if found else "other"


def extra_files(out_dir: str, source: str, repo: str, license: str = "other") -> Any:
    """The ``Publication.extra_files`` of a run: (plan, records) -> the card and the tensor map.
    ``source``: the source repo (a local copy: the model's own repo)."""

    def make(plan: Any, records: list[Record]) -> dict[str, bytes]:
        from k3lab.pipeline.writing.folder import OutputFolder
        from k3lab.tensor_map import tensor_map_markdown

        text = sorted((r for r in records if r.is_text), key=lambda r: r.number)
        others = [r for r in records if not r.is_text]
        fields = {
            "base_model": source,
            "license": license,
            "basename": plan.basename,
            "label": plan.label,
            "version": __version__,
            "n_files": len(text),
            "total_size": human_bytes(sum(r.size for r in text)),
            "n_tensors": plan.n_tensors,
            "extra_note": f", and {', '.join(f'`{r.file}`' for r in others)}" if others else "",
            "files_table": files_table(records),
            "command": "k3lab " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "k3lab convert",
            "source": source,
            "source_commit": (plan.inputs.get("pinned") or {}).get("commit", "(a local copy)"),
            "repo": repo,
            "first_file": text[0].file if text else "",
            "metadata_table": metadata_table(OutputFolder(out_dir).load_kvs(plan)),
        }
        template = resources.files("k3lab.kimi_k3").joinpath("card.md").read_text()
        return {
            "README.md": render_card(template, fields).encode(),
            "TENSOR_MAP.md": tensor_map_markdown().encode(),
        }

    return make


def publication(
    target: PushTarget,
    out_dir: str,
    source_repo: str | None,
    commit_every: float | None = None,
    force: bool = False,
) -> Publication:
    """A run that publishes to ``target``: its card names ``source_repo`` (a local copy: the model's
    own repo) and that repo's license, read from the Hub."""
    license = source_license(source_repo, target.endpoint, target.token)
    return Publication(
        target,
        extra_files(out_dir, source_repo or DEFAULT_BASE_MODEL, target.repo, license),
        COMMIT_EVERY if commit_every is None else commit_every,
        force,
        ("README.md", "TENSOR_MAP.md"),
    )
