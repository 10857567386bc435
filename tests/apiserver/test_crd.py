"""The CRDs as the real API server enforces them: schema, CEL immutability, selectable fields, enums.

Every refusal is the kube-apiserver's own (structural schema, OpenAPI formats, CEL rules), and each
test checks the accepted case next to the refused one, so a schema that lets everything through fails.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.rules import contracts as c
from controller.rules.capture import origin_of
from controller.rules.durations import Invalid
from controller.rules.models import Origin
from controller.rules.sizes import human_size, parse_size
from hack.localcluster import KubectlError, LocalCluster
from tests.bed.controller_harness import CRDS, install_crds, instant


@functools.cache  # read-only: the property test below reads it for each of its 300 examples (50 ms a parse)
def crd(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CRDS / f"{c.GROUP}_{name}.yaml").read_text())
    return loaded


def version_schema(doc: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.fixture
def crds(cluster: LocalCluster) -> LocalCluster:
    install_crds(cluster)
    return cluster


def create(cluster: LocalCluster, namespace: str, body: dict[str, Any], kind: str = c.SANDBOX_KIND) -> str:
    body = {"apiVersion": c.API_VERSION, "kind": kind, **body}
    body["metadata"] = {"namespace": namespace, **body["metadata"]}
    return cluster.kubectl("create", "-f", "-", input=json.dumps(body)).stdout


def refusal(cluster: LocalCluster, namespace: str, body: dict[str, Any], kind: str = c.SANDBOX_KIND) -> str:
    with pytest.raises(KubectlError) as refused:
        create(cluster, namespace, body, kind)
    return str(refused.value)


# --- the files agree with contracts ------------------------------------------------------------------------
def test_sandbox_crd_names_match_contracts() -> None:
    doc = crd(c.SANDBOX_PLURAL)
    names = doc["spec"]["names"]
    assert doc["metadata"]["name"] == f"{c.SANDBOX_PLURAL}.{c.GROUP}"
    assert doc["spec"]["group"] == c.GROUP
    assert [v["name"] for v in doc["spec"]["versions"]] == [c.VERSION]
    assert (names["kind"], names["plural"], names["singular"]) == (c.SANDBOX_KIND, c.SANDBOX_PLURAL, c.SANDBOX_SINGULAR)
    assert names["shortNames"] == [c.SANDBOX_SHORT]
    assert names["categories"] == [c.CATEGORY]


def test_policy_crd_names_match_contracts() -> None:
    doc = crd(c.POLICY_PLURAL)
    names = doc["spec"]["names"]
    assert doc["spec"]["group"] == c.GROUP
    assert (names["kind"], names["plural"], names["singular"]) == (c.POLICY_KIND, c.POLICY_PLURAL, c.POLICY_SINGULAR)
    assert names["shortNames"] == [c.POLICY_SHORT]
    assert names["categories"] == [c.CATEGORY]
    spec = version_schema(doc)["properties"]["spec"]["properties"]
    fields = {"retention", c.RETENTION_BY_OUTCOME, "maxPin", c.MAX_AGE, c.HISTORY_LIMITS, "dryRun", "quota"}
    assert set(spec) == fields | {"releasePriority", c.WARN_BEFORE, c.WARN_WEBHOOK}
    assert spec[c.HISTORY_LIMITS]["properties"]["groupBy"]["enum"] == list(c.GROUP_BYS)
    assert set(spec[c.RETENTION_BY_OUTCOME]["properties"]) == {o.lower() for o in c.Outcome}
    assert spec["releasePriority"]["enum"] == [p.value for p in c.ReleasePriority]


def _fields(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every field path below `schema` (array items share their array's path, as kubectl explain reads it)."""
    for name, sub in (schema.get("properties") or {}).items():
        yield f"{path}.{name}", sub
        yield from _fields(sub.get("items", sub), f"{path}.{name}")


def _described(short: str, plural: str) -> list[tuple[str, str]]:
    """(explain path, description) for the root and every field but metadata, whose text the server owns."""
    schema = version_schema(crd(plural))
    fields = [(p, f) for p, f in _fields(schema, short) if p != f"{short}.metadata"]
    return [(short, schema.get("description", "")), *((p, f.get("description", "")) for p, f in fields)]


def test_every_field_of_both_crds_is_described_for_kubectl_explain() -> None:
    missing = [
        path
        for short, plural in ((c.SANDBOX_SHORT, c.SANDBOX_PLURAL), (c.POLICY_SHORT, c.POLICY_PLURAL))
        for path, text in _described(short, plural)
        if len(text.split()) < 3
    ]
    assert missing == []


def _undescribed(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _undescribed(v) for k, v in schema.items() if k != "description"}
    return schema


def test_the_policy_status_is_typed_with_the_same_conditions_as_a_sandbox() -> None:
    status = version_schema(crd(c.POLICY_PLURAL))["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status
    assert set(status["properties"]) == {"observedGeneration", "conditions"}
    sandbox_conditions = version_schema(crd(c.SANDBOX_PLURAL))["properties"]["status"]["properties"]["conditions"]
    assert _undescribed(status["properties"]["conditions"]["items"]) == _undescribed(sandbox_conditions["items"])
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_status_enums_are_the_contracts_enums() -> None:
    status = version_schema(crd(c.SANDBOX_PLURAL))["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == [p.value for p in c.Phase]
    assert status["deadlineSource"]["enum"] == [s.value for s in c.DeadlineSource]
    assert status["releasePriority"]["enum"] == [p.value for p in c.ReleasePriority]
    reason_pattern = status["conditions"]["items"]["properties"]["reason"]["pattern"]
    assert all(re.match(reason_pattern, r.value) for r in c.Reason)
    mount = status["sessions"]["items"]["properties"]["mount"]
    assert mount["enum"] == [m.value for m in c.MountCheck], "kept so objects written before stay valid"
    origin = version_schema(crd(c.SANDBOX_PLURAL))["properties"]["spec"]["properties"]["origin"]["properties"]
    assert origin["outcome"]["enum"] == [o.value for o in c.Outcome]
    assert origin["containers"]["maxItems"] == c.ORIGIN_CONTAINERS_MAX
    assert origin["labels"]["maxProperties"] == len(c.ORIGIN_LABELS)


def test_printer_columns_are_node_phase_outcome_deadline_pinned_size_age_and_bytes_files_when_wide() -> None:
    version = crd(c.SANDBOX_PLURAL)["spec"]["versions"][0]
    columns = {col["name"]: col for col in version["additionalPrinterColumns"]}
    assert list(columns) == ["Node", "Phase", "Outcome", "Deadline", "Pinned", "Size", "Age", "Bytes", "Files"]
    assert columns["Outcome"]["jsonPath"] == ".spec.origin.outcome"
    assert columns["Size"]["jsonPath"] == ".status.size" and columns["Bytes"]["jsonPath"] == ".status.sizeBytes"
    assert [name for name, col in columns.items() if col.get("priority", 0) > 0] == ["Bytes", "Files"]
    assert version["subresources"] == {"status": {}}
    assert version["selectableFields"] == [{"jsonPath": ".spec.nodeName"}]


# --- the server enforces the schema ------------------------------------------------------------------------
def test_a_sandbox_without_node_or_created_at_is_refused(crds: LocalCluster, namespace: str) -> None:
    words = refusal(crds, namespace, {"metadata": {"name": "no-node"}, "spec": {"createdAt": instant()}})
    assert "spec.nodeName: Required value" in words
    words = refusal(crds, namespace, {"metadata": {"name": "no-time"}, "spec": {"nodeName": "n1"}})
    assert "spec.createdAt: Required value" in words
    create(crds, namespace, {"metadata": {"name": "fine"}, "spec": {"nodeName": "n1", "createdAt": instant()}})


def test_a_created_at_that_is_not_a_date_time_is_refused(crds: LocalCluster, namespace: str) -> None:
    words = refusal(crds, namespace, {"metadata": {"name": "bad"}, "spec": {"nodeName": "n1", "createdAt": "today"}})
    assert "spec.createdAt" in words and "date-time" in words


def test_retain_until_before_created_at_is_refused_with_the_rule_message(crds: LocalCluster, namespace: str) -> None:
    spec = {"nodeName": "n1", "createdAt": "2026-01-02T00:00:00Z", "retainUntil": "2026-01-01T00:00:00Z"}
    words = refusal(crds, namespace, {"metadata": {"name": "backwards"}, "spec": spec})
    assert "spec.retainUntil must not be before spec.createdAt" in words


def test_a_node_name_that_is_not_a_dns_name_is_refused(crds: LocalCluster, namespace: str) -> None:
    body = {"metadata": {"name": "x"}, "spec": {"nodeName": "Node_A", "createdAt": instant()}}
    words = refusal(crds, namespace, body)
    assert "spec.nodeName" in words


def test_node_name_is_immutable(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "fixed"}, "spec": {"nodeName": "n1", "createdAt": instant()}})
    crds.kubectl("patch", "rsb", "fixed", "-n", namespace, "--type=merge", "-p", '{"spec":{"jobId":"j-1"}}')
    with pytest.raises(KubectlError) as refused:
        crds.kubectl("patch", "rsb", "fixed", "-n", namespace, "--type=merge", "-p", '{"spec":{"nodeName":"n2"}}')
    assert "spec.nodeName is immutable; a sandbox cannot move to another node" in str(refused.value)


def test_a_status_phase_outside_the_enum_is_refused(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "s"}, "spec": {"nodeName": "n1", "createdAt": instant()}})
    patch = ["patch", "rsb", "s", "-n", namespace, "--subresource=status", "--type=merge", "-p"]
    crds.kubectl(*patch, '{"status":{"phase":"Pinned"}}')
    with pytest.raises(KubectlError) as refused:
        crds.kubectl(*patch, '{"status":{"phase":"Gone"}}')
    assert "status.phase" in str(refused.value) and "Unsupported value" in str(refused.value)


def test_a_field_selector_on_node_name_selects_one_nodes_sandboxes(crds: LocalCluster, namespace: str) -> None:
    for name, node in (("on-a", "node-a"), ("on-b", "node-b"), ("also-a", "node-a")):
        create(crds, namespace, {"metadata": {"name": name}, "spec": {"nodeName": node, "createdAt": instant()}})
    listed = crds.kubectl_json("get", c.SANDBOX_SHORT, "-n", namespace, "--field-selector=spec.nodeName=node-a")
    assert sorted(i["metadata"]["name"] for i in listed["items"]) == ["also-a", "on-a"]
    with pytest.raises(KubectlError) as refused:
        crds.kubectl("get", c.SANDBOX_SHORT, "-n", namespace, "--field-selector=spec.jobId=x")
    assert "field label not supported" in str(refused.value)


def test_kubectl_get_shows_the_printer_columns(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "shown"}, "spec": {"nodeName": "node-a", "createdAt": instant()}})
    header = crds.kubectl("get", c.SANDBOX_SHORT, "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "NODE", "PHASE", "OUTCOME", "DEADLINE", "PINNED", "SIZE", "AGE"]
    assert "shown" in crds.kubectl("get", c.CATEGORY, "-n", namespace).stdout


def test_a_policy_with_an_unreadable_retention_is_refused(crds: LocalCluster, namespace: str) -> None:
    words = refusal(crds, namespace, {"metadata": {"name": "p"}, "spec": {"retention": "3 days"}}, c.POLICY_KIND)
    assert "spec.retention" in words
    create(crds, namespace, {"metadata": {"name": "p"}, "spec": {"retention": "3d", "maxPin": "2w"}}, c.POLICY_KIND)


def test_a_policy_sets_retention_per_outcome_max_age_and_history_limits_and_nothing_else(
    crds: LocalCluster, namespace: str
) -> None:
    def policy(name: str, windows: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": {c.RETENTION_BY_OUTCOME: windows}}

    assert f"spec.{c.RETENTION_BY_OUTCOME}.failed" in refusal(
        crds, namespace, policy("a", {"failed": "2 weeks"}), c.POLICY_KIND
    )
    words = refusal(crds, namespace, policy("b", {"cancelled": "1d"}), c.POLICY_KIND)
    assert "cancelled" in words
    create(crds, namespace, policy("c", {o.lower(): "1d" for o in c.Outcome} | {"succeeded": "0"}), c.POLICY_KIND)
    hard = {"metadata": {"name": "d"}, "spec": {c.MAX_AGE: "30 days"}}
    assert f"spec.{c.MAX_AGE}" in refusal(crds, namespace, hard, c.POLICY_KIND)
    create(crds, namespace, {"metadata": {"name": "d"}, "spec": {c.MAX_AGE: "30d"}}, c.POLICY_KIND)
    for bad in ({"groupBy": "team"}, {"groupBy": "owner", "failed": -1}, {"failed": 3}):
        words = refusal(crds, namespace, {"metadata": {"name": "e"}, "spec": {c.HISTORY_LIMITS: bad}}, c.POLICY_KIND)
        assert f"spec.{c.HISTORY_LIMITS}" in words
    limits = {"groupBy": "tekton.dev/pipelineRun", "succeeded": 3, "keepLastFailed": 1}
    create(crds, namespace, {"metadata": {"name": "e"}, "spec": {c.HISTORY_LIMITS: limits}}, c.POLICY_KIND)
    for url in ("file:///etc/passwd", "ftp://host/x", "https://", "hooks.example.com/x"):
        words = refusal(
            crds, namespace, {"metadata": {"name": "f"}, "spec": {c.WARN_WEBHOOK: {"url": url}}}, c.POLICY_KIND
        )
        assert f"spec.{c.WARN_WEBHOOK}.url" in words, url
    assert f"spec.{c.WARN_WEBHOOK}.url" in refusal(
        crds, namespace, {"metadata": {"name": "f"}, "spec": {c.WARN_WEBHOOK: {}}}, c.POLICY_KIND
    )
    hook = {"url": "https://hooks.example.com/sandkeep?token=x"}
    create(crds, namespace, {"metadata": {"name": "f"}, "spec": {c.WARN_WEBHOOK: hook}}, c.POLICY_KIND)


def test_a_policy_quota_and_release_priority_outside_the_schema_are_refused(crds: LocalCluster, namespace: str) -> None:
    def policy(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": spec}

    assert "spec.quota.maxBytes" in refusal(
        crds, namespace, policy("a", {"quota": {"maxBytes": "1.5G"}}), c.POLICY_KIND
    )
    assert "spec.quota.maxCount" in refusal(crds, namespace, policy("b", {"quota": {"maxCount": -1}}), c.POLICY_KIND)
    words = refusal(crds, namespace, policy("c", {"releasePriority": "Never"}), c.POLICY_KIND)
    assert "spec.releasePriority" in words and "First" in words
    create(crds, namespace, policy("d", {"quota": {"maxBytes": "50Gi", "maxCount": 10}}), c.POLICY_KIND)
    create(crds, namespace, policy("e", {"quota": {"maxBytes": 1000}, "releasePriority": "Last"}), c.POLICY_KIND)


@given(st.text(alphabet="0123456789kKMGTPEi.e+- ", max_size=24))
@settings(max_examples=300, deadline=None)
def test_the_quota_size_pattern_accepts_exactly_what_parse_size_reads(text: str) -> None:
    # The schema's pattern refuses at `kubectl apply` what the controller could not read; the two must agree
    # (beyond the pattern, only a number too large for int64 is the controller's alone to refuse).
    schema = version_schema(crd(c.POLICY_PLURAL))["properties"]["spec"]["properties"]["quota"]["properties"]
    pattern = schema["maxBytes"]["pattern"]
    by_schema = re.fullmatch(pattern.strip("^$"), text) is not None and len(text) <= schema["maxBytes"]["maxLength"]
    parsed = parse_size(text)
    if by_schema:
        assert not isinstance(parsed, Invalid) or "too large" in parsed.why
    else:
        assert isinstance(parsed, Invalid) or text != text.strip()


def test_crd_files_are_the_ones_installed(crds: LocalCluster) -> None:
    served = crds.kubectl_json("get", "crd", f"{c.SANDBOX_PLURAL}.{c.GROUP}")
    assert served["spec"]["names"]["shortNames"] == [c.SANDBOX_SHORT]
    assert served["spec"]["versions"][0]["selectableFields"] == [{"jsonPath": ".spec.nodeName"}]


def test_created_at_is_immutable_so_nobody_stretches_the_window(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "aged"}, "spec": {"nodeName": "n1", "createdAt": instant()}})
    with pytest.raises(KubectlError) as refused:
        patch = '{"spec":{"createdAt":"2099-01-01T00:00:00Z"}}'
        crds.kubectl("patch", "rsb", "aged", "-n", namespace, "--type=merge", "-p", patch)
    assert "spec.createdAt is immutable" in str(refused.value)


def _widest_pod() -> dict[str, Any]:
    """A Pod with every field origin_of reads at (or past) its bound."""
    containers = [{"name": f"c{i:02d}" + "x" * 70, "image": "r/" + "i" * 600} for i in range(20)]
    statuses = [{"name": cn["name"], "state": {"terminated": {"exitCode": 2**31 - 1}}} for cn in containers]
    labels = {k: "v" * 80 for k in c.ORIGIN_LABELS} | {"other": "x"}
    owner = {"kind": "K" * 80, "name": "o" * 300, "controller": True, "apiVersion": "v1", "uid": "u"}
    return {
        "metadata": {"labels": labels, "ownerReferences": [owner]},
        "spec": {"containers": containers, "nodeName": "n" * 300},
        "status": {"containerStatuses": statuses},
    }


def test_an_origin_at_its_bounds_is_accepted_shown_as_the_outcome_and_immutable(
    crds: LocalCluster, namespace: str
) -> None:
    origin = origin_of(_widest_pod(), c.Outcome.FAILED, pod_name="p" * 300, pod_uid="u" * 200, node=None).body()
    spec = {"nodeName": "node-a", "createdAt": instant(), "origin": origin}
    create(crds, namespace, {"metadata": {"name": "widest"}, "spec": spec})
    [row] = _rows(crds.kubectl("get", c.SANDBOX_SHORT, "widest", "-n", namespace).stdout)
    assert row["OUTCOME"] == "Failed"
    for bad in (
        origin | {"outcome": "Maybe"},
        origin | {"containers": origin["containers"] * 2},
        origin | {"labels": origin["labels"] | {"x": "y"}},
        {k: v for k, v in origin.items() if k != "outcome"},
    ):
        words = refusal(crds, namespace, {"metadata": {"name": "over"}, "spec": spec | {"origin": bad}})
        assert "spec.origin" in words
    retained = Origin(outcome=c.Outcome.SUCCEEDED).body()  # `sandkeep retain --outcome`: the outcome alone
    create(crds, namespace, {"metadata": {"name": "retained"}, "spec": spec | {"origin": retained}})
    [row] = _rows(crds.kubectl("get", c.SANDBOX_SHORT, "retained", "-n", namespace).stdout)
    assert row["OUTCOME"] == "Succeeded"
    with pytest.raises(KubectlError) as refused:
        patch = json.dumps({"spec": {"origin": {"outcome": "Succeeded"}}})
        crds.kubectl("patch", "rsb", "widest", "-n", namespace, "--type=merge", "-p", patch)
    assert "spec.origin is immutable" in str(refused.value)


def _rows(table: str) -> list[dict[str, str]]:
    """`kubectl get` output as rows by column, read at the header's offsets (empty cells stay empty)."""
    header, *lines = table.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return [{header[a:b].strip(): line[a:b].strip() for a, b in bounds} for line in lines]


def _explain(cluster: LocalCluster, path: str) -> str:
    # The API server publishes a new CRD's OpenAPI a moment after it is Established.
    deadline = time.monotonic() + 30
    while True:
        result = cluster.kubectl("explain", path, check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            assert result.returncode == 0, result.stderr
            return " ".join(result.stdout.split())
        time.sleep(0.2)


def test_kubectl_explain_prints_every_description_of_both_crds(crds: LocalCluster) -> None:
    fields = [*_described(c.SANDBOX_SHORT, c.SANDBOX_PLURAL), *_described(c.POLICY_SHORT, c.POLICY_PLURAL)]
    assert len(fields) > 40
    silent = [path for path, text in fields if " ".join(text.split()) not in _explain(crds, path)]
    assert silent == []
    assert "Stuck - the directory could not be deleted" in _explain(crds, "rsb.status.phase")


def test_kubectl_get_shows_the_size_for_people_and_the_bytes_when_wide(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "big"}, "spec": {"nodeName": "node-a", "createdAt": instant()}})
    size = 3 * 1024**3 // 2
    status = {"status": {"size": human_size(size), "sizeBytes": size, "fileCount": 12}}
    crds.kubectl(
        "patch", "rsb", "big", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    [narrow] = _rows(crds.kubectl("get", c.SANDBOX_SHORT, "big", "-n", namespace).stdout)
    assert narrow["SIZE"] == "1.5G" and "BYTES" not in narrow
    [wide] = _rows(crds.kubectl("get", c.SANDBOX_SHORT, "big", "-n", namespace, "-o", "wide").stdout)
    assert (wide["SIZE"], wide["BYTES"], wide["FILES"]) == ("1.5G", str(size), "12")


def test_a_policy_status_outside_the_schema_is_refused(crds: LocalCluster, namespace: str) -> None:
    create(crds, namespace, {"metadata": {"name": "p"}, "spec": {"retention": "3d"}}, c.POLICY_KIND)
    status_patch = ["patch", c.POLICY_SHORT, "p", "-n", namespace, "--subresource=status", "--type=merge", "-p"]
    good = {"type": "Active", "status": "True", "reason": "InForce", "message": "", "lastTransitionTime": instant()}
    crds.kubectl(*status_patch, json.dumps({"status": {"conditions": [good]}}))
    with pytest.raises(KubectlError) as refused:
        crds.kubectl(*status_patch, json.dumps({"status": {"conditions": [good | {"status": "Maybe"}]}}))
    assert "Unsupported value" in str(refused.value)
    with pytest.raises(KubectlError) as unknown:
        crds.kubectl(*status_patch, '{"status":{"anything":1}}', "--validate=strict")
    assert "anything" in str(unknown.value)
