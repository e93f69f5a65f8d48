"""Prompt tokenization for the ingress without importing transformers.

The ingress needs three things from a tokenizer: encode a prompt, render a chat with the model's template,
and the vocabulary size. `transformers` takes ~3.3 s of CPU to import, on the startup path of every ingress
replica; the Rust `tokenizers` library plus jinja2 (the renderer transformers itself uses) take ~0.1 s.
This renders the template the way `PreTrainedTokenizer.apply_chat_template` does (sandboxed jinja2,
trim/lstrip blocks, loop controls, its `tojson`, `raise_exception` and `strftime_now`, the special tokens
as variables) and encodes with `add_special_tokens=False`, as it does. `load_tokenizer` falls back to
transformers' AutoTokenizer for anything this does not cover (no tokenizer.json, no template, templates
using `{% generation %}`). tests/unit/test_fasttok.py checks token-for-token equality with transformers.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class FastTokenizer:
    def __init__(self, tokenizer: Any, template: str, special: dict[str, Any]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._tok = tokenizer
        self._template = env.from_string(template)
        self._special = special

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special)
        return self.encode(text)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class HFTokenizer:
    """The same three operations through transformers (the fallback)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def __len__(self) -> int:
        return len(self._tok)


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def fast_tokenizer(model_dir: Path) -> FastTokenizer | None:
    """A FastTokenizer for ``model_dir``, or None when it needs transformers."""
    tj, cfg_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    if not tj.is_file() or not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    # NOTE: as transformers: a chat_template.jinja file wins over the config's chat_template.
    template = cfg.get("chat_template")
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or "{% generation" in template or "{%- generation" in template:
        return None
    special: dict[str, Any] = {}
    for k in SPECIAL_KEYS:
        text = _token_text(cfg.get(k))
        if text is not None:
            special[k] = text
    extra = [t for t in (_token_text(x) for x in cfg.get("additional_special_tokens") or []) if t is not None]
    if extra:
        special["additional_special_tokens"] = extra
    from tokenizers import Tokenizer

    return FastTokenizer(Tokenizer.from_file(str(tj)), template, special)


def load_tokenizer(model_dir: Path) -> FastTokenizer | HFTokenizer:
    try:
        fast = fast_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - a template jinja2 cannot compile, an odd config: use transformers
        logger.info("fast tokenizer unavailable for %s (%s); using transformers", model_dir, e)
        fast = None
    return fast if fast is not None else HFTokenizer(model_dir)
