"""Issue 8 (bad input): fuzz the HTTP API of the session deployment.

Random bodies built from the OpenAI request schema (wrong types, negative/absurd sampling parameters,
unknown fields, nested garbage, long strings, out-of-range token ids), raw bytes (invalid UTF-8, cut JSON,
NaN/Infinity literals, huge integer literals, deep nesting, lone surrogate escapes), wrong content types,
bodies over the limit, empty bodies. The server never answers 5xx, every 4xx carries an OpenAI-style
error body, and a good request succeeds afterwards. Requests that could be valid ask for <= 4 tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

pytestmark = pytest.mark.integration

# SAAF_FUZZ_EXAMPLES=2000 for a longer hunt; no example database (nothing written into the repo)
FUZZ = settings(max_examples=int(os.environ.get("SAAF_FUZZ_EXAMPLES", "50")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
PATHS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
MAX_TOKENS = 4  # any request that can be valid generates at most this many tokens
TIMEOUT = httpx.Timeout(60.0)
MIB = 1 << 20


@pytest.fixture(scope="module")
def http(endpoint):
    with httpx.Client(base_url=endpoint, timeout=TIMEOUT) as c:
        yield c


def _check(r: httpx.Response) -> None:
    """Never a 5xx; a 4xx has an OpenAI-style JSON error body; a 200 is a well-formed answer."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if currently_in_test_context():
        event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics shows the mix
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert isinstance(err["type"], str) and err["type"], err
        assert set(err) >= {"message", "type", "param", "code"}, err
        return
    assert r.status_code == 200, r.text[:500]
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], r.text[-500:]  # a mid-stream error is a server failure
        n = len({c["index"] for ch in chunks for c in ch["choices"]}) or 1
        assert sum(1 for c in chunks if c["choices"]) <= (MAX_TOKENS + 2) * n, r.text[:500]  # role + tokens
    else:
        body = r.json()
        assert body["choices"], body
        assert body["usage"]["completion_tokens"] <= MAX_TOKENS * len(body["choices"]), body


def _good_request_succeeds(http: httpx.Client, model: str) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "stream": True,
                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


def _cap_tokens(path: str, body: Any, small: int) -> Any:
    """If ``body`` would pass request validation with more than MAX_TOKENS to generate (or the server's
    default), make it ask for ``small`` tokens instead, so the fuzz never swamps the engines."""
    if not isinstance(body, dict):
        return body
    try:
        req = PATHS[path].model_validate(body)
    except Exception:  # noqa: BLE001 - invalid anyway: the server must say so with a 4xx
        return body
    # NOTE: only where the schema has the field: an unknown one is kept as a pydantic extra (and ignored by
    # the server, as vLLM's own does), so getattr would read a cap the server never applies.
    own = "max_completion_tokens" in type(req).model_fields
    asked = (req.max_completion_tokens if own else None) or req.max_tokens
    if asked is None or asked > MAX_TOKENS:
        body = dict(body, max_tokens=small)
        body.pop("max_completion_tokens", None)
    if isinstance(req.n, int) and req.n > 2:  # NOTE: n completions each generate up to max_tokens
        body = dict(body, n=2)
    return body


# ---- strategies ------------------------------------------------------------------------------------
_garbage = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
_long_text = st.sampled_from([20_000, 100_000]).map(lambda n: "word " * (n // 5))
_prompt_text = st.text(max_size=40) | st.sampled_from(["Hello", "The capital of France is", "", " ", "\x00",
                                                       "<|im_start|>", "😀" * 5])
_token_ids = st.lists(st.integers(-5, 49_200) | st.integers() | st.sampled_from([49_151, 49_152, 2**63]),
                      max_size=12)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | st.text(max_size=8),
     "content": _prompt_text | _garbage},
    optional={"name": st.text(max_size=8) | _garbage, "tool_calls": _garbage, "bogus": _garbage})


_valid_prompt = (st.text(min_size=1, max_size=40).filter(str.strip) | st.sampled_from(["Hello", "😀" * 5, "\x00"])
                 | st.lists(st.integers(0, 49_151), min_size=1, max_size=12)
                 | st.lists(st.sampled_from(["Hello", "Once upon a time"]), min_size=1, max_size=1))
_valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
     "content": st.text(max_size=40) | st.just("What is the capital of France?")},
    optional={"name": st.text(max_size=8)})

# name -> (valid values, absurd values); every field also gets random garbage.
_SAMPLING = {
    "max_tokens": (st.integers(1, MAX_TOKENS), st.sampled_from([0, -1, -(2**63), 10**9, 2**64, 10**30, 1.5])),
    "temperature": (st.floats(0, 2), st.floats() | st.sampled_from([-1e-9, 2.0000001, 1e308])),
    "top_p": (st.floats(1e-6, 1), st.floats() | st.sampled_from([0, 0.0, -0.1, 1.0000001])),
    "top_k": (st.integers(-1, 100) | st.just(100_000), st.integers() | st.sampled_from([100_001, -2, 2**63])),
    "min_tokens": (st.integers(0, 10) | st.just(100_000), st.integers() | st.sampled_from([100_001, -1])),
    "presence_penalty": (st.floats(-2, 2), st.floats()),
    "frequency_penalty": (st.floats(-2, 2), st.floats()),
    "stop": (st.lists(st.text(min_size=1, max_size=5), max_size=3) | st.text(min_size=1, max_size=5),
             st.lists(st.text(max_size=300), max_size=20) | st.just(["x"] * 10_000) | st.just(["y" * 100_000])
             | st.just("")),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**63, -(2**63) - 1, 10**40])),
    "stream": (st.booleans(), st.sampled_from(["maybe", 2, []])),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.fixed_dictionaries({"include_usage": _garbage, "x": st.just(1)})),
    "n": (st.just(1), st.integers()),
    "user": (st.text(max_size=10), st.just("u" * 1000)),
    "ignore_eos": (st.booleans(), st.just("maybe")),
    "return_token_ids": (st.booleans(), st.just([])),
    "logprobs": (st.none(), st.sampled_from([True, 5])),
    "echo": (st.just(False), st.just(True)),
    "max_completion_tokens": (st.integers(1, MAX_TOKENS), st.sampled_from([0, -3, 10**12])),
}
_ONLY = {"/v1/completions": {"echo"}, "/v1/chat/completions": {"max_completion_tokens"}}
MODEL = "__MODEL__"  # placeholder the tests replace by the served model name (strategies are built at import)


@st.composite
def _schema_request(draw: st.DrawFn) -> tuple[str, Any]:
    """A request body from the OpenAI schema: all valid, valid but for one defect, or chaos."""
    path = draw(st.sampled_from(sorted(PATHS)))
    other = next(p for p in PATHS if p != path)
    mode = draw(st.sampled_from(["valid", "one_defect", "one_defect", "chaos"]))
    fields = sorted(set(_SAMPLING) - _ONLY[other])
    body: dict[str, Any] = {"model": MODEL}
    if path == "/v1/completions":
        body["prompt"] = draw(_valid_prompt)
    else:
        body["messages"] = draw(st.lists(_valid_message, min_size=1, max_size=4))
    for name in draw(st.lists(st.sampled_from(fields), max_size=6, unique=True)):
        body[name] = draw(_SAMPLING[name][0])
    if mode == "one_defect":
        what = draw(st.sampled_from(["absurd", "garbage", "unknown", "missing", "model", "prompt", "other"]))
        name = draw(st.sampled_from(sorted(_SAMPLING)))
        if what == "absurd":
            body[name] = draw(_SAMPLING[name][1])
        elif what == "garbage":
            body[draw(st.sampled_from(sorted(body)))] = draw(_garbage)
        elif what == "unknown":
            body[draw(st.text(min_size=1, max_size=12))] = draw(_garbage)
        elif what == "missing":
            body.pop(draw(st.sampled_from(sorted(body))))
        elif what == "model":
            body["model"] = draw(st.text(max_size=10) | _garbage)
        elif what == "prompt" and path == "/v1/completions":
            body["prompt"] = draw(_prompt_text | _long_text | _token_ids | st.lists(_prompt_text, max_size=3)
                                  | st.lists(_token_ids, max_size=2) | _garbage)
        elif what == "prompt":
            body["messages"] = draw(st.lists(_message, max_size=4) | _garbage
                                    | st.just([{"role": "user", "content": "hi"}] * 400))
        else:
            body[draw(st.sampled_from(sorted(_ONLY[other])))] = draw(_garbage)
    elif mode == "chaos":
        for name in draw(st.lists(st.sampled_from(sorted(_SAMPLING)), max_size=6, unique=True)):
            body[name] = draw(st.one_of(*_SAMPLING[name], _garbage))
        for _ in range(draw(st.integers(0, 2))):
            body[draw(st.text(min_size=1, max_size=12))] = draw(_garbage)
        for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)):
            body[key] = draw(_garbage)
    return path, _cap_tokens(path, body, draw(st.integers(1, MAX_TOKENS)))


_RAW = [
    b"", b" ", b"null", b"[]", b"1", b'"x"', b"{", b'{"model": ', b"{}", b"{{}}", b"\xff\xfe", b"\xc3\x28",
    b'{"model": "\xed\xa0\x80"}', b"\x00" * 64, b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}',
    b'{"a": 1e999}', b'{"a": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"prompt": "\\ud800"}', b'{"\\udfff": 1}',
    b'{"model": "x", "prompt": "hi"}\n{"model": "y"}', b"\xef\xbb\xbf{}",
]


@st.composite
def _raw_request(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """Raw bytes: seeds above, random bytes, valid JSON with raw-text edits (NaN, huge ints, surrogates)."""
    path = draw(st.sampled_from(sorted(PATHS)))
    kind = draw(st.sampled_from(["seed", "bytes", "edit", "edit"]))
    if kind == "seed":
        data = draw(st.sampled_from(_RAW))
    elif kind == "bytes":
        data = draw(st.binary(max_size=200))
    else:
        base = ({"model": MODEL, "prompt": "Hello", "max_tokens": 2} if path == "/v1/completions" else
                {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
        text = json.dumps(base)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(text)))
            op = draw(st.sampled_from(["insert", "delete", "value"]))
            if op == "insert":
                text = text[:i] + draw(st.sampled_from(["NaN", "-Infinity", "1e999", "9" * 4400, "\\ud800",
                                                        "\\udc00", '"', "{", "]", ",", "\\", "\x00"])) + text[i:]
            elif op == "delete":
                text = text[:i] + text[i + draw(st.integers(1, 8)):]
            else:
                key = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "top_k", "model"]))
                val = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "9" * 5000,
                                            '"\\ud800"', '"\\udfff\\ud800"', "[[[[]]]]", "{}", "null"]))
                text = text[:-1] + f', "{key}": {val}}}'
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and _cap_tokens(path, parsed, 2) is not parsed:
            text = json.dumps(_cap_tokens(path, parsed, 2))  # the edits made a valid request of many tokens
        data = text.encode("utf-8", "surrogatepass")
    ctype = draw(st.sampled_from(["application/json"] * 12 + ["application/json; charset=utf-8", "text/plain",
                                                              "application/x-www-form-urlencoded", "", None]))
    headers = {} if ctype is None else {"content-type": ctype}
    return path, data, headers


# ---- fuzz tests ------------------------------------------------------------------------------------
def _with_model(data: bytes, model: str) -> bytes:
    return data.replace(MODEL.encode(), json.dumps(model)[1:-1].encode())


@FUZZ
@given(req=_schema_request())
def test_fuzz_schema_bodies(http, model_name, req):
    path, body = req
    data = _with_model(json.dumps(body).encode(), model_name)
    _check(http.post(path, content=data, headers={"content-type": "application/json"}))


@FUZZ
@given(req=_raw_request())
def test_fuzz_raw_bodies(http, model_name, req):
    path, data, headers = req
    _check(http.post(path, content=_with_model(data, model_name), headers=headers))


def test_server_serves_after_fuzzing(http, model_name):
    _good_request_succeeds(http, model_name)


# ---- regression cases: each was a 5xx (or a non-OpenAI 4xx body) before a fix (cluster/serve/guard.py, http.py) ----
CASES = [
    # RecursionError in json.loads -> 500
    ("deep array", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("deep object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
    # ValueError (int literal over 4300 digits) in json.loads -> 500
    ("huge int literal", b'{"model": "M", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "malformed JSON"),
    # lone surrogates: tokenizer / JSON response encoding failed -> 500, or the engine failed -> 502
    # (a surrogate key was a 400 already, but one that said "invalid '': ...")
    ("surrogate prompt", b'{"model": "M", "prompt": "hi \\ud800", "max_tokens": 2}', "surrogate"),
    ("surrogate model", b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', "surrogate"),
    ("surrogate stop", b'{"model": "M", "prompt": "hi", "max_tokens": 2, "stop": ["\\udc00"]}', "surrogate"),
    ("surrogate key", b'{"model": "M", "prompt": "hi", "max_tokens": 2, "\\udfff": 1}', "surrogate"),
]


@pytest.mark.parametrize("name,raw,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_bodies_that_were_5xx_are_clear_400s(http, model_name, name, raw, needle):
    raw = raw.replace(b'"M"', json.dumps(model_name).encode())
    for path in PATHS:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        _check(r)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text[:300]


def test_surrogate_chat_content_is_a_400(http, model_name):
    raw = b'{"model": %s, "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}' % (
        json.dumps(model_name).encode())
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_valid_surrogate_pair_is_accepted(http, model_name):
    """json.dumps (ensure_ascii) sends emoji as a \\ud83d\\ude00 pair: that is valid and must pass."""
    r = http.post("/v1/completions", content=json.dumps({"model": model_name, "prompt": "Hi 😀", "max_tokens": 2}),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
    ("GET", "/v1/nope", 404), ("POST", "/v2/completions", 404), ("GET", "/v1/%ff%fe", 404),
])
def test_unknown_route_or_method_has_openai_error_body(http, model_name, method, path, status):
    r = http.request(method, path, content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    _check(r)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_a_413(http, model_name, chunked):
    head = json.dumps({"model": model_name, "max_tokens": 2})[:-1].encode() + b', "prompt": "'
    filler = b"a" * (MIB + 10)
    data = iter([head, filler, b'"}']) if chunked else head + filler + b'"}'
    r = http.post("/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    _check(r)
    _good_request_succeeds(http, model_name)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_wrong_content_type_is_a_400(http, model_name, ctype):
    """As vLLM's own server answers it (400 "Only 'application/json' is allowed")."""
    body = json.dumps({"model": model_name, "prompt": "hi", "max_tokens": 2}).encode()
    r = http.post("/v1/completions", content=body, headers={"content-type": ctype})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"], r.text
    _check(r)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_non_finite_sampling_params_are_400(http, model_name, literal, field):
    raw = json.dumps({"model": model_name, "prompt": "hi", "max_tokens": 2})[:-1] + f', "{field}": {literal}}}'
    r = http.post("/v1/completions", content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    _check(r)


def test_many_chat_messages_and_huge_stop_lists(http, model_name):
    msgs = [{"role": "user", "content": "hello there"}] * 2000
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text[:300]
    r = http.post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 2,
                                           "stop": ["x"] * 50_000})
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"], r.text[:300]
    _good_request_succeeds(http, model_name)


def test_prompt_token_ids_out_of_range(http, model_name, deployment):
    from transformers import AutoTokenizer

    from engine.models import resolve_model

    vocab = len(AutoTokenizer.from_pretrained(str(resolve_model(deployment["config"].engine.model))))
    for ids in ([-1], [vocab], [2**63], [10**30], [0, 1, -(2**70)], [[1, -2]], [1.5], [1, "a"]):
        r = http.post("/v1/completions", json={"model": model_name, "prompt": ids, "max_tokens": 2})
        assert r.status_code == 400, (ids, r.text)
        _check(r)
    r = http.post("/v1/completions", json={"model": model_name, "prompt": [0, vocab - 1], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2
