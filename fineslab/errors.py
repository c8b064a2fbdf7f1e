"""The error taxonomy of fineslab: one small hierarchy, in one place.

Two families matter to callers:

- `TransientError`: the system is healthy but momentarily cannot do what was asked (the arena is
  full, a request cannot meet its deadline now). Retrying later may succeed; a server maps these
  to 429/503 with `Retry-After`, never to a 500.
- `FatalError`: a defect in the input or the environment (bad configuration, a missing profile,
  an SGLang version without the hooks we need). Retrying cannot help; report it and stop.

Every error carries a message meant for an operator: what was wrong, and what to do about it.
"""

from __future__ import annotations


class FineslabError(Exception):
    """Base class of every error fineslab raises on purpose."""


class TransientError(FineslabError):
    """The request may succeed if retried later."""


class FatalError(FineslabError):
    """The input or the environment is wrong; retrying cannot help."""


class ConfigError(FatalError, ValueError):
    """A configuration value (YAML, CLI, environment) is invalid."""


class EnvironmentSetupError(FatalError, RuntimeError):
    """The installed software cannot do what was asked (missing package, wrong version)."""


class ArenaExhausted(TransientError):
    """No free slab or block is left in the arena right now."""


class InvalidBlockError(FatalError, ValueError):
    """A block id that is out of range, foreign to the caller, or already free."""


class PlacementInfeasible(FatalError, ValueError):
    """A model cannot be placed as asked (no SLO-feasible operating point, or no GPU fits it)."""


class IntegrityError(FatalError, AssertionError):
    """A shared data structure (the slab table) breaks one of its invariants: a defect."""
