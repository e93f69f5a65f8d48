"""Exceptions raised by the placement package.

Every user-triggerable problem (bad config value, unknown catalog name, a model that cannot fit, a plan
that needs more GPUs than the cluster has) raises a `PlacementError` whose message names the bad value
and how to fix it. The CLI prints the message and exits with status 2 instead of a traceback.
"""

from __future__ import annotations


class PlacementError(ValueError):
    """A planner input or request that cannot be satisfied; the message names the constraint."""


class UnknownNameError(PlacementError):
    """A catalog name that does not exist; the message lists the supported names."""

    def __init__(self, kind: str, name: str, supported: list[str]) -> None:
        super().__init__(f"unknown {kind} {name!r}; supported: {', '.join(sorted(supported))}")
        self.kind = kind
        self.name = name
        self.supported = supported


class DoesNotFitError(PlacementError):
    """The model's weights (plus a minimum KV cache) do not fit the GPU memory of a configuration."""


class InfeasibleError(PlacementError):
    """No configuration meets the SLO; `best` carries the best attainable numbers (a PlacementPlan)."""

    def __init__(self, message: str, best: object | None = None) -> None:
        super().__init__(message)
        self.best = best
