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
    include_weights: tuple[str, ...] = ()
    exclude_weights: tuple[str, ...] = ()
    override_kv: tuple[str, ...] = ()
    kl_text: str | None = None  # measure each variant's KL from the lossless set on this text (small sets)
    kl_context: int = 512

    @classmethod
    def of(cls, given: Any) -> VariantRequest:
        given = given if isinstance(given, dict) else vars(given)
        names = {f.name for f in dataclasses.fields(cls)}
        out = {k: v for k, v in given.items() if k in names and v is not None}
        for key in ("tensor_type", "include_weights", "exclude_weights", "override_kv"):
            if key in out:
                out[key] = tuple(out[key])
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
                for f in (
                    "label",
                    "imatrix",
                    "output_tensor_type",
                    "token_embedding_type",
                    "include_weights",
                    "exclude_weights",
                )
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
        overrides = tuple(o for t in self.tensor_type for o in _overrides(t))
        output, embedding = (_type(self.output_tensor_type, "--output-tensor-type"),
                             _type(self.token_embedding_type, "--token-embedding-type"))  # fmt: skip
        imatrix = None
        if self.imatrix:
            from k3lab.pipeline.quantizing.imatrix_files import open_imatrix

            if self.include_weights and self.exclude_weights:
                raise K3LabError(
                    "--include-weights and --exclude-weights cannot go together (llama-quantize refuses both)"
                )
            imatrix = open_imatrix(self.imatrix).filtered(self.include_weights, self.exclude_weights)
        out = []
        for name in names:
            recipe = RECIPES.get(name)
            ftype = recipe.ftype if recipe else name.upper()
            if recipe is None and ftype not in FTYPES:
                raise K3LabError(
                    f"--type {name!r}: not a type llama-quantize makes nor a recipe "
                    f"(types: {', '.join(FTYPES)}; recipes: {', '.join(RECIPES)})"
                )
            from k3lab.cli_flags import TYPE_FILE

            whole = [t[len(TYPE_FILE) :] for t in self.tensor_type if t.startswith(TYPE_FILE)]
            file = whole[0] if len(whole) == len(self.tensor_type) == 1 else None  # (the file alone)
            kv = tuple(_kv_override(o) for o in self.override_kv)
            spec = QuantSpec(
                ftype, overrides, output, embedding, self.pure, self.leave_output_tensor, file, kv
            )
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


def _kv_override(text: str) -> tuple[str, str, str]:
    """``--override-kv KEY=TYPE:VALUE`` as llama.cpp parses it (``string_parse_kv_override``): a key of
    1 to 127 bytes, a type of int, float, bool (true or false) or str (127 bytes at most)."""
    key, sep, rest = text.partition("=")
    kind, colon, value = rest.partition(":")
    if not sep or not 0 < len(key.encode("utf-8", "surrogateescape")) < 128:
        raise K3LabError(f"--override-kv {text!r}: give KEY=TYPE:VALUE, a key of 1 to 127 bytes")
    if not colon or kind not in ("int", "float", "bool", "str"):
        raise K3LabError(f"--override-kv {text!r}: the type is int, float, bool or str (llama.cpp's)")
    if kind == "bool" and value not in ("true", "false"):
        raise K3LabError(f"--override-kv {text!r}: a bool is true or false")
    if kind == "str" and len(value.encode("utf-8", "surrogateescape")) > 127:
        raise K3LabError(f"--override-kv {text!r}: a str of at most 127 bytes (llama.cpp's)")
    return key, kind, value


MAX_TYPE_FILE = 16 << 20  # bytes of a --tensor-type-file (a line per tensor of Kimi-K3 is 2 MB)


def _overrides(given: str) -> list[tuple[str, str]]:
    """One ``--tensor-type`` entry, or every entry of a ``--tensor-type-file`` (white space apart, as
    llama-quantize reads it: ``file >> arg``)."""
    from k3lab.cli_flags import TYPE_FILE
    from k3lab.formats.files import InputFileError, read_bounded

    if not given.startswith(TYPE_FILE):
        return [_override(given)]
    path = given[len(TYPE_FILE) :]
    try:
        words = read_bounded(path, MAX_TYPE_FILE, "--tensor-type-file").split()
    except InputFileError as e:
        raise K3LabError(str(e)) from None
    out = []
    for i, word in enumerate(words):
        try:
            out.append(_override(word.decode("utf-8", "surrogateescape")))
        except K3LabError as e:
            raise K3LabError(f"--tensor-type-file {path}: entry {i + 1}: {e}") from None
    return out


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
    text = _kl_text(asked.kl_text) if asked.kl_text else None
    if text is not None:
        from k3lab.explore.divergence import check_text

        check_text(_lossless_first(req), text[1], asked.kl_context)
    made = quantize_set(
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
    if text is not None:
        measure_kl(req, [v.label for v in variants], text, asked.kl_context, say)
    return made


def _lossless_first(req: Any) -> Any:
    """The first file of the lossless set in ``req.out_dir`` (what llama.cpp loads it by)."""
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(req.out_dir)
    return folder.output(folder.plans.require(req.load_model()).files[0].filename)


def _kl_text(path: str) -> tuple[str, str, str]:
    """``--kl-text``'s file: (its name, its text, its SHA-256), one line when it is not a text file."""
    import hashlib
    import os.path

    from k3lab.formats.files import read_bounded

    data = read_bounded(path, 64 << 20, "--kl-text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise K3LabError(f"--kl-text {path}: not UTF-8 text") from None
    return os.path.basename(path), text, hashlib.sha256(data).hexdigest()


def measure_kl(
    req: Any, labels: list[str], text: tuple[str, str, str], n_ctx: int, say: Say | None = None
) -> list[Any]:
    """Each variant's KL from the lossless set on ``text`` as ``llama-perplexity --kl-divergence`` reports it
    (``explore.divergence``: llama.cpp runs both here, so small sets), kept in the variant's plan and
    stated in its manifest's ``made_as`` (and so on the card)."""
    from k3lab.explore.divergence import kl_stats
    from k3lab.pipeline.state import OutputFolder

    folder = OutputFolder(req.out_dir)
    base = _lossless_first(req)
    name, body, sha = text
    out = []
    for label in labels:
        vf = folder.variant(label)
        vp = vf.variant_plan.load()
        if vp is None or not all(vf.records.is_complete(f.number, f.filename, f.digest) for f in vp.files):
            continue
        got = kl_stats(base, vf.output(vp.files[0].filename), label, body, n_ctx)
        vp.kl = (f"(llama-perplexity --kl-divergence, -c {n_ctx}, {got.positions} positions of {name} SHA-256 "
                 f"{sha[:16]}): mean {got.mean:.6f}, median {got.median:.6f}, 99% {got.p99:.6f}, 99.9% "
                 f"{got.p999:.6f}, max {got.maximum:.6f}, same-top {100 * got.same_top:.3f}%")  # fmt: skip
        vf.variant_plan.save(vp)
        vf.records.merge(made_as=vp.made_as())
        if say is not None:
            say(got.line())
        out.append(got)
    return out


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


def fit(
    req: Any,
    asked: VariantRequest,
    size: str | None = None,
    rows: int | None = None,
    say: Say | None = None,
    floor: str = "Q2_K",
    ram: str | None = None,
    vram: str | None = None,
    context: int | None = None,
) -> Any:
    """``k3lab quantize SET --fit SIZE`` (or ``--fit-ram R [--fit-vram V] [--fit-context N]``): the mix
    that loses least within SIZE bytes of files, or on a machine of R bytes of RAM (and V of VRAM: the
    routed experts in RAM, the rest on the GPU, as ``--cpu-moe -ngl 99`` places them) with the cache
    of a context of N tokens beside it (default: the model's own context length, what llama.cpp
    allocates without ``-c``) (``fit.choose_mix``, with the set's imatrix: ``--imatrix``, else
    ``SET/imatrix.gguf`` when there is one), written as llama-quantize's ``--tensor-type-file``
    (``SET/LABEL.tensor-types.txt``) and made as the variant LABEL: (the fit, the files made).
    ``floor``: ``--fit-floor``."""
    from pathlib import Path

    from k3lab.cli_flags import TYPE_FILE
    from k3lab.pipeline.planning.split import parse_size
    from k3lab.pipeline.quantizing.costs import ROWS
    from k3lab.pipeline.quantizing.fit import Budget, choose_mix, floor_bits
    from k3lab.pipeline.quantizing.imatrix_files import open_imatrix
    from k3lab.pipeline.quantizing.variant import check_label
    from k3lab.pipeline.state import OutputFolder
    from k3lab.pipeline.state.codec import write_atomically

    if not req.out_dir:
        raise K3LabError("quantize --fit: give the folder of a converted set")
    if asked.variants or asked.tensor_type or asked.pure:
        raise K3LabError("--fit chooses every tensor's type: no --type, --tensor-type or --pure with it")
    if (size is None) == (ram is None):
        raise K3LabError(
            "give --fit SIZE (the files' bytes) or --fit-ram SIZE (a machine's memory), one of them"
        )
    if size is not None and (vram is not None or context is not None):
        raise K3LabError(
            "--fit-vram and --fit-context go with --fit-ram (a machine), not --fit (the files' bytes)"
        )
    bits = floor_bits(floor)
    folder = OutputFolder(req.out_dir)
    model = req.load_model()
    plan = folder.plans.require(model)
    if size is not None:
        budget = Budget(parse_size(size, "--fit"))
        label = check_label(asked.label or f"fit-{size}")
    else:
        assert ram is not None
        if model.context_bytes is None:
            raise K3LabError(
                f"--fit-ram: k3lab does not know what a {model.name} context costs; give --fit SIZE"
            )
        kvs = {kv.key: kv.value for kv in folder.plans.kvs(plan)}
        n_ctx = context or int(kvs.get(f"{model.name}.context_length", 4096))
        budget = Budget(parse_size(ram, "--fit-ram"), None if vram is None else parse_size(vram, "--fit-vram"),
                        model.context_bytes(kvs, n_ctx))  # fmt: skip
        label = check_label(asked.label or f"fit-{ram}" + (f"-{vram}" if vram else ""))
        if say is not None:
            say(f"--fit-ram: a context of {n_ctx:,} tokens takes {budget.context:,} bytes beside the weights")
    own = folder.path / "imatrix.gguf"
    location = asked.imatrix or (str(own) if own.is_file() else None)
    use = open_imatrix(location) if location else None
    fitted, ftype = choose_mix(folder, plan, label, use, budget, bits, rows or ROWS, say)
    type_file = Path(req.out_dir) / f"{label}.tensor-types.txt"
    write_atomically(type_file, lambda fh: fh.write(fitted.type_file().encode()))
    if say is not None:
        where = "" if fitted.on_gpu is None else f" ({fitted.on_gpu:,} on the GPU)"
        say(f"--fit {budget.words()}: {len(fitted.types)} tensors, {fitted.nbytes:,} bytes{where} (the smallest "
            f"mix {fitted.smallest:,}, the lossless set {fitted.largest:,}), loss {fitted.loss:.4g}; {type_file}")  # fmt: skip
    chosen = dataclasses.replace(
        asked, variants=ftype, label=label, imatrix=location, tensor_type=(TYPE_FILE + str(type_file),)
    )
    return fitted, quantize(req, chosen, say)
