"""Issue 8 (bad input): fuzz the deploy and planner config loaders.

Random YAML documents, random bytes, and random mutations of the committed manifests
(manifests/deploy-*.yaml, manifests/plan-*.yaml). Every input either loads or raises ConfigError /
PlacementError whose message names the field; no other exception type (no traceback) ever escapes.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import ConfigError, DeployConfig, load_config
from placement.config import PlannerConfig, load_planner_config
from placement.errors import PlacementError

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
DEPLOY = sorted(p.name for p in MANIFESTS.glob("deploy-*.yaml"))
PLAN = sorted(p.name for p in MANIFESTS.glob("plan-*.yaml"))
# SAAF_FUZZ_EXAMPLES=2000 for a longer hunt; no example database (nothing written into the repo)
FUZZ = settings(max_examples=int(os.environ.get("SAAF_FUZZ_EXAMPLES", "150")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

@pytest.fixture(scope="module")
def workdir():
    """A copy of manifests/ so relative references (planner: plan-cpu-smollm2.yaml, profiles/) resolve."""
    with tempfile.TemporaryDirectory(prefix="saaf-fuzz-cfg-") as d:
        root = Path(d) / "manifests"
        shutil.copytree(MANIFESTS, root)
        yield root


def _load(kind: str, path: Path, check_paths: bool = False) -> Any:
    if kind == "deploy":
        return load_config(path, check_paths=check_paths)
    return load_planner_config(path)


def _outcome(kind: str, path: Path, check_paths: bool = False) -> BaseException | None:
    """Load ``path``; None when it loads, else the clear error. Anything else fails the test."""
    try:
        cfg = _load(kind, path, check_paths)
    except (ConfigError, PlacementError) as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        return e
    assert isinstance(cfg, DeployConfig if kind == "deploy" else PlannerConfig)
    return None


# ---- values and documents ------------------------------------------------------------------------
_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**30), max_value=10**30)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
            | st.sampled_from(["auto", "", "cpu", "cuda", "smollm2", "tiny-llama", "disaggregated", "colocated",
                               "fail", "recompute", "goodput", "h100-sxm", "llama-3.1-8b", "/", "\x00",
                               "../../etc/passwd", "x" * 5000, "1e309", "-0", "0x10"]))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=12) | st.sampled_from(["model", "prefill", "decode", "port", "kind", "name"]), c,
    max_size=4), max_leaves=12)

_TOKENS = [":", ": ", " ", "  ", "\n", "- ", "[", "]", "{", "}", ",", "&a ", "*a", "!!binary ", "!!set ",
           "!!python/object:os.system ", "!!int ", "!!float ", "!!bool ", "!!timestamp ", "!!str ", "\t", "'", '"', "#", "? ", "|\n  ", ">\n  ",
           "%YAML 1.1\n", "---\n", "...\n", "name", "engine", "model", "pools", "auto", "planner", "serve",
           "port", "1e309", ".nan", ".inf", "-.inf", "~", "null", "true", "2020-01-01", "0o17", "\\x00",
           "\u00e9", "\ufeff", "\x85", "plan-cpu-smollm2.yaml", "profiles/cpu-smollm2.yaml"]
_yaml_text = st.lists(st.sampled_from(_TOKENS) | st.text(max_size=6), max_size=40).map("".join)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping/list (lists by index)."""
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.append(prefix + (i,))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


@st.composite
def _mutated(draw: st.DrawFn, names: list[str]) -> tuple[str, dict | Any, set[str]]:
    """(manifest name, mutated document, names the error message may use for the mutated field)."""
    name = draw(st.sampled_from(names))
    doc = yaml.safe_load((MANIFESTS / name).read_text())
    paths = _paths(doc)
    touched: set[str] = set()
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace", "replace", "delete", "add", "rename", "whole"]))
        if op == "whole":
            doc = draw(_values)
            touched = {"*"}  # a whole new document: any field may be the one named
            break
        if not isinstance(doc, dict):
            break
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        touched.update(str(p) for p in path if isinstance(p, str))
        if op == "replace":
            parent[path[-1]] = draw(_values)
        elif op == "delete":
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            key = draw(st.text(st.characters(categories=["L", "N"], include_characters="_-"), min_size=1,
                               max_size=12))
            touched.add(key)
            parent[key] = draw(_values)
        elif op == "rename" and isinstance(parent, dict):
            key = f"{path[-1]}{draw(st.sampled_from(['x', '_', 's']))}"
            touched.add(key)
            parent[key] = parent.pop(path[-1])
    return name, doc, touched


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _write(workdir: Path, data: str | bytes) -> Path:
    p = workdir / "fuzzed.yaml"
    p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return p


def _names_field(err: BaseException, touched: set[str]) -> bool:
    msg = str(err)
    if "*" in touched:
        return True
    return any(t and t in msg for t in touched) or "(top level)" in msg or "top level" in msg


# ---- tests -----------------------------------------------------------------------------------------
def test_committed_manifests_load(workdir):
    for n in DEPLOY:
        assert _outcome("deploy", workdir / n) is None, n
    for n in PLAN:
        assert _outcome("plan", workdir / n) is None, n


@FUZZ
@given(doc=_mutated(DEPLOY))
def test_mutated_deploy_manifests(workdir, doc):
    name, data, touched = doc
    err = _outcome("deploy", _write(workdir, _dump(data)))
    if isinstance(err, ConfigError | PlacementError):
        assert _names_field(err, touched), f"{name}: mutated {sorted(touched)} but the error says: {err}"
    _outcome("deploy", _write(workdir, _dump(data)), check_paths=True)


@FUZZ
@given(doc=_mutated(PLAN))
def test_mutated_planner_manifests(workdir, doc):
    name, data, touched = doc
    err = _outcome("plan", _write(workdir, _dump(data)))
    if isinstance(err, ConfigError | PlacementError):
        assert _names_field(err, touched), f"{name}: mutated {sorted(touched)} but the error says: {err}"


@FUZZ
@given(kind=st.sampled_from(["deploy", "plan"]), text=_yaml_text)
def test_random_yaml_documents(workdir, kind, text):
    _outcome(kind, _write(workdir, text))


@FUZZ
@given(name=st.sampled_from(DEPLOY + PLAN), edits=st.lists(
    st.tuples(st.sampled_from(["insert", "delete", "dup"]), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    min_size=1, max_size=4))
def test_byte_mutations_of_manifests(workdir, name, edits):
    """Random byte edits of the manifest files (invalid UTF-8, broken indentation, cut documents)."""
    data = (MANIFESTS / name).read_bytes()
    for op, where, blob in edits:
        i = int(where * len(data))
        if op == "insert":
            data = data[:i] + blob + data[i:]
        elif op == "delete":
            data = data[:i] + data[i + len(blob) * 4:]
        else:
            data = data[:i] + data[i:i + 64] * 2 + data[i + 64:]
    _outcome("deploy" if name.startswith("deploy-") else "plan", _write(workdir, data))


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 0, 10**40, 1.5, [8000], {"a": 1}, None, "x" * 5000])
def test_bad_port_names_the_field(workdir, value):
    err = _outcome("deploy", _write(workdir, _dump({"serve": {"port": value}})))
    assert isinstance(err, ConfigError) and "serve.port" in str(err), err


# ---- crashes the fuzzing above found in the loaders (fixed; kept as regression tests) ------------------
_CRASHERS = {
    "invalid-utf8": ("deploy", b"name: \xff\xfe\n"),
    "deep-nesting": ("deploy", b"engine: " + b"[" * 3000 + b"]" * 3000 + b"\n"),
    "planner-invalid-yaml": ("plan", b"model: [\n"),
    "planner-invalid-utf8": ("plan", b"model: {name: \xff}\n"),
    "planner-python-tag": ("plan", b"model: !!python/object:os.system x\n"),
    "planner-deep-nesting": ("plan", b"model: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n"),
    "yaml-empty-int-tag": ("deploy", b"serve: {port: !!int }\n"),
    "yaml-bad-float-tag": ("deploy", b"slo: {ttft_ms: !!float .}\n"),
    "yaml-bad-bool-tag": ("deploy", b"router: {policy: !!bool x}\n"),
    "yaml-bad-timestamp-tag": ("deploy", b"name: !!timestamp x\n"),
    "planner-yaml-bad-int-tag": ("plan", b"cluster: {nodes: !!int 0x}\n"),
}


@pytest.mark.parametrize("case", sorted(_CRASHERS))
def test_known_crashers_are_clear_errors(workdir, case):
    kind, data = _CRASHERS[case]
    with pytest.raises(ConfigError if kind == "deploy" else PlacementError):
        _load(kind, _write(workdir, data))


@pytest.mark.parametrize("content", [b"model: [\n", b"\xff\xfe\x00"])
def test_deploy_with_broken_planner_file_is_a_config_error(workdir, content):
    (workdir / "broken-plan.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match="planner"):
        load_config(_write(workdir, "pools: auto\nplanner: broken-plan.yaml\n"), check_paths=False)
