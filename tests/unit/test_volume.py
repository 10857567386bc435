"""Checking a CSI publish (issue 27, item 7): `parse_publish` gives a VolumeRequest or a VolumeError whose code is
the CSI spec's and whose message tells the user, in their Pod's Events, what to write instead. Never anything else.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.rules.contracts import (
    POD_INFO_EPHEMERAL,
    POD_INFO_NAME,
    POD_INFO_NAMESPACE,
    POD_INFO_SERVICE_ACCOUNT,
    POD_INFO_UID,
    VOLUME_KEEP,
    VOLUME_NAME,
    VOLUME_READ_WRITE,
    VOLUME_RETENTION,
    VOLUME_SANDBOX,
    Keep,
)
from controller.rules.volume import (
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    MAX_ATTRIBUTES,
    MAX_BYTES,
    Capability,
    VolumeError,
    VolumeRequest,
    parse_publish,
    parse_unpublish,
)

KUBELET = "/var/lib/kubelet"
UID = "0f3c9a0e-6a0b-4d2b-9c52-1e2f3a4b5c6d"
TARGET = f"{KUBELET}/pods/{UID}/volumes/kubernetes.io~csi/workspace/mount"
VOLUME_ID = "csi-4c2f9e0d1b7a6c5e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e"
POD = {
    POD_INFO_NAMESPACE: "team-a",
    POD_INFO_NAME: "build-42-x7k2p",
    POD_INFO_UID: UID,
    POD_INFO_SERVICE_ACCOUNT: "default",
    POD_INFO_EPHEMERAL: "true",
}
MOUNT = Capability("mount", "SINGLE_NODE_WRITER")


def publish(
    attributes: dict[str, str] | None = None,
    *,
    target: str = TARGET,
    capability: Capability | None = MOUNT,
    readonly: bool = False,
    volume_id: str = VOLUME_ID,
    kubelet_dir: str = KUBELET,
) -> VolumeRequest:
    return parse_publish(volume_id, target, capability, readonly, {**POD, **(attributes or {})}, kubelet_dir)


def refusal(**kwargs: object) -> VolumeError:
    with pytest.raises(VolumeError) as caught:
        publish(**kwargs)  # type: ignore[arg-type]
    return caught.value


def test_an_inline_volume_without_attributes_is_a_fresh_workspace_kept_always() -> None:
    req = publish()
    assert req == VolumeRequest(
        volume_id=VOLUME_ID,
        target_path=TARGET,
        pod_namespace="team-a",
        pod_name="build-42-x7k2p",
        pod_uid=UID,
        service_account="default",
        keep=Keep.ALWAYS,
    )


def test_keep_name_and_retention_are_read_as_the_user_wrote_them() -> None:
    req = publish({VOLUME_KEEP: "OnFailure", VOLUME_NAME: "run-42", VOLUME_RETENTION: "3d"})
    assert (req.keep, req.name, req.retention, req.sandbox) == (Keep.ON_FAILURE, "run-42", timedelta(days=3), None)


def test_a_reopen_is_read_only_unless_read_write_says_true_and_csi_read_only_always_wins() -> None:
    assert publish({VOLUME_SANDBOX: "run-42"}).sandbox == "run-42"
    assert publish({VOLUME_SANDBOX: "run-42"}).read_only
    assert publish({VOLUME_SANDBOX: "run-42", VOLUME_READ_WRITE: "false"}).read_only
    assert not publish({VOLUME_SANDBOX: "run-42", VOLUME_READ_WRITE: "true"}).read_only
    assert publish({VOLUME_SANDBOX: "run-42", VOLUME_READ_WRITE: "true"}, readonly=True).read_only
    reader = Capability("mount", "SINGLE_NODE_READER_ONLY")
    assert publish({VOLUME_SANDBOX: "run-42", VOLUME_READ_WRITE: "true"}, capability=reader).read_only
    assert not publish().read_only  # a captured workspace is the Pod's to write


def test_the_pods_fsgroup_comes_as_a_numeric_mount_group() -> None:
    assert publish(capability=Capability("mount", "SINGLE_NODE_WRITER", "2000")).mount_group == 2000
    assert publish().mount_group is None
    err = refusal(capability=Capability("mount", "SINGLE_NODE_WRITER", "wheel"))
    assert err.code == INVALID_ARGUMENT and "numeric group id" in err.message


def test_a_kubelet_with_another_root_dir_is_served_when_the_agent_is_told() -> None:
    target = f"/data/kubelet/pods/{UID}/volumes/kubernetes.io~csi/workspace/mount"
    assert publish(target=target, kubelet_dir="/data/kubelet/").target_path == target
    err = refusal(target=target)
    assert "--kubelet-dir" in err.message and "/var/lib/kubelet" in err.message


@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        ({"volume_id": ""}, INVALID_ARGUMENT, ["no volume_id"]),
        ({"volume_id": "../../etc"}, INVALID_ARGUMENT, ["volume_id", "letters, digits"]),
        ({"target": ""}, INVALID_ARGUMENT, ["no target_path"]),
        ({"capability": None}, INVALID_ARGUMENT, ["no volume_capability"]),
        ({"capability": Capability("block", "SINGLE_NODE_WRITER")}, INVALID_ARGUMENT, ["not block devices"]),
        ({"capability": Capability(None, "SINGLE_NODE_WRITER")}, INVALID_ARGUMENT, ["neither mount nor block"]),
        ({"capability": Capability("mount", "MULTI_NODE_MULTI_WRITER")}, FAILED_PRECONDITION, ["single-node"]),
        ({"capability": Capability("mount", "UNKNOWN")}, INVALID_ARGUMENT, ["access_mode", "UNKNOWN"]),
        ({"target": "var/lib/kubelet/pods/x/mount"}, INVALID_ARGUMENT, ["not an absolute path"]),
        ({"target": f"{KUBELET}/pods/{UID}/../../../../etc/mount"}, INVALID_ARGUMENT, ["'..' component"]),
        ({"target": "/var/lib/sandkeep/team-a/run/workspace"}, INVALID_ARGUMENT, ["is not", "own volume directory"]),
        (
            {"target": TARGET.replace(UID, "another-pod-uid")},
            INVALID_ARGUMENT,
            ['/another-pod-uid/volumes/kubernetes.io~csi/workspace/mount" is not'],
        ),
        ({"target": TARGET + "/deeper"}, INVALID_ARGUMENT, ["own volume directory"]),
        ({"target": TARGET.replace("kubernetes.io~csi", "kubernetes.io~empty-dir")}, INVALID_ARGUMENT, ["is not"]),
    ],
)
def test_a_request_the_kubelet_would_not_send_is_refused_with_the_spec_code(
    change: dict[str, object], code: str, words: list[str]
) -> None:
    err = refusal(**change)
    assert err.code == code
    for word in words:
        assert word in err.message


@pytest.mark.parametrize(
    ("attributes", "words"),
    [
        ({POD_INFO_EPHEMERAL: "false"}, ["only inline ephemeral volumes", "spec.volumes[].csi"]),
        ({POD_INFO_NAME: ""}, ["podInfoOnMount must be on", POD_INFO_NAME]),
        ({"kep": "Always"}, ['"kep"', "keep, name, retention, sandbox, readWrite"]),
        ({"sandkeep.io/keep": "Always"}, ['"sandkeep.io/keep"', "keep, name, retention, sandbox, readWrite"]),
        ({VOLUME_READ_WRITE: "true"}, ["goes only with sandbox", "remove readWrite"]),
        ({VOLUME_SANDBOX: "run-42", VOLUME_READ_WRITE: "yes"}, ['"yes"', 'write "true" or "false"']),
        ({VOLUME_KEEP: "onfailure"}, ['"onfailure"', "Always, OnFailure, Never"]),
        ({VOLUME_NAME: "Run_42"}, ['"Run_42"', "Kubernetes name", "e.g. run-42"]),
        ({VOLUME_NAME: "r" * 64}, ["at most 63 characters"]),
        ({VOLUME_SANDBOX: "../run-42"}, ['"../run-42"', "a retained sandbox of this namespace"]),
        ({VOLUME_RETENTION: "3 days"}, ['"3 days"', "90m, 72h, 3d, 2w"]),
        ({VOLUME_RETENTION: "9999999w"}, ["too large"]),
        ({VOLUME_SANDBOX: "run-42", VOLUME_KEEP: "Always"}, ["keeps nothing new", "remove keep"]),
        ({VOLUME_SANDBOX: "run-42", VOLUME_NAME: "x", VOLUME_RETENTION: "1d"}, ["name and retention cannot go"]),
        ({VOLUME_NAME: "r" * (MAX_BYTES + 1)}, [f"is {MAX_BYTES + 1} bytes long; at most {MAX_BYTES}"]),
        ({f"k{i}": "v" for i in range(MAX_ATTRIBUTES)}, [f"at most {MAX_ATTRIBUTES} are accepted"]),
        ({POD_INFO_NAMESPACE: "Team A"}, [POD_INFO_NAMESPACE, "not a Kubernetes name"]),
    ],
)
def test_what_a_user_wrote_wrong_is_refused_saying_what_to_write(attributes: dict[str, str], words: list[str]) -> None:
    err = refusal(attributes=attributes)
    assert err.code == INVALID_ARGUMENT
    for word in words:
        assert word in err.message, err.message


def test_a_refusal_quotes_a_value_cut_short_and_escaped() -> None:
    err = refusal(attributes={VOLUME_KEEP: "x" * 200 + '"\n'})
    assert "x" * 61 + "..." in err.message and "x" * 62 not in err.message
    assert "\n" not in err.message


def test_an_unpublish_needs_only_its_two_fields() -> None:
    assert parse_unpublish(VOLUME_ID, "/anywhere/the/kubelet/said") == (VOLUME_ID, "/anywhere/the/kubelet/said")
    for volume_id, target in [("", TARGET), (VOLUME_ID, ""), ("a/b", TARGET), (VOLUME_ID, "/a\0b")]:
        with pytest.raises(VolumeError) as caught:
            parse_unpublish(volume_id, target)
        assert caught.value.code == INVALID_ARGUMENT


# --- properties -------------------------------------------------------------------------------------------------

_KEYS = [VOLUME_KEEP, VOLUME_NAME, VOLUME_RETENTION, VOLUME_SANDBOX, *POD]
_near_values = st.sampled_from(
    ["", "true", "Always", "OnFailure", "Never", "run-42", "3d", "0", UID, "team-a", "..", "a/b", "x" * 300]
)
_values = st.one_of(_near_values, st.text(max_size=80))
_segments = st.one_of(
    st.sampled_from(["", ".", "..", "pods", UID, "volumes", "kubernetes.io~csi", "workspace", "mount", "var"]),
    st.text(max_size=12),
)


@st.composite
def _targets(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(st.text(max_size=120))
    parts = [*KUBELET.strip("/").split("/"), "pods", UID, "volumes", "kubernetes.io~csi", "workspace", "mount"]
    for _ in range(draw(st.integers(0, 3))):  # replace, insert or drop a few components
        i = draw(st.integers(0, len(parts)))
        op = draw(st.sampled_from(["replace", "insert", "drop"]))
        if op == "insert" or i == len(parts):
            parts.insert(i, draw(_segments))
        elif op == "replace":
            parts[i] = draw(_segments)
        else:
            del parts[i]
    return draw(st.sampled_from(["/", ""])) + "/".join(parts)


_capabilities = st.one_of(
    st.none(),
    st.builds(
        Capability,
        st.sampled_from(["mount", "block", None, "other"]),
        st.one_of(
            st.sampled_from(["SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY", "MULTI_NODE_READER_ONLY"]), st.text()
        ),
        st.one_of(st.sampled_from(["", "0", "2000", "4294967296", "-1"]), st.text(max_size=12)),
    ),
)


@given(
    volume_id=st.one_of(st.just(VOLUME_ID), st.text(max_size=300)),
    target=_targets(),
    capability=_capabilities,
    readonly=st.booleans(),
    changed=st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=300)), _values, max_size=20),
    dropped=st.sets(st.sampled_from(list(POD))),
)
def test_no_publish_raises_anything_but_a_refusal(
    volume_id: str,
    target: str,
    capability: Capability | None,
    readonly: bool,
    changed: dict[str, str],
    dropped: set[str],
) -> None:
    attributes = {k: v for k, v in {**POD, **changed}.items() if k not in dropped}
    try:
        req = parse_publish(volume_id, target, capability, readonly, attributes, KUBELET)
    except VolumeError as err:
        assert err.code in (INVALID_ARGUMENT, FAILED_PRECONDITION)
        assert err.message and len(err.message) < 1000
        return
    # What is accepted names this Pod's own volume directory and Kubernetes names, never a way out of a root.
    assert req.target_path.startswith(f"{KUBELET}/pods/{req.pod_uid}/volumes/kubernetes.io~csi/")
    assert req.target_path.endswith("/mount") and "/../" not in req.target_path + "/"
    for name in (req.pod_namespace, req.pod_name, req.name, req.sandbox):
        assert name is None or ("/" not in name and not name.startswith("."))
    assert req.sandbox is None or (req.name, req.retention) == (None, None)
