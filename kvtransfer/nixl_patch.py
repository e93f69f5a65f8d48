"""Give NIXL's progress thread a sleep between polls (nixl 1.5.1 busy-polls a full core per agent).

nixl 1.5.1's Python wrapper (``nixl._api.nixl_agent``) builds the native ``nixlAgentConfig`` itself and
hard-codes ``pthrDelay = 0`` (microseconds between progress-thread polls), so every agent, including
the one vLLM's NixlConnector creates in each EngineCore, spins one core at 100% even when idle.

The fix swaps ``nixlAgent`` in the native bindings module for a subclass that, when the progress thread
is on and the delay is 0, sets the delay before constructing the native agent. ``nixl_agent`` looks the
class up on the bindings module at call time, so every agent created after the patch gets the delay,
whoever imported nixl first. The progress thread stays on: without it, transfers wait for engine steps.

``register()`` is our ``vllm.general_plugins`` entry point (see pyproject.toml): vLLM calls it in every
process it starts. It does not import nixl (1 s, and vLLM wants to set UCX env vars before that import):
if nixl is not imported yet, a meta-path hook patches the bindings module the moment it is loaded.

Env: ``SAAF_NIXL_PTHR_DELAY_US`` (default 1000; 0 leaves nixl as shipped).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

PTHR_DELAY_ENV = "SAAF_NIXL_PTHR_DELAY_US"
DEFAULT_PTHR_DELAY_US = 1000
MAX_PTHR_DELAY_US = 1_000_000
# NOTE: `nixl` is a shim that aliases one of these wheels' modules; the real bindings live here.
_NIXL_PACKAGES = ("nixl", "nixl_cu12", "nixl_cu13", "nixl_rocm")
_PATCH_MARK = "_saaf_pthr_delay_us"

_registered_delay_us: int | None = None


def pthr_delay_us_from_env() -> int:
    """The progress-thread delay to apply, from ``SAAF_NIXL_PTHR_DELAY_US`` (default 1000 us)."""
    raw = os.environ.get(PTHR_DELAY_ENV, "").strip()
    if not raw:
        return DEFAULT_PTHR_DELAY_US
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_PTHR_DELAY_US:
        raise ValueError(
            f"{PTHR_DELAY_ENV}={raw!r} is not a delay in microseconds: set an integer in "
            f"0..{MAX_PTHR_DELAY_US} (default {DEFAULT_PTHR_DELAY_US}; 0 keeps nixl's busy-polling)"
        )
    return value


def is_patched(bindings: ModuleType | None = None) -> bool:
    """Whether the (given or loaded) nixl bindings module already sets a progress-thread delay."""
    if bindings is None:
        bindings = _loaded_bindings()
        if bindings is None:
            return False
    return hasattr(getattr(bindings, "nixlAgent", None), _PATCH_MARK)


def patch_bindings(bindings: ModuleType, delay_us: int) -> bool:
    """Replace ``bindings.nixlAgent`` with a subclass applying ``delay_us``. Returns False if already done."""
    base = getattr(bindings, "nixlAgent", None)
    if base is None or not hasattr(bindings, "nixlAgentConfig"):
        raise RuntimeError(f"{bindings.__name__} has no nixlAgent/nixlAgentConfig: unsupported nixl version")
    if hasattr(base, _PATCH_MARK):
        return False

    class DelayedProgressAgent(base):  # type: ignore[misc, valid-type]
        """nixlAgent whose progress thread sleeps ``pthrDelay`` us between polls instead of spinning."""

        def __init__(self, name: str, config: Any, *args: Any, **kwargs: Any) -> None:
            # NOTE: mutates the caller's config; nixl_agent builds a fresh one per agent.
            if config.useProgThread and config.pthrDelay == 0:
                config.pthrDelay = delay_us
            self.saaf_pthr_delay_us = int(config.pthrDelay)
            super().__init__(name, config, *args, **kwargs)

    setattr(DelayedProgressAgent, _PATCH_MARK, delay_us)
    bindings.nixlAgent = DelayedProgressAgent
    logger.debug("patched %s.nixlAgent: progress-thread delay %d us", bindings.__name__, delay_us)
    return True


def register() -> None:
    """vLLM general plugin: make every later NIXL agent in this process poll with a delay.

    Idempotent and cheap (does not import nixl); logs and returns if nixl is not installed.
    Raises ValueError only for a malformed ``SAAF_NIXL_PTHR_DELAY_US``.
    """
    global _registered_delay_us
    if _registered_delay_us is not None:
        return
    delay_us = pthr_delay_us_from_env()
    _registered_delay_us = delay_us
    if delay_us == 0:
        logger.info("%s=0: NIXL progress thread left busy-polling (stock nixl)", PTHR_DELAY_ENV)
        return
    bindings = _loaded_bindings()
    if bindings is not None:
        patch_bindings(bindings, delay_us)
        logger.info("NIXL progress-thread delay set to %d us on %s", delay_us, bindings.__name__)
        return
    if not any(_find_spec(pkg) for pkg in _NIXL_PACKAGES):
        logger.info("nixl is not installed: NIXL progress-thread delay patch not applied")
        return
    if not any(isinstance(f, _BindingsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _BindingsFinder(delay_us))
    logger.info("NIXL progress-thread delay of %d us will be applied when nixl is imported", delay_us)


def registered_delay_us() -> int | None:
    """The delay register() chose in this process (None before register())."""
    return _registered_delay_us


def _is_bindings_name(fullname: str) -> bool:
    parts = fullname.split(".")
    return len(parts) == 2 and parts[0] in _NIXL_PACKAGES and parts[1] == "_bindings"


def _loaded_bindings() -> ModuleType | None:
    for pkg in _NIXL_PACKAGES:
        module = sys.modules.get(f"{pkg}._bindings")
        if module is not None and hasattr(module, "nixlAgent"):
            return module
    return None


def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _BindingsFinder(importlib.abc.MetaPathFinder):
    """Finds ``nixl*._bindings`` through the other finders and patches it once it is executed."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _is_bindings_name(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self.delay_us)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, delay_us: int) -> None:
        self._inner = inner
        self._delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            patch_bindings(module, self._delay_us)
        except Exception:  # a broken patch must never break `import nixl`
            logger.exception("could not set the NIXL progress-thread delay on %s", module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
