"""Where the Hub is, who the user is there, and how long it may fail: read in one place.

huggingface_hub reads ``HF_ENDPOINT`` (and its own config) for the endpoint and ``HF_TOKEN`` (or its
login) for the token; k3lab asks it once per run and carries both to every worker (the token is kept
in memory, never written anywhere, nor printed). The retry budget is ``--retry-budget`` or
``RETRY_BUDGET``."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3lab.pipeline.hub.retry import RETRY_BUDGET


@dataclass(frozen=True)
class HubEnv:
    endpoint: str
    token: str | None = field(repr=False)
    budget: float


def hub_env(retry_budget: float | None = None) -> HubEnv:
    """The Hub this process talks to, as huggingface_hub finds it, and the retry budget."""
    from huggingface_hub import constants, get_token

    return HubEnv(
        constants.ENDPOINT, get_token(), RETRY_BUDGET if retry_budget is None else float(retry_budget)
    )
