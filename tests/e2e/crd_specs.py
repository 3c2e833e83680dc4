"""InferenceService specs generated from the CRD's own schema, for the property tests of the API server's refusals
and the operator's planning (tests/e2e/test_crd_properties.py; `benchmarks/crd_fuzz.py` runs thousands).

The schema is the checked-in CRD's `spec` (deploy/crds/). Its structural schema uses a handful of keywords (object
properties and required, enum, string length and pattern, integer and number bounds, arrays and maps), each drawn
here by a hypothesis strategy (hypothesis-jsonschema would do it, but it does not run with the hypothesis this suite
pins). The CEL rules are left to the API server, which is what is under test. Specs are drawn three ways: from the
schema alone (valid in shape, mostly nonsense in meaning), from the repository's examples, and either of them with
one part broken (a value replaced by junk, a key removed, an unknown key added)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "deploy" / "crds" / "inferenceservices.npuserve.io.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Sizes bounded so a draw stays small: the point is each field's refusal, not the API server's size limits.
MAX_STRING, MAX_ITEMS, UNBOUNDED_SPAN = 12, 3, 10**6
KEY_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "./-", min_size=1, max_size=MAX_STRING)
CHARACTERS = st.characters(codec="utf-8")  # what JSON can carry to the API server (no lone surrogates)


def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


def _bounds(node: dict[str, Any], integer: bool) -> tuple[Any, Any, bool]:
    """(low, high, whether low is excluded) of a numeric node (OpenAPI v3.0: exclusiveMinimum is a flag)."""
    low, high = node.get("minimum"), node.get("maximum")
    exclusive = node.get("exclusiveMinimum") is True
    if integer and exclusive and low is not None:
        low, exclusive = low + 1, False
    if high is None:
        high = (low or 0) + UNBOUNDED_SPAN
    return low, high, exclusive


def from_crd_schema(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for one node of a CRD's structural schema (CEL rules aside)."""
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object":
        properties = node.get("properties")
        if properties is None:  # a map
            extra = node.get("additionalProperties")
            values = from_crd_schema(extra) if isinstance(extra, dict) else st.text(CHARACTERS, max_size=MAX_STRING)
            return st.dictionaries(KEY_TEXT, values, max_size=MAX_ITEMS)
        required = set(node.get("required", []))
        return st.fixed_dictionaries(
            {k: from_crd_schema(v) for k, v in properties.items() if k in required},
            optional={k: from_crd_schema(v) for k, v in properties.items() if k not in required})
    if kind == "array":
        return st.lists(from_crd_schema(node.get("items", {"type": "string"})), max_size=MAX_ITEMS)
    if kind == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True).filter(lambda s: len(s) <= 4 * MAX_STRING)
        return st.text(CHARACTERS, min_size=node.get("minLength", 0),
                       max_size=min(node.get("maxLength", MAX_STRING), MAX_STRING))
    if kind == "integer":
        low, high, _ = _bounds(node, integer=True)
        return st.integers(low, high)
    if kind == "number":
        low, high, exclusive = _bounds(node, integer=False)
        return st.floats(low, high, exclude_min=exclusive and low is not None, allow_nan=False,
                         allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    return st.one_of(st.integers(-10, 10**4), st.text(CHARACTERS, max_size=MAX_STRING))  # int-or-string, untyped


def example_specs() -> list[dict[str, Any]]:
    specs = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceService":
                specs.append(doc["spec"])
    return specs


def _paths(value: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, (*prefix, i))
    return found


JUNK = st.one_of(st.integers(-(10**6), 10**7), st.floats(-1e6, 1e6, allow_nan=False), st.booleans(), st.none(),
                 st.text(CHARACTERS, max_size=MAX_STRING), st.just([]), st.just({}), st.just("0"), st.just(-1),
                 st.just(0))


@st.composite
def broken(draw: st.DrawFn, spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with one part broken: a value replaced, a key removed, or an unknown key added."""
    spec = yaml.safe_load(yaml.safe_dump(spec))  # a deep copy
    paths = _paths(spec)
    how = draw(st.sampled_from(["replace", "remove", "unknown"])) if paths else "unknown"
    path = draw(st.sampled_from(paths)) if paths else ()
    parent: Any = spec
    for key in path[:-1]:
        parent = parent[key]
    if how == "unknown":
        target = parent if isinstance(parent, dict) else spec
        target[draw(st.sampled_from(["x", "bogus", "maxBatchSize", "cards"]))] = draw(JUNK)
    elif how == "remove" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JUNK)
    return spec


@st.composite
def recombined(draw: st.DrawFn) -> dict[str, Any]:
    """An example with sections of others (a 70B model on one CPU, a latency SLO on a throughput example) and its
    numbers rescaled: valid in shape, often past what the planner can fit."""
    examples = example_specs()
    spec = yaml.safe_load(yaml.safe_dump(draw(st.sampled_from(examples))))
    for _ in range(draw(st.integers(0, 3))):
        donor = draw(st.sampled_from(examples))
        section = draw(st.sampled_from(sorted(donor)))
        spec[section] = yaml.safe_load(yaml.safe_dump(donor[section]))
    numbers = [p for p in _paths(spec) if isinstance(_at(spec, p), int) and not isinstance(_at(spec, p), bool)]
    for path in draw(st.lists(st.sampled_from(numbers), max_size=2, unique=True)) if numbers else []:
        parent = _at(spec, path[:-1])
        parent[path[-1]] = draw(st.sampled_from([1, 2, 3, 7, 16, 64, 1000, 100_000, 10**6]))
    return spec


def _at(value: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def specs() -> st.SearchStrategy[dict[str, Any]]:
    """Specs from the schema, from the examples (alone or recombined), and any of them with one part broken."""
    base = st.one_of(from_crd_schema(crd_spec_schema()), st.sampled_from(example_specs()), recombined())
    return st.one_of(base, base.flatmap(broken))
