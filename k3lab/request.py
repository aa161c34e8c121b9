"""One way in: the CLI's flags, a notebook's parameters and the demo all make a ``Request``, and
everything a run needs is made from it here and only here: the model (``--model``), the source
(``--src`` or ``--repo``, with its scratch), the run options, the publication and the plan; the same
request makes the same run. Where the Hub is and who the user is there, huggingface_hub reads from
its own environment (``HF_ENDPOINT``, ``HF_TOKEN`` or its login); a run carries both to its workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3lab import values
from k3lab.errors import K3LabError

if TYPE_CHECKING:  # (imported where used: `k3lab --help` loads no numpy, gguf or Hub client)
    from k3lab.pipeline.model import Model
    from k3lab.pipeline.sources.base import SourceSpec

MODELS = {"kimi-k3": "k3lab.kimi_k3.model"}  # --model NAME -> its module; a module path works too
Say = Callable[[str], None]
HUB_FLAGS = {"scratch": "--repo", "revision": "--repo", "keep_source": "--repo", "retry_budget": "--repo or --push-to"}  # fmt: skip


@dataclass(frozen=True)
class Request:
    """A user's request, as plain values (the CLI's flags by their names)."""

    meta: str | None = None
    src: str | None = None
    repo: str | None = None
    revision: str | None = None
    scratch: str | None = None
    keep_source: bool = False
    retry_budget: float | None = None
    model: str = "kimi-k3"
    out_dir: str | None = None
    outtype: str = "auto"
    name: str | None = None
    chat_template: str | None = None
    force: bool = False
    shards: str | list[int] | None = None
    jobs: int = 1
    scheduler: str | None = None
    quiet: bool = False
    push_to: str | None = None
    push_branch: str | None = None
    private: bool = False
    keep_local: bool = False
    commit_every: float | None = None
    text_only: bool = False  # publish the split set alone (not the mmproj and the tokenizer GGUF)
    split_max_size: str | None = None  # gguf-split's limits per output file (default: see ``split``)
    split_max_tensors: int | None = None

    def __post_init__(self) -> None:
        """Every value checked as the CLI checks it (a notebook makes a Request directly)."""
        values.count(self.jobs, 1, values.MAX_JOBS, "--jobs")
        if self.scheduler and self.jobs != 1:
            raise K3LabError("--jobs and --scheduler both say where to run: give one (workers set their own)")
        for flag in ("retry_budget", "commit_every"):
            if getattr(self, flag) is not None:
                values.seconds(getattr(self, flag), "--" + flag.replace("_", "-"))
        checks = {"repo": values.repo_id, "push_to": values.repo_id, "revision": values.revision}
        for flag, check in (checks | {"push_branch": values.revision}).items():
            if getattr(self, flag) is not None:
                check(getattr(self, flag), "--" + flag.replace("_", "-"))

    @classmethod
    def of(cls, given: Any) -> Request:
        """A request from anything with these names (an argparse namespace, a dict): the rest is ignored."""
        given = given if isinstance(given, dict) else vars(given)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in given.items() if k in names and v is not None})

    # --- what it asks for -------------------------------------------------------------------------
    def load_model(self) -> Model:
        return _model(self.model)

    def source(self, scratch: str | Path | None = None) -> SourceSpec:
        """Where the checkpoint is: ``src`` (local, default ``meta``) or ``repo`` (the Hub), never both;
        Hub downloads go to ``scratch`` (``--scratch``, else the one given: the output folder's)."""
        if self.repo and self.src:
            raise K3LabError("--repo and --src name two sources: give one")
        for flag, needs in HUB_FLAGS.items():  # (publishing spends a retry budget too)
            if getattr(self, flag) not in (None, False) and not (self.repo or self.push_to and "push" in needs):  # fmt: skip
                raise K3LabError(f"--{flag.replace('_', '-')} is for the Hub: it needs {needs}")
        if self.meta is None:
            raise K3LabError("--meta: give the folder of config.json, the index and the tokenizer files")
        model = self.load_model()
        if self.repo:
            from k3lab.pipeline.hub.env import hub_env
            from k3lab.pipeline.sources.hub import hub_spec

            return hub_spec(
                self.meta,
                self.repo,
                revision=self.revision,
                scratch=self.scratch or scratch,
                endpoint=hub_env().endpoint,
                token=hub_env().token,
                keep_source=self.keep_source,
                retry_budget=self.retry_budget,
                meta_files=model.meta_files,
                optional_meta=model.optional_meta,
            )
        from k3lab.pipeline.sources.base import SourceSpec

        return SourceSpec.local(self.meta, self.src or self.meta)

    def output_source(self) -> SourceSpec:
        """The source of a command that writes an output folder: downloads in its scratch."""
        from k3lab.pipeline.state import OutputFolder

        return self.source(OutputFolder(self.out_dir).scratch if self.out_dir else None)

    def run_options(self) -> tuple[Any, str]:
        """``RunOptions`` and the line saying which chat template is embedded."""
        from k3lab.pipeline.planning.split import make_split
        from k3lab.pipeline.running.start import RunOptions
        from k3lab.values import basename as check_basename

        model = self.load_model()
        if self.name is not None:
            check_basename(self.name)
        split = make_split(self.split_max_size, self.split_max_tensors)
        template, line = None, ""
        if model.guide is not None and self.meta is not None:
            template, line = model.guide.chat_template(Path(self.meta), self.chat_template)
        return RunOptions(self.outtype, self.name, template, self.force, split), line

    def publication(self) -> Any:
        """``--push-to`` and its flags as a ``Publication`` (None without ``--push-to``)."""
        if not self.push_to:
            for flag in ("push_branch", "private", "keep_local", "commit_every", "text_only"):
                if getattr(self, flag) not in (None, False):
                    raise K3LabError(f"--{flag.replace('_', '-')} is for publishing: it needs --push-to")
            return None
        from k3lab.pipeline.hub.env import hub_env
        from k3lab.pipeline.publishing.publish import COMMIT_EVERY, Publication
        from k3lab.pipeline.publishing.upload import PushTarget

        env = hub_env(self.retry_budget)
        branch = self.push_branch or "main"
        target = PushTarget(
            self.push_to, branch, self.private, self.keep_local, env.endpoint, env.token, env.budget
        )
        every = COMMIT_EVERY if self.commit_every is None else self.commit_every
        return Publication(target, every, self.force, beside=not self.text_only)


@functools.lru_cache(maxsize=8)
def _model(name: str) -> Model:
    from k3lab.pipeline.model import load_model

    module = MODELS.get(name, name)
    try:
        return load_model(module)
    except (ImportError, TypeError):
        raise K3LabError(
            f"--model {name!r}: not a model (known: {', '.join(MODELS)}; or a module holding a MODEL)"
        ) from None


@contextlib.contextmanager
def scratch(req: Request) -> Iterator[str | None]:
    """Where a command that writes no output folder downloads shards: ``--scratch``, else a folder of
    its own, removed at the end (shards come and go one at a time)."""
    if req.scratch or not req.repo:
        yield req.scratch
        return
    with tempfile.TemporaryDirectory(prefix="k3lab-scratch-") as tmp:
        yield tmp


# --- the runs ---------------------------------------------------------------------------------------


def plan(req: Request, say: Say | None = None) -> Any:
    """The plan of converting the request's source (saved in ``out_dir`` when given, as convert would)."""
    from k3lab.pipeline.planning.planner import build_plan
    from k3lab.pipeline.running.start import start_run
    from k3lab.values import basename as check_basename

    model = req.load_model()
    options, _ = req.run_options()
    if req.out_dir:
        with start_run(model, req.output_source(), req.out_dir, options, say=say) as (the_plan, _, _):
            return the_plan
    basename = check_basename(model.default_basename if options.basename is None else options.basename)
    with opened_source(req) as source:
        cfg = model.load_config(Path(req.meta or ""))
        return build_plan(
            model, cfg, source, options.outtype, basename, options.chat_template, split=options.split
        )


def convert(
    req: Request, say: Say | None = None, run_token: str | None = None, variants: tuple = ()
) -> list[Any]:
    """Convert the requested files (published when asked), and ``variants`` of each: ``k3lab convert``."""
    from k3lab.pipeline.running.runner import convert_shards

    if not req.out_dir:
        raise K3LabError("--out-dir: give the folder to write the set into")
    spec = req.output_source()
    options, line = req.run_options()
    options = dataclasses.replace(options, note=line or None, variants=variants)  # (note: once checked)
    return convert_shards(
        req.load_model(),
        spec,
        req.out_dir,
        req.shards,
        jobs=req.jobs,
        quiet=True if req.quiet else (None if say is None else False),
        scheduler=req.scheduler,
        options=options,
        run_token=run_token,
        publication=req.publication(),
    )


def publish(req: Request, say: Say | None = None) -> tuple[int, int, str | None, str]:
    """Push the converted set in ``out_dir`` to ``push_to``: (uploaded, already there, the commit, where)."""
    from k3lab.pipeline.publishing.publish import publish_folder

    publication = req.publication()
    if publication is None:
        raise K3LabError("publish: give the repo as ORG/NAME")
    pushed, kept, commit = publish_folder(req.load_model(), req.out_dir, publication, say)
    return pushed, kept, commit, publication.target.where()


def tensor_map(req: Request) -> str:
    """TENSOR_MAP.md of the requested model: ``k3lab tensor-map``."""
    from k3lab.pipeline.publishing.tensor_map import tensor_map_markdown

    return tensor_map_markdown(req.load_model())


def verify(
    req: Request,
    manifest: str | None = None,
    every: bool = False,
    sample: int | None = None,
    tensors: str | None = None,
    seed: int | None = None,
    source_revision: str | None = None,
) -> Any:
    """Check the set in ``out_dir``: a folder, or a Hub repo (``ORG/NAME``, by ranges at ``revision``;
    the source's: ``source_revision``); with a source, re-derive it. The tensors whose bytes are checked:
    ``every``, ``sample`` per file (``seed``), those matching ``tensors`` (a folder: all; a repo: none)."""
    import random

    from k3lab.pipeline.checking.hub_set import Choice
    from k3lab.pipeline.checking.report import Verified
    from k3lab.pipeline.checking.verify import verify as verify_set

    remote = bool(req.out_dir) and values.is_repo(req.out_dir or "")
    values.verify_choice(remote, req.revision, req.repo, source_revision, every, sample, tensors, seed)
    set_revision = req.revision if remote else None
    if remote:
        req = dataclasses.replace(req, revision=source_revision)
    rederive = req.src is not None or req.repo is not None or req.meta is not None  # (--src: --meta)
    if rederive and req.meta is None:
        if req.repo:
            raise K3LabError("--repo needs --meta (a folder for the config, index and tokenizer files)")
        req = dataclasses.replace(req, meta=req.src)
    seed = random.randrange(2**32) if seed is None else seed
    picked = bool(every or sample or tensors)
    choice = Choice(every, sample, tensors, seed) if picked or remote else None
    if remote:
        from k3lab.pipeline.checking.hub_set import verify_at
        from k3lab.pipeline.hub.env import hub_env

        env = hub_env(req.retry_budget)
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(opened_source(req)) if rederive else None
            args = (req.out_dir or "", set_revision, env.endpoint, env.token, env.budget)
            report = verify_at(*args, choice=choice, model=req.load_model(), source=source)
    else:
        with scratch(req) as tmp:
            spec = req.source(tmp) if rederive else None
            report = verify_set(req.out_dir, manifest, spec, req.load_model(), quiet=req.quiet, choice=choice)
    return Verified(report, rederive, remote, sample, seed, picked)


def vision(req: Request, out: str) -> Path:
    from k3lab.pipeline.state import OutputFolder
    from k3lab.pipeline.writing.single import convert_single

    return convert_single(req.load_model(), req.source(OutputFolder(Path(out).parent).scratch), out)


def tokenizer(req: Request, out: str, say: Say | None = None) -> Path:
    from k3lab.pipeline.writing.single import convert_tokenizer

    options, line = req.run_options()
    if say is not None and line:
        say(line)
    return convert_tokenizer(req.load_model(), req.meta, out, options.chat_template)


def prepared(req: Request) -> tuple[Any, Any]:
    """The plan of converting into ``out_dir`` as ``convert`` would use it (the saved one when it is
    current, else a new one), and the source it reads; nothing is written (a notebook, or a batch run
    holding the folder)."""
    from k3lab.pipeline.running.start import prepare

    options, _ = req.run_options()
    spec = req.output_source()
    source = opened(req, spec)
    return prepare(req.load_model(), spec, req.out_dir or "", options, source=source)[0], source


def opened(req: Request, spec: SourceSpec | None = None) -> Any:
    """The request's source, opened fresh, its metadata fetched (a notebook's: it stays open)."""
    from k3lab.pipeline.sources import open_source

    source = open_source(spec or req.source(), fresh=True)
    source.fetch_meta()
    return source


@contextlib.contextmanager
def opened_source(req: Request) -> Iterator[Any]:
    """The request's source, opened fresh with its metadata, and closed (downloads removed) after."""
    with scratch(req) as tmp:
        source = opened(req, req.source(tmp))
        try:
            yield source
        finally:
            source.close()


def check_logits(req: Request, gguf: str, *how: Any) -> tuple[Any, Any]:
    """The reference forward on the source against llama.cpp on ``gguf``: the whole model (for
    information) and every stage of llama.cpp's graph (the verdict). ``how``: prompt, tokens,
    threshold, mode, and the judge (``"moonshot"``: the reference judged by Moonshot's own forward)."""
    return _check(req, "check_logits", gguf, *how)


def check_vision(
    req: Request, mmproj: str, image: str | None = None, threshold: float = 1e-4, source: Any = None
) -> Any:
    """The model's vision reference on ``image`` (default: the package's sample) with the weights
    ``mmproj`` holds and with the source's, stage by stage (``source``: one a notebook holds open)."""
    return _check(req, "check_vision", mmproj, image, threshold, source=source)


def _check(req: Request, name: str, *args: Any, source: Any = None) -> Any:
    """The model's ``name`` check (its guide's) on the request's source, opened fresh (or ``source``)."""
    model = req.load_model()
    if (check := getattr(model.guide, name, None)) is None:
        raise K3LabError(f"{model.name}: has no {name.replace('_', '-')}")
    with contextlib.nullcontext(source) if source is not None else opened_source(req) as opened:
        return check(opened, *args)


def batch(
    req: Request,
    notebook: str | None,
    workers: int,
    run_id: str | None,
    runs_dir: str,
    timeouts: tuple[float, float] | None = None,
) -> tuple[Path, list]:
    """``notebook`` once per requested output file with papermill, as part of one run holding the
    folder: ``k3lab batch``; ``notebook`` by default 03's. ``timeouts``: (per cell, per notebook) seconds."""
    import time
    import uuid

    from k3lab.explore.paths import CONVERT_NOTEBOOK, notebook_path
    from k3lab.pipeline.running.batch import CELL_TIMEOUT, NOTEBOOK_TIMEOUT, declared_parameters
    from k3lab.pipeline.running.runner import run_notebooks

    notebook = str(notebook_path(notebook or CONVERT_NOTEBOOK))  # (an old name runs as its new one)
    if not Path(notebook).is_file():
        raise K3LabError(f"{notebook}: notebook not found (the repository's are in notebooks/)")
    declared_parameters(notebook)  # (before anything is written: one that cannot run per file is refused)
    options, _ = req.run_options()
    run_dir = Path(runs_dir) / (run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    results = run_notebooks(
        req.load_model(),
        req.output_source(),
        req.out_dir or "",
        options,
        notebook,
        req.shards,
        req.scheduler,
        workers,
        run_dir,
        timeouts or (CELL_TIMEOUT, NOTEBOOK_TIMEOUT),
    )
    return run_dir, results
