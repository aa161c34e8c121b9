"""What a user asks of variants, as the pipeline's values: ``k3lab quantize``'s and ``convert
--variants``'s flags (a notebook makes the same ``VariantRequest``) become ``Variant``s, each an ftype
or a named recipe, ``llama-quantize``'s overrides, and an imatrix (a local file or ``ORG/NAME:PATH``),
every value checked before anything is read or written."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3lab.errors import K3LabError

Say = Callable[[str], None]


@dataclass(frozen=True)
class VariantRequest:
    """The variant flags by their names (an argparse namespace or a dict: ``of``)."""

    variants: str | None = None  # TYPE or RECIPE, comma-separated (--type of quantize, --variants of convert)
    label: str | None = None
    imatrix: str | None = None
    tensor_type: tuple[str, ...] = ()  # PATTERN=TYPE, in order
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    pure: bool = False
    leave_output_tensor: bool = False
    threads: int | None = None

    @classmethod
    def of(cls, given: Any) -> VariantRequest:
        given = given if isinstance(given, dict) else vars(given)
        names = {f.name for f in dataclasses.fields(cls)}
        out = {k: v for k, v in given.items() if k in names and v is not None}
        if "tensor_type" in out:
            out["tensor_type"] = tuple(out["tensor_type"])
        return cls(**out)

    def build(self) -> tuple[Any, ...]:
        """The ``Variant``s asked for (none when no type or recipe is named); one line for any flag
        that cannot mean anything (an unknown type or recipe, a pattern that is not a regex, an
        imatrix that is not one)."""
        names = [n.strip() for n in (self.variants or "").split(",") if n.strip()]
        if (
            not names
        ):  # (checked before ggml's binding is imported: a conversion without variants never pays it)
            flags = [
                f
                for f in ("label", "imatrix", "output_tensor_type", "token_embedding_type")
                if getattr(self, f)
            ]
            if flags or self.tensor_type or self.pure or self.leave_output_tensor:
                raise K3LabError(
                    f"--{(flags or ['tensor_type'])[0].replace('_', '-')} is for variants: name a --type"
                )
            return ()
        from k3lab.pipeline.quantizing.llama_types import FTYPES, QuantSpec
        from k3lab.pipeline.quantizing.recipes import RECIPES
        from k3lab.pipeline.quantizing.variant import Variant, check_label

        if self.label and len(names) > 1:
            raise K3LabError("--label names one variant: give one type or recipe with it")
        overrides = tuple(_override(t) for t in self.tensor_type)
        output, embedding = (_type(self.output_tensor_type, "--output-tensor-type"),
                             _type(self.token_embedding_type, "--token-embedding-type"))  # fmt: skip
        imatrix = None
        if self.imatrix:
            from k3lab.pipeline.quantizing.imatrix_files import open_imatrix

            imatrix = open_imatrix(self.imatrix)
        out = []
        for name in names:
            recipe = RECIPES.get(name)
            ftype = recipe.ftype if recipe else name.upper()
            if recipe is None and ftype not in FTYPES:
                raise K3LabError(
                    f"--type {name!r}: not a type llama-quantize makes nor a recipe "
                    f"(types: {', '.join(FTYPES)}; recipes: {', '.join(RECIPES)})"
                )
            spec = QuantSpec(ftype, overrides, output, embedding, self.pure, self.leave_output_tensor)
            label = check_label(self.label or (recipe.name if recipe else ftype))
            out.append(Variant(label, spec, imatrix, recipe.name if recipe else ""))
        return tuple(out)


def _type(name: str | None, flag: str) -> str | None:
    """A ggml type as llama-quantize parses one (any case)."""
    if name is None:
        return None
    from k3lab.formats.ggml import QUANTIZE_TARGETS, TYPE_IDS

    up = name.strip().upper()
    if TYPE_IDS.get(up, -1) not in QUANTIZE_TARGETS:
        raise K3LabError(f"{flag} {name!r}: not a type ggml quantises to")
    return up


def _override(text: str) -> tuple[str, str]:
    """``--tensor-type PATTERN=TYPE`` as llama-quantize reads it: the pattern lowercased, the type by name."""
    from k3lab.pipeline.quantizing.llama_types import compiled_pattern
    from k3lab.pipeline.quantizing.std_regex import lowercase

    pattern, sep, to = text.partition("=")
    if not sep or not pattern or not to:
        raise K3LabError(f"--tensor-type {text!r}: give PATTERN=TYPE (e.g. 'ffn_down_exps=q3_k')")
    pattern = lowercase(pattern)
    compiled_pattern(pattern)
    return pattern, _type(to, f"--tensor-type {text!r}:") or ""


def quantize(req: Any, asked: VariantRequest, say: Say | None = None) -> list[Any]:
    """Make the variants ``asked`` of the finished set in ``req.out_dir``: ``k3lab quantize``."""
    from k3lab.pipeline.quantizing.run import quantize_set

    if not req.out_dir:
        raise K3LabError("quantize: give the folder of a converted set")
    variants = asked.build()
    if not variants:
        raise K3LabError("--type: name a type (Q2_K, IQ2_XXS, ...) or a recipe (MoE-Q2_K, ...)")
    return quantize_set(
        req.load_model(),
        req.out_dir,
        variants,
        req.shards,
        jobs=req.jobs,
        quiet=True if req.quiet else (None if say is None else False),
        scheduler=req.scheduler,
        force=req.force,
        threads=asked.threads,
        publication=dataclasses.replace(pub, beside=False) if (pub := req.publication()) else None,
    )


def forecast(req: Any, asked: VariantRequest) -> list[Any]:
    """Each variant of the set in ``req.out_dir`` planned and nothing else (no file read or written:
    the folder's saved plan is enough, so ``k3lab plan --out-dir`` of the real model's headers gives
    the real model's figures): ``k3lab quantize --dry-run``."""
    from k3lab.pipeline.quantizing.start import plan_variants
    from k3lab.pipeline.state import OutputFolder

    variants = asked.build()
    if not variants:
        raise K3LabError("--type: name a type (Q2_K, IQ2_XXS, ...) or a recipe (MoE-Q2_K, ...)")
    folder = OutputFolder(req.out_dir or "")
    plan = folder.plans.require(req.load_model())
    return plan_variants(plan, folder.plans.kvs(plan), variants, forecast=True)


def describe(plans: list[Any]) -> str:
    """What ``--dry-run`` prints: per variant its files, size, bits per weight, the types it gives and
    what a user may not expect, and the ``llama-quantize`` command that makes the same bytes."""
    import math
    from collections import Counter

    from k3lab.util import human_bytes

    lines = []
    for vp in plans:
        weights = sum(math.prod(t.ne) for f in vp.files for t in f.tensors)
        by_type: Counter[str] = Counter()
        for f in vp.files:
            for t in f.tensors:
                by_type[t.type] += t.nbytes
        mix = ", ".join(f"{k} {human_bytes(v)}" for k, v in by_type.most_common())
        lines += [
            f"{vp.label}: {len(vp.files)} files, {human_bytes(vp.nbytes)}, {8 * vp.nbytes / max(weights, 1):.3f} bits "
            f"per weight ({mix})",
            *(f"  note: {n}" for n in vp.notes),
            f"  made as: {vp.command()}",
        ]
    return "\n".join(lines)
