"""vLLM's NixlConnector with the decode side's pull capped at what the prefill engine computed.

Loaded by name through `kv_connector_module_path` (kvtransfer/config.py), so vLLM's own checks for
"NixlConnector" still apply to it.

NOTE: when the decode engine continues from prompt + the first token the prefill engine already sampled,
its request is one token longer than the prefill's. vLLM's connector sizes the pull from the decode
request's own prompt length: for a prompt of an exact multiple of the block size it then allocates one
block more than the prefill sent, and the worker's pairing of local and remote blocks raises ("Decode
allocated more KV pages than the prefill worker supplied"), which kills the decode EngineCore. The prefill
reports how many tokens it computed (`remote_num_tokens`); we never ask for more. The decode engine then
computes the first token's KV itself, as it computes the last prompt token's when nothing is appended.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as _VllmNixlConnector


def capped_match(count: int | None, load_async: bool, params: dict[str, Any] | None,
                 num_computed_tokens: int) -> tuple[int | None, bool]:
    """Cap a remote-prefill match at the prefill engine's `remote_num_tokens` (pure, for tests)."""
    if not load_async or not count or not params or not params.get("do_remote_prefill"):
        return count, load_async
    remote = params.get("remote_num_tokens")
    if not remote:
        return count, load_async
    capped = min(count, int(remote) - num_computed_tokens)
    if capped <= 0:  # NOTE: the local prefix cache holds all the prefill computed: nothing to pull
        return 0, False
    return capped, True


class NixlConnector(_VllmNixlConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return capped_match(count, load_async, request.kv_transfer_params, num_computed_tokens)
