"""Reading a streamed OpenAI response in tests: its JSON chunks, each checked for an error event."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


def chunks(url: str, body: dict, timeout: float = 180) -> Iterator[dict]:
    """POST `body` (streamed) to `url` and yield its `data: {...}` chunks; a non-200 or an error event fails."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                yield chunk
