"""What the router serves: one `ModelRoute` per model, and `RouterSettings` for the node.

Routes are plain frozen data so that the launcher builds them from its plan and tests build them
by hand against a standalone SGLang runtime or a fake backend. The live parts (replica state,
queues) are in `replicas.py` and `queues.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fineslab.errors import ConfigError
from fineslab.scheduler.local import TtftPredictor

ON_DROP = ("reject", "best_effort")


@dataclass(frozen=True)
class ReplicaRoute:
    """One runtime serving the model: its id (also its slab-table owner name) and base URL."""

    runtime_id: str
    base_url: str


@dataclass(frozen=True)
class TokenBudget:
    """The KV tokens each runtime of a route holds (SGLang's `max_total_num_tokens`, set by
    `--max-total-tokens`) and its page size: SGLang refuses a prompt over `total_tokens` - 6
    and clips a request's new tokens to what the budget holds once the prompt's pages and one
    more are taken; a request clipped to none waits in its queue for ever (SGLang's own pool
    too). The router refuses both at once (`requests.read_request`)."""

    total_tokens: int
    page_size: int = 1
    #: What sets it, for the refusal's message.
    set_by: str = "--max-total-tokens"

    def __post_init__(self) -> None:
        if self.total_tokens < 1 or self.page_size < 1:
            raise ConfigError(f"a token budget must be positive: {self}")

    @property
    def longest_prompt(self) -> int:
        return self.total_tokens - 6

    def most_new_tokens(self, prompt_tokens: int) -> int:
        """The new tokens SGLang lets a prompt of `prompt_tokens` ask for (< 1: none)."""
        paged = -(-prompt_tokens // self.page_size) * self.page_size
        return min(self.total_tokens - prompt_tokens - 2,
                   self.total_tokens - paged - self.page_size - 1)


@dataclass(frozen=True)
class ModelRoute:
    """A model the router serves.

    `kv_free_tokens(runtime_id)` reports how many more KV tokens that runtime can get now (its
    free blocks plus the arena's free slabs, from the slab table); None when unknown (SGLang's
    own pool). It caps T_max of the local scheduler.
    """

    name: str
    replicas: tuple[ReplicaRoute, ...]
    ttft_slo_s: float
    predictor: TtftPredictor
    tokenizer_dir: str | None
    context_tokens: int
    max_running_requests: int = 32
    max_batched_tokens: int = 16384
    #: Token ids are checked against it at the router (None: only their type is checked).
    vocab_size: int | None = None
    kv_free_tokens: Callable[[str], int | None] | None = field(default=None, compare=False)
    #: The runtimes pick their prefill batches with the same policy (`FINESLAB_ENGINE_POLICY`):
    #: each request goes to them with its deadline in SGLang's `priority` field.
    engine_deadlines: bool = False
    #: Each runtime's KV token budget where it is smaller than a request may be (None: the
    #: context binds first).
    token_budget: TokenBudget | None = None
    #: The budget a runtime's KV limit (`fineslab ctl limit`) leaves it now; None without one.
    kv_limit_budget: Callable[[str], TokenBudget | None] | None = field(default=None,
                                                                       compare=False)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError(f"route {self.name}: no replica")
        if self.ttft_slo_s <= 0 or self.context_tokens < 1 or self.max_running_requests < 1:
            raise ConfigError(f"route {self.name}: SLO, context and max running must be positive")

    def budget(self) -> TokenBudget | None:
        """The tokens a request may need of one runtime: `token_budget`, or less where every
        runtime's KV limit holds less (a request no runtime can ever hold would wait in SGLang's
        queue until its client gave up; the router refuses it at once)."""
        if self.kv_limit_budget is None:
            return self.token_budget
        limited = [self.kv_limit_budget(r.runtime_id) for r in self.replicas]
        if any(b is None for b in limited):
            return self.token_budget
        widest = max((b for b in limited if b is not None), key=lambda b: b.total_tokens)
        if self.token_budget is None or widest.total_tokens < self.token_budget.total_tokens:
            return widest
        return self.token_budget


@dataclass(frozen=True)
class RouterSettings:
    """Node-wide router behaviour (from the fleet config's `router:` section)."""

    api_key: str | None = None
    on_drop: str = "reject"
    drop_status: int = 429
    retry_after_s: int = 1
    batch_policy: str = "adaptive-early-shed"
    #: How often a queue re-decides when nothing happens (deadlines move with the clock).
    tick_s: float = 0.05
    #: Longest wait for a runtime's next bytes (response head or stream chunk) before the
    #: request fails with 504 and the runtime is suspected hung.
    upstream_timeout_s: float = 600.0
    #: Larger request bodies are refused with 413 before they are read whole.
    max_body_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.on_drop not in ON_DROP:
            raise ConfigError(f"on_drop must be one of {ON_DROP}, got {self.on_drop!r}")
        if self.drop_status not in (429, 503):
            raise ConfigError(f"drop_status must be 429 or 503, got {self.drop_status}")
        if self.upstream_timeout_s <= 0 or self.max_body_bytes < 1024:
            raise ConfigError("upstream_timeout_s must be positive and max_body_bytes >= 1024")


@dataclass(frozen=True)
class KVLimits:
    """How the router reaches the KV limits of the slab tables (the fleet gives it; None when
    the fleet has no arena)."""

    set: Callable[[str, int | None], None]  # runtime id, bytes (None: no limit)
    get: Callable[[str], int | None]  # runtime id -> its limit in bytes
    slab_bytes: Callable[[str], int | None]  # runtime id -> its arena's slab size (None: none)
