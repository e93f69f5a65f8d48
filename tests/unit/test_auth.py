"""serve.api_keys: validation, resolution (inline, env, file) and the Auth middleware's decisions."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from cluster.config import ConfigError, key_digest, parse_config, resolve_api_keys
from cluster.serve.auth import Auth, presented_key


def test_a_non_loopback_host_needs_keys_or_an_explicit_opt_out():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        parse_config({"serve": {"host": host}})
    with pytest.raises(ConfigError, match=r"serve: .*host '0.0.0.0' is reachable .*serve.api_keys.*"
                                          r"allow_unauthenticated"):
        parse_config({"serve": {"host": "0.0.0.0"}})
    parse_config({"serve": {"host": "0.0.0.0", "allow_unauthenticated": True}})
    parse_config({"serve": {"host": "10.0.0.5", "api_keys": [{"env": "X"}]}})
    parse_config({"serve": {"host": "10.0.0.5", "api_key_sha256": [key_digest("k")]}})
    with pytest.raises(ConfigError, match="not a SHA-256 hex digest"):
        parse_config({"serve": {"api_key_sha256": ["abc"]}})
    with pytest.raises(ConfigError, match="inline key is empty"):
        parse_config({"serve": {"api_keys": ["  "]}})
    with pytest.raises(ConfigError, match=r"serve.api_keys.0: invalid .*\{env: VAR\} or \{file: PATH\}"):
        parse_config({"serve": {"api_keys": [{"vault": "x"}]}})


SECRET = "sk-live-7f3a9c2e"
SECRET_SHAPES = [  # a key in every wrong shape the config's key fields can be given
    {"api_keys": SECRET}, {"api_keys": [[SECRET]]}, {"api_keys": [{"env": SECRET}]},
    {"api_keys": [{"env": "X", "extra": SECRET}]}, {"api_keys": [{SECRET: "x"}]}, {"api_keys": [{"file": SECRET, "x": 1}]},
    {"api_keys": {SECRET: SECRET}}, {"api_keys": [SECRET, 5]}, {"api_key_sha256": SECRET},
    {"api_key_sha256": [SECRET]}, {"api_key_sha256": [[SECRET]]}, {"api_keys": [SECRET], "host": "0.0.0.0", "port": 0},
    {"api_keys": [SECRET], "vllm_args": ["--api-key", SECRET]}, {"api_keys": [SECRET], "vllm_args": [f"--api-key={SECRET}"]},
    {"api_keys": [SECRET], "bogus": 1},
]


@pytest.mark.parametrize("serve", SECRET_SHAPES, ids=range(len(SECRET_SHAPES)))
def test_a_config_error_never_shows_a_key(serve):
    with pytest.raises(ConfigError) as e:
        parse_config({"serve": serve})
    assert SECRET not in str(e.value) and SECRET[:8] not in str(e.value), str(e.value)
    assert "serve" in str(e.value)  # still names where the error is


def test_vllm_server_flags_the_ingress_does_not_honour_are_refused_naming_ours():
    for argv, ours in ((["--api-key", "k"], "serve.api_keys"), (["--allowed-origins", "[\"*\"]"], "serve.cors_origins"),
                       (["--disable-fastapi-docs"], "serve.docs"), (["--middleware", "m.x"], "nothing"),
                       (["--allowed_origins=*"], "serve.cors_origins"), (["--ssl-keyfile", "k.pem"], "TLS")):
        with pytest.raises(ConfigError, match=f"{argv[0].split('=')[0].replace('_', '-')} is vLLM's own server's.*{ours}"):
            parse_config({"serve": {"vllm_args": argv}})
    parse_config({"serve": {"vllm_args": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]}})


def test_keys_resolve_to_digests_and_leave_no_plain_key_in_the_config(tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("SAAF_KEY_T", "sk-env")
    cfg = parse_config({"serve": {"host": "0.0.0.0", "api_keys": ["sk-inline", {"env": "SAAF_KEY_T"},
                                                                    {"file": str(keys)}]}})
    out, plain = resolve_api_keys(cfg)
    assert plain == "sk-inline" and out.serve.api_keys == []
    assert out.serve.api_key_sha256 == [key_digest(k) for k in ("sk-inline", "sk-env", "sk-file-1", "sk-file-2")]
    dumped = str(out.model_dump())
    assert "sk-" not in dumped
    parse_config(out.model_dump())  # what the replicas get still validates (host 0.0.0.0, digests only)
    assert resolve_api_keys(out) == (out, None)  # idempotent


def test_key_sources_that_cannot_be_read_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("SAAF_KEY_MISSING", raising=False)
    with pytest.raises(ConfigError, match="environment variable SAAF_KEY_MISSING is not set"):
        resolve_api_keys(parse_config({"serve": {"api_keys": [{"env": "SAAF_KEY_MISSING"}]}}))
    with pytest.raises(ConfigError, match="cannot read key file .*nope.txt"):
        resolve_api_keys(parse_config({"serve": {"api_keys": [{"file": str(tmp_path / "nope.txt")}]}}))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        resolve_api_keys(parse_config({"serve": {"api_keys": [{"file": str(empty)}]}}))


def test_presented_key_reads_bearer_then_x_api_key():
    assert presented_key([(b"authorization", b"Bearer sk-1")]) == "sk-1"
    assert presented_key([(b"authorization", b"bearer   sk-1 ")]) == "sk-1"
    assert presented_key([(b"x-api-key", b"sk-2")]) == "sk-2"
    assert presented_key([(b"authorization", b"Basic dXNlcg==")]) is None
    assert presented_key([(b"authorization", b"Bearer ")]) is None
    assert presented_key([]) is None


async def _inner(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"inner"})


def _get(app, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, headers=headers)
    return asyncio.run(go())


def test_auth_middleware_answers_401_in_the_openai_shape_and_passes_good_keys():
    app = Auth(_inner, digests=[key_digest("sk-a"), key_digest("sk-b")], auth_health=False, auth_metrics=False)
    for headers in (None, {"Authorization": "Bearer sk-c"}, {"Authorization": "sk-a"}):
        r = _get(app, "POST", "/v1/completions", headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert _get(app, "GET", "/v1/models").status_code == 401
    assert _get(app, "POST", "/tokenize").status_code == 401  # not only /v1 paths
    assert _get(app, "POST", "/v1/completions", {"Authorization": "Bearer sk-b"}).text == "inner"
    assert _get(app, "POST", "/v1/messages", {"x-api-key": "sk-a"}).text == "inner"
    assert _get(app, "GET", "/health").status_code == 200 and _get(app, "GET", "/metrics").status_code == 200
    # exact paths only: a route that merely ends in /health or /metrics needs the key
    for path in ("/prefix/health", "/v1/chat/completions/x/health", "/v1/models/health", "/healthz", "/metrics/x"):
        assert _get(app, "GET", path).status_code == 401, path
    mounted = Starlette(routes=[Mount("/prefix", app=app)])  # under a route prefix: its own /health is open
    assert _get(mounted, "GET", "/prefix/health").status_code == 200
    assert _get(mounted, "GET", "/prefix/v1/models/health").status_code == 401


def test_health_and_metrics_can_require_the_key():
    app = Auth(_inner, digests=[key_digest("sk-a")], auth_health=True, auth_metrics=True)
    assert _get(app, "GET", "/health").status_code == 401 and _get(app, "GET", "/metrics").status_code == 401
    assert _get(app, "GET", "/health", {"Authorization": "Bearer sk-a"}).status_code == 200
    only_metrics = Auth(_inner, digests=[key_digest("sk-a")], auth_health=False, auth_metrics=True)
    assert _get(only_metrics, "GET", "/health").status_code == 200
    assert _get(only_metrics, "GET", "/metrics").status_code == 401


def test_a_loaded_config_keeps_its_keys_for_the_deploy_to_resolve(tmp_path, monkeypatch):
    """load_config checks the key sources at once but leaves them in the config: deploy.start resolves them
    and hands the CLI one plain key for its own demo request (resolved twice, the second would find none)."""
    import yaml

    from cluster.config import load_config

    monkeypatch.delenv("SAAF_KEY_LOAD", raising=False)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"engine": {"model": "tiny-llama"}, "serve": {"api_keys": [{"env": "SAAF_KEY_LOAD"}]}}))
    with pytest.raises(ConfigError, match="SAAF_KEY_LOAD is not set"):
        load_config(path)
    monkeypatch.setenv("SAAF_KEY_LOAD", "sk-load")
    cfg = load_config(path)
    assert cfg.serve.api_keys and resolve_api_keys(cfg)[1] == "sk-load"
