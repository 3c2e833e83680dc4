"""InferenceService specs found by a machine (hypothesis, from the CRD's own schema: tests/e2e/crd_specs.py) against
the real API server and the operator: every spec is either refused by the API server with a message naming the
field, or planned, or refused by the planner with its message (`Planned=False`); the operator's own parse of what
the API server accepted never fails, planning and rendering never raise anything else, and the running operator
deploys nothing for a spec it marked failed and does not retry it.

NPUSERVE_CRD_EXAMPLES sets how many specs (default 300); `benchmarks/crd_fuzz.py` runs thousands."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import crd_specs
import kubernetes
import localk8s
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from kubernetes.client.rest import ApiException
from operator_harness import helm_install, running_operator, scratch_namespace, wait_for

from npuserve.operator.handlers import _parse
from npuserve.operator.names import INSTANCE_LABEL
from npuserve.operator.render import render
from npuserve.operator.status import ENGINE_CANNOT_SERVE
from npuserve.planning.api import GROUP, PLURAL, VERSION
from npuserve.planning.planner import PlanError, plan, servability

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
EXAMPLES = int(os.environ.get("NPUSERVE_CRD_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# What the running-operator test creates for real: specs the planner refuses or the engine cannot serve.
REAL_OBJECTS = 8


@pytest.fixture(scope="module")
def custom_objects(k8s_cluster: localk8s.Cluster) -> Iterator[kubernetes.client.CustomObjectsApi]:
    helm_install(k8s_cluster)  # the CRD
    client = kubernetes.config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))
    yield kubernetes.client.CustomObjectsApi(client)
    client.close()


def _body(spec: dict[str, Any], name: str = "fuzz", namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _dry_run(api: kubernetes.client.CustomObjectsApi, spec: dict[str, Any]) -> dict[str, Any] | ApiException:
    """The object as the API server would store it (defaults applied), or its refusal. Strict field validation, as
    kubectl sends."""
    try:
        return dict(api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, _body(spec),
                                                        dry_run="All", field_validation="Strict"))
    except ApiException as e:
        return e


def _named_fields(refusal: ApiException) -> list[str]:
    status = json.loads(refusal.body)
    causes = (status.get("details") or {}).get("causes") or []
    named = [c.get("field", "") for c in causes if c.get("field", "").startswith("spec")]
    message = status.get("message", "")
    return named or ([message] if "spec." in message or "spec:" in message else [])


def operator_outcome(stored: dict[str, Any]) -> str:
    """What the operator makes of an accepted object: its own parse (must succeed: the CRD and the API models are
    one definition), then planned / plan failed (PlanError, with a message) / cannot serve; rendering a plan must
    not raise."""
    isvc = _parse(stored)
    try:
        result = plan(isvc.spec)
    except PlanError as e:
        assert str(e).strip(), "a planner refusal without a message"
        return "plan failed"
    if servability(result) is not None:
        return "cannot serve"
    assert render(isvc, result)
    return "planned"


def test_every_spec_is_refused_by_name_or_planned_or_refused_by_the_planner(
        custom_objects: kubernetes.client.CustomObjectsApi) -> None:
    counts: Counter[str] = Counter()

    @FUZZ
    @given(spec=crd_specs.specs())
    def check(spec: dict[str, Any]) -> None:
        stored = _dry_run(custom_objects, spec)
        if isinstance(stored, ApiException):
            assert stored.status in (400, 422), f"{stored.status}: {stored.body}"  # refused, never a server error
            assert _named_fields(stored), f"a refusal that names no field: {stored.body}"
            counts["refused by the API server"] += 1
            return
        counts[operator_outcome(stored)] += 1

    check()
    print(f"\n{sum(counts.values())} specs: " + ", ".join(f"{n} {what}" for what, n in counts.most_common()))
    # every path was taken: a generator that only ever produced refusals would prove nothing
    assert counts["refused by the API server"] and counts["planned"] and counts["plan failed"], counts


def _specs_the_operator_refuses(api: kubernetes.client.CustomObjectsApi, wanted: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    # 150 draws per object wanted: since the CRD's rules also refuse spec.autotune.innerLoop without a mean TPOT
    # bound, fewer drawn specs reach the operator (one run found 4 of 8 in 320 draws); draws past `wanted` are free.
    @settings(FUZZ, max_examples=150 * wanted, phases=[Phase.generate])
    @given(spec=crd_specs.specs())
    def collect(spec: dict[str, Any]) -> None:
        if len(found) >= wanted:
            return
        stored = _dry_run(api, spec)
        if not isinstance(stored, ApiException) and operator_outcome(stored) in ("plan failed", "cannot serve"):
            found.append(spec)

    collect()
    return found


def test_the_operator_deploys_nothing_for_a_spec_it_refuses_and_does_not_retry(
        k8s_cluster: localk8s.Cluster, custom_objects: kubernetes.client.CustomObjectsApi) -> None:
    specs = _specs_the_operator_refuses(custom_objects, REAL_OBJECTS)
    assert len(specs) == REAL_OBJECTS
    apps = kubernetes.client.AppsV1Api(kubernetes.config.new_client_from_config(
        config_file=str(k8s_cluster.kubeconfig)))
    with scratch_namespace(k8s_cluster, "fuzz-") as ns, running_operator(k8s_cluster):
        names = [f"refused-{i}" for i in range(len(specs))]
        for name, spec in zip(names, specs, strict=True):
            custom_objects.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _body(spec, name, ns))

        def planned_false(name: str) -> dict[str, Any] | None:
            obj = custom_objects.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
            planner = conditions.get("Planned", {}).get("reason") == "PlanFailed"
            engine = conditions.get("Deployed", {}).get("reason") == ENGINE_CANNOT_SERVE
            return conditions if planner or engine else None

        for name in names:
            conditions = wait_for(f"{name} refused in its status", lambda name=name: planned_false(name), timeout=90)
            assert any(c.get("message") for c in conditions.values()), conditions
        time.sleep(10)  # long enough for kopf's retry backoff to have fired again, were it retrying
        events = k8s_cluster.kubectl("get", "events", "-n", ns, "-o", "json")
        reasons: Counter[tuple[str, str]] = Counter()
        for event in json.loads(events)["items"]:  # kopf posts each event anew; a repeated one may also be counted
            if event["involvedObject"].get("kind") == "InferenceService":
                reasons[event["involvedObject"]["name"], event["reason"]] += event.get("count") or 1
        for name in names:
            repeated = {reason: n for (who, reason), n in reasons.items() if who == name and n > 1}
            assert not repeated, f"{name} handled again and again: {repeated}"
        deployed = apps.list_namespaced_deployment(ns, label_selector=INSTANCE_LABEL).items
        assert not deployed, [d.metadata.name for d in deployed]


def test_the_api_server_refuses_the_inner_loop_without_a_mean_tpot_bound_naming_the_field(
        custom_objects: kubernetes.client.CustomObjectsApi) -> None:
    """spec.autotune.innerLoop: the engine's controller holds a mean TPOT target, so the API server refuses the
    inner loop without spec.slo.tpotMs and with a p90/p99 bound, and stores it with a mean TPOT bound."""
    import yaml
    from operator_harness import REPO

    spec = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())["spec"]
    spec["autotune"] = {"enabled": True, "innerLoop": True}
    for slo, words in (({"objective": "throughput"}, "spec.autotune.innerLoop needs spec.slo.tpotMs"),
                       ({"objective": "decodeLatency", "tpotMs": 50, "statistic": "p99"},
                        "spec.autotune.innerLoop needs spec.slo.statistic mean")):
        refused = _dry_run(custom_objects, {**spec, "slo": slo})
        assert isinstance(refused, ApiException) and refused.status == 422, refused
        assert words in json.loads(refused.body)["message"] and "spec.autotune.innerLoop" in _named_fields(refused)
    stored = _dry_run(custom_objects, {**spec, "slo": {"objective": "decodeLatency", "tpotMs": 50}})
    assert not isinstance(stored, ApiException), stored.body
    assert stored["spec"]["autotune"]["innerLoop"] is True and stored["spec"]["slo"]["statistic"] == "mean"
