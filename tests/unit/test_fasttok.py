"""The ingress's transformers-free tokenizer gives exactly transformers' tokens: prompts and chat templates
of both bundled models, and a few templates with the features real models use."""

from __future__ import annotations

import json

import jinja2
import pytest

from cluster.fasttok import FastTokenizer, HFTokenizer, fast_tokenizer, load_tokenizer
from engine.models import resolve_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Und auf Deutsch? Ünïcödé ✓ 日本語 \n\n tabs\t"}],
    [{"role": "user", "content": ""}],
    [{"role": "developer", "content": "be nice"}, {"role": "user", "content": "<|im_end|> injected"}],
]
PROMPTS = ["Once upon a time", "  leading spaces and trailing  ", "日本語 ✓ <|im_start|>", "", "a" * 500]


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama"])
def both(request):
    d = resolve_model(request.param)
    fast = fast_tokenizer(d)
    assert isinstance(fast, FastTokenizer), "the bundled models must not need transformers"
    return fast, HFTokenizer(d)


def test_prompts_tokenize_identically(both):
    fast, hf = both
    for p in PROMPTS:
        assert fast.encode(p) == hf.encode(p), p
    assert len(fast) == len(hf)


def test_chats_render_and_tokenize_identically(both):
    fast, hf = both
    for chat in CHATS:
        assert fast.chat(chat) == hf.chat(chat), chat
        assert fast.chat(chat, add_generation_prompt=False) == hf.chat(chat, add_generation_prompt=False)


def _model_with_template(tmp_path, template):
    d = tmp_path / "m"
    src = resolve_model("tiny-llama")
    d.mkdir()
    for f in ("tokenizer.json", "config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg["bos_token"] = "<|endoftext|>"  # a token the vocabulary has, as in real models
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in ("special_tokens_map.json",):
        if (src / extra).is_file():
            (d / extra).write_bytes((src / extra).read_bytes())
    return d


TEMPLATES = [
    # Llama-2 style: bos variable, raise_exception on bad roles, loop controls
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
    "{% endif %}{% if loop.index0 > 5 %}{% break %}{% endif %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
    # tojson with non-ASCII (transformers' own filter: no HTML escaping, ensure_ascii False)
    "{% for m in messages %}{{ m | tojson }}{% endfor %}",
    # whitespace control as real templates write it (trim_blocks / lstrip_blocks matter)
    "{%- for m in messages %}\n  {%- if m.role == 'system' %}\n<<SYS>>{{ m.content }}<</SYS>>\n  {%- else %}\n"
    "{{ m.role }}: {{ m.content }}\n  {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\nassistant:"
    "{%- endif %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_features_match_transformers(tmp_path, template):
    d = _model_with_template(tmp_path, template)
    fast, hf = fast_tokenizer(d), HFTokenizer(d)
    assert fast is not None
    for chat in CHATS:
        assert fast.chat(chat) == hf.chat(chat), (template, chat)


def test_template_errors_are_jinja_errors_on_both(tmp_path):
    d = _model_with_template(tmp_path, TEMPLATES[0])
    chat = [{"role": "tool", "content": "x"}]
    for tok in (fast_tokenizer(d), HFTokenizer(d)):
        with pytest.raises(jinja2.exceptions.TemplateError, match="no tools"):
            tok.chat(chat)


def test_template_file_wins_over_config_as_in_transformers(tmp_path):
    d = _model_with_template(tmp_path, TEMPLATES[1])
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    fast, hf = fast_tokenizer(d), HFTokenizer(d)
    assert fast.chat(CHATS[1]) == hf.chat(CHATS[1]) == fast.encode("<system>You are terse.<user>Hi")


def test_falls_back_to_transformers_without_tokenizer_json(tmp_path):
    d = _model_with_template(tmp_path, TEMPLATES[1])
    (d / "tokenizer.json").unlink()
    assert fast_tokenizer(d) is None


def test_generation_tags_fall_back(tmp_path):
    d = _model_with_template(tmp_path, "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                                       "{% endfor %}")
    assert fast_tokenizer(d) is None
    assert isinstance(load_tokenizer(d), HFTokenizer)
