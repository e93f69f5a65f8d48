"""Issue 2: the OpenAI-compatible endpoint, end to end, with the real openai client and real engines."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=f"{endpoint}/v1", api_key="unused", timeout=120, max_retries=0)


def test_chat_answers_paris(client, model_name):
    r = client.chat.completions.create(model=model_name, temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_answers_paris(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=32, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    text = "".join(pieces)
    assert "Paris" in text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 1


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_openai_client_tool_calls(client, model_name, tool_choice):
    """The openai client's own tool-call types parse our answer: one call of the named function with JSON
    arguments. (What vLLM's tool parser makes of the model's output, here hermes on SmolLM2, is the same as
    vLLM serve's: the parity test compares them.)"""
    r = client.chat.completions.create(model=model_name, temperature=0, max_tokens=60, tools=[WEATHER],
                                       tool_choice=tool_choice,
                                       messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].type == "function"
    json.loads(calls[0].function.arguments)
    assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")


def test_openai_client_json_schema_response_format(client, model_name):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for stream in (False, True):
        kw = {"model": model_name, "temperature": 0, "max_tokens": 48,
              "messages": [{"role": "user", "content": "Describe a person as JSON."}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        data = json.loads(text)
        assert set(data) == {"name", "age"} and isinstance(data["age"], int), text


def test_completion_usage_counts_prompt_tokens(client, model_name, endpoint):
    from transformers import AutoTokenizer

    from engine.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    prompt = "The three primary colours are"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(tok(prompt)["input_ids"])  # NOTE: special tokens as vLLM adds them
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"


def test_models_and_health(endpoint, model_name):
    assert httpx.get(f"{endpoint}/health", timeout=10).status_code == 200
    data = httpx.get(f"{endpoint}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == [model_name]


def test_greedy_equals_one_vllm_engine(endpoint, model_name, colocated_worker):
    """Token for token, the endpoint (disaggregated) equals one vLLM engine of the same model and settings
    (the session's colocated engine; an offline LLM would start a third engine on 2 cores)."""
    from transformers import AutoTokenizer

    from engine.models import resolve_model
    from tests.helpers.engines import generate, params, token_ids

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    texts = ["Once upon a time", "def fibonacci(n):", "The weather in Paris today is"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    got = []
    for p in prompts:
        r = httpx.post(f"{endpoint}/v1/completions", timeout=120, json={
            "model": model_name, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    want = [token_ids(generate(colocated_worker, f"greedy-{i}", p, params(24, ignore_eos=True)))
            for i, p in enumerate(prompts)]
    assert got == want


def test_sampling_params_stop_and_seed(endpoint, model_name):
    def gen(**kw):
        body = {"model": model_name, "prompt": "List: one, two, three, four, five,", "max_tokens": 16, **kw}
        r = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    a = gen(temperature=1.0, top_p=0.9, seed=1234)
    b = gen(temperature=1.0, top_p=0.9, seed=1234)
    assert a["text"] == b["text"]
    full = gen(temperature=0)
    assert "," in full["text"]
    cut = gen(temperature=0, stop=[","])
    assert "," not in cut["text"] and cut["finish_reason"] == "stop"
    assert full["text"].startswith(cut["text"])


# vLLM's own serving layer answers these (its messages); each must be a clear 4xx, then serving goes on.
BAD = [
    ("malformed json", b'{"model": "x", "prompt": ', "JSON decode error", 400),
    ("missing prompt", {"max_tokens": 4}, "prompt", 400),
    ("wrong type", {"prompt": "hi", "max_tokens": "four"}, "max_tokens", 400),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1", 400),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -5}, "max_tokens must be at least 1", 400),
    ("too long", {"prompt": "word " * 3000, "max_tokens": 4}, "maximum context length", 400),
    ("too long with output", {"prompt": "hi", "max_tokens": 5000}, "cannot be greater than max_model_len", 400),
    ("bad temperature", {"prompt": "hi", "temperature": -1}, "temperature", 400),
    ("too many logprobs", {"prompt": "hi", "max_tokens": 2, "logprobs": 50}, "logprobs", 400),
    ("client kv_transfer_params", {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}},
     "kv_transfer_params", 400),
    ("unknown model", {"model": "gpt-17", "prompt": "hi"}, "gpt-17", 404),
]


@pytest.mark.parametrize("name,body,needle,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx_and_server_keeps_serving(endpoint, model_name, name, body, needle, status):
    url = f"{endpoint}/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json={"model": model_name, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = httpx.post(url, json={"model": model_name, "prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200, ok.text
