"""The router: which prefill and decode workers serve a request, and whether to admit it at all.

- `policy`: RouteRequest / RouteDecision / Pools, the Policy contract, the registry (`make_policy`).
- `baselines`: least_loaded, round_robin. `goodput` (+ `goodput_state`): predicted TTFT/TPOT per pair.
- `latency`: the latency model a router config names.
- `admission`: queue, refuse or serve anyway when the policy says no (the pools from a `PoolSource`).

No Ray here: the ingress's view of the pools is cluster/serve/membership.py; the policies in placement's
simulator are benchmarks/router_sim.py.
"""

from cluster.router import baselines, goodput  # noqa: F401  (register their policies)
from cluster.router.latency import DEFAULT_PROFILE, latency_from_config
from cluster.router.policy import POLICIES, Policy, RouteDecision, RouteRequest, known_policies, make_policy

__all__ = ["DEFAULT_PROFILE", "POLICIES", "Policy", "RouteDecision", "RouteRequest", "known_policies",
           "latency_from_config", "make_policy"]
