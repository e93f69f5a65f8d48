"""The colocated worker: one engine does prefill and decode (the baseline mode)."""

from __future__ import annotations

from engine.host import EngineHost


class ColocatedWorker(EngineHost):
    """Serves whole requests with ``generate_stream`` (inherited)."""

    role = "colocated"
