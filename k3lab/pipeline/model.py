"""The model interface: everything the pipeline needs to know of an architecture, handed to it as
one object. The pipeline imports no model; a model module (``k3lab.kimi_k3``, or the toy model in
the tests) builds a ``Model`` and the front passes it in.

A model is data and plain functions:
- a config: loaded and validated from ``config.json`` (``load_config``), rebuilt from a saved plan
  (``config_from_dict``); whatever type the model likes, with ``raw``, ``path``, ``n_layer`` and
  ``n_expert``;
- a table of ``Rule``s (checkpoint names -> GGUF names, a transform and a type policy each) and the
  ``Transform``s they name (``pipeline.streams``);
- how a checkpoint is cut in units (layer k, then the output tensors), what tags a unit and a config
  have (which rules apply), and what each source tensor must be (``layout``: dtype and shape);
- file 1's GGUF metadata, the standalone tokenizer's, and optionally a second, single-file output
  (the vision mmproj) described the same way (``SingleFileModel``).

A ``Model`` pickles as a reference to its module (``__reduce__``), so a task sent to a worker
process or a Dask worker on another machine carries the model by name, never its code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from k3lab.formats.gguf_stream import KV
from k3lab.pipeline.streams import Transform

ALL, OUTPUT, ANY = "all", "output", "any"


class ModelConfig(Protocol):
    raw: dict[str, Any]
    path: str

    @property
    def n_layer(self) -> int: ...

    @property
    def n_expert(self) -> int: ...


@dataclass(frozen=True)
class TensorSpec:
    """What the config says one source tensor is (``kind``: how synthetic values are drawn;
    ``accepts``: the dtypes a checkpoint may hold it in, none given: ``dtype`` if it is not a float
    type, else any float type)."""

    name: str
    dtype: str  # safetensors dtype: BF16, F32, U8
    shape: tuple[int, ...]
    kind: str = ""
    accepts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """One output tensor: its name (``{bid}`` is the unit), its source tensors (``{e}`` expands over
    the routed experts, expert-major), the transform, the type policy (``keep``: the source's float
    type or ``--outtype``; ``f32``; ``mxfp4``), the unit tag it applies to (``layers``) and the config
    tag it needs (``when``)."""

    output: str
    sources: tuple[str, ...]
    transform: str = "copy"
    dtype: str = "keep"
    layers: str = ALL
    when: str = ANY
    note: str = ""
    prefix: str = ""
    optional: bool = False  # e.g. a .bias the config says is absent: converted when present

    @property
    def per_expert(self) -> bool:
        return any("{e}" in s for s in self.sources)

    def applies(self, unit_tags: frozenset[str], config_tags: frozenset[str]) -> bool:
        return self.layers in unit_tags and (self.when == ANY or self.when in config_tags)

    def source_names(self, cfg: ModelConfig, bid: int | None) -> tuple[str, ...]:
        return _source_names(self, cfg.n_expert if self.per_expert else 0, bid)

    def first_source_name(self, bid: int | None) -> str:
        """The first of ``source_names`` (expert 0's first), without building the rest."""
        return self.prefix + self.sources[0].format(bid=bid, e=0 if self.per_expert else None)

    def output_name(self, bid: int | None) -> str:
        return self.output.format(bid=bid)


@functools.lru_cache(maxsize=64)
def _source_names(rule: Rule, n_expert: int, bid: int | None) -> tuple[str, ...]:
    """A rule's source names at a unit, expert-major (all of expert 0's sources, then expert 1's ...):
    kept for the few rules of the unit being planned (a stack of experts asks for them several times;
    they are not kept for long: Kimi-K3's are 5,376 names a stack)."""
    if not rule.per_expert:
        return tuple(rule.prefix + s.format(bid=bid, e=None) for s in rule.sources)
    # each template cut once around its expert number: joining strings is a third of formatting
    cut = [(rule.prefix + s.format(bid=bid, e="\0")).split("\0") for s in rule.sources]
    return tuple(str(e).join(p) for e in range(n_expert) for p in cut)


def rules_digest(rules: tuple[Rule, ...]) -> str:
    """A saved plan names rules by position: it is only reused by the same table."""
    return hashlib.sha256(repr(rules).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SingleFileModel:
    """A second output of one file beside the split set (Kimi-K3's vision mmproj)."""

    arch: str  # its GGUF general.architecture
    kind: str  # the record's kind ("vision")
    key: str  # the record's name in .k3lab/ ("mmproj")
    prefixes: tuple[str, ...]  # the source tensors it takes
    rules: tuple[Rule, ...]
    units: Callable[[Any], list[int | None]]
    unit_tags: Callable[[Any, int | None], frozenset[str]]
    layout: Callable[[Any], dict[str, TensorSpec]]
    kvs: Callable[[Any, Path], list[KV]]  # (config, meta folder) -> its metadata
    check_config: Callable[[Any], None]  # one line when the config cannot describe it
    file_name: str = "{basename}-{key}.gguf"  # its name beside a set of that basename, and {type}:
    type_name: Callable[[Any], str] | None = None  # config -> its file type's name (the mmproj's: BF16, F32)


@dataclass(frozen=True)
class Guide:
    """What the front (CLI, notebooks, demo, a published repo's card) needs of a model, besides what
    the pipeline does: plain data and functions, so that a model module is all a new family adds.

    - ``base_model``: the Hub repo a conversion of a local copy is taken to come from (the card's
      ``base_model``), and whose card's license the published card repeats;
    - ``card_template``: the model card, a ``string.Template`` (``pipeline.publishing.card`` fills it in);
    - ``rules_file``: the module holding the rule table (TENSOR_MAP.md names it);
    - ``tags``: what each rule's unit and config tags mean, in words (TENSOR_MAP.md);
    - ``chat_template``: (meta folder, ``--chat-template`` file or None) -> (the template to embed,
      or None for the one the model's metadata brings, and one line saying which);
    - ``chat_template_words``: a set's embedded chat template (its text, or None) -> the card's
      paragraph on it (which template, how to chat with it);
    - ``demo``: (folder, seed) -> writes a small synthetic checkpoint there (``k3lab demo``);
    - ``vision_note``: what llama.cpp does with the model's single file today (the card says it);
    - ``check_logits``: (opened source, GGUF, prompt, token ids, threshold, mode) -> (the whole
      model's report, the per-stage one): ``k3lab check-logits``;
    - ``check_vision``: (opened source, mmproj, image or None, threshold) -> the per-stage
      report: ``k3lab check-vision``;
    - ``calibration_text``: the default calibration text of ``k3lab imatrix`` (read with its special
      tokens parsed: it holds conversations in the model's chat format).
    Both import what they need when called (``k3lab --help`` loads no NumPy reference).
    """

    base_model: str
    card_template: Callable[[], str]
    rules_file: str
    tags: Mapping[str, str]
    chat_template: Callable[[Path, Path | None], tuple[str | None, str]]
    demo: Callable[[Path, int], Any]
    chat_template_words: Callable[[str | None], str] = lambda text: (
        f"Chat template: {'in the metadata' if text else 'none'}."
    )
    vision_note: str = ""  # what llama.cpp does with the model's mmproj today, in a sentence or two
    check_logits: Callable[..., tuple[Any, Any]] | None = None
    check_vision: Callable[..., Any] | None = None
    # the model's own calibration text (``k3lab imatrix`` without --calibration), special tokens in it
    calibration_text: Path | None = None


@dataclass(frozen=True)
class CalibrationStep:
    """One step of the imatrix stage (the calibration text moved through the model a step at a
    time): its name, the state it reads and writes per chunk (named [tokens, width] arrays), the
    set's tensors it holds (``names``, and those under ``prefix``), its layer (-1: none), and
    ``rows``: a matrix whose rows the tokens pick (the embedding: no graph)."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    names: tuple[str, ...] = ()
    prefix: str = ""
    layer: int = -1
    rows: str = ""

    def owns(self, tensor: str) -> bool:
        return tensor in self.names or bool(self.prefix and tensor.startswith(self.prefix))


class Calibration(Protocol):
    """What the imatrix stage needs of a model: its steps (from file 1's metadata) and each step's
    graph of ggml operations (``formats.ggml_compute.Graph``), built from the step's weights and the
    chunk's state; the graph records its matrix products, whose inputs the stage sums."""

    def steps(self, kvs: dict[str, Any]) -> list[CalibrationStep]: ...

    def build(
        self,
        kvs: dict[str, Any],
        step: CalibrationStep,
        g: Any,
        w: Any,
        state: dict[str, Any],
        slices: list[tuple[int, int]],
    ) -> dict[str, Any]:
        """One chunk's graph; ``slices``: its tokens [a, b) as llama.cpp's ubatches hold them (what a
        kernel is given at once can change its arithmetic: attention, whose queries a ubatch holds)."""


@dataclass(frozen=True, eq=False)
class Model:
    name: str  # GGUF general.architecture
    module: str  # the module whose MODEL this is (how it pickles)
    default_basename: str
    text_prefix: str  # source tensors of the split set start with it
    meta_files: tuple[str, ...]  # the metadata files a plan is made from (their bytes are in its digest)
    optional_meta: tuple[str, ...]
    rules: tuple[Rule, ...]
    transforms: Mapping[str, Transform]
    load_config: Callable[[Path], Any]
    config_from_dict: Callable[[dict[str, Any], str], Any]
    unit_of: Callable[[str], int | None]  # the layer a source tensor name belongs to, or None
    unit_tags: Callable[[Any, int | None], frozenset[str]]
    config_tags: Callable[[Any], frozenset[str]]
    layout: Callable[[Any, int | None], dict[str, TensorSpec]]
    # (config, meta folder, general.name, file type label, chat template, [(tensor, shape)]) -> file 1's KVs
    file_kvs: Callable[[Any, Path, str, str, str | None, list[tuple[str, tuple[int, ...]]]], list[KV]]
    tokenizer_kvs: Callable[[Path, str | None], list[KV]] | None = None
    tokenizer_name: str = "{basename}-tokenizer.gguf"  # the standalone tokenizer GGUF beside a set
    single: SingleFileModel | None = None
    other_prefixes: tuple[str, ...] = field(default=())  # source tensors of other outputs
    guide: Guide | None = None  # what the front needs (the card, TENSOR_MAP.md, the demo)
    # (config, tensor name -> file) -> None, or one line when the checkpoint's tensors cannot be what
    # the config says (Kimi-K3: MXFP4-packed experts without a quantization_config)
    check_source: Callable[[Any, dict[str, str]], None] | None = None
    calibration: Calibration | None = None  # the imatrix stage's steps and graphs
    # (file 1's keys by name, n_ctx) -> the bytes the runtime allocates for a context of n_ctx tokens
    # beside the weights (its KV cache and recurrent states): what ``quantize --fit-ram`` leaves room for
    context_bytes: Callable[[dict[str, Any], int], int] | None = None

    @property
    def rules_digest(self) -> str:
        return rules_digest(self.rules)

    def units(self, cfg: Any) -> list[int | None]:
        """Layers in order, then the output tensors: output file k is made from unit k-1."""
        return [*range(cfg.n_layer), None]

    def __reduce__(self) -> tuple[Callable[[str], Model], tuple[str]]:
        return load_model, (self.module,)


def load_model(module: str) -> Model:
    """The ``MODEL`` of a model module (how a model travels to a worker: by name)."""
    model = getattr(importlib.import_module(module), "MODEL", None)
    if not isinstance(model, Model):
        raise TypeError(f"{module}: has no MODEL")
    return model
