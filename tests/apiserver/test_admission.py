"""The chart's pin admission policy (templates/pin-admission.yaml) on the real API server (issue 12, item 8).

A pin that does not parse, or one added to a sandbox already being deleted, used to be accepted by
`kubectl annotate` and then ignored. The policy refuses both at annotate time, with a message that says
what to write instead; removing a pin is always allowed, and the components' own writes are never refused.
The refusals are checked word for word through the real `kubectl annotate`; a generated test compares the
API server's verdict on thousands of texts with controller/rules/durations.py's, which the controller applies.

The policy is bound to this module's namespace alone (chart value `admission.namespaceSelector`): the
cluster is shared with tests that write malformed pins on purpose to see the controller's own checks.
"""

from __future__ import annotations

import json
import secrets
import string
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.api.kube import Kube, KubeError, sandbox_path
from controller.rules import contracts as c
from controller.rules.durations import MAX_DURATION, Invalid, parse_duration, parse_instant
from hack.localcluster import LocalCluster
from tests.bed.controller_harness import install_crds, kube_for, only_in, render_templates, wait_for

RELEASE = "pins"
POLICY = f"{RELEASE}-sandkeep-pins"
DENIED = f"ValidatingAdmissionPolicy '{POLICY}' with binding '{POLICY}' denied request"
RELEASE_NAMESPACE = "sandkeep"  # where the chart's ServiceAccounts would live; the exemption names them
PARSERS = {c.ANN_PIN_FOR: parse_duration, c.ANN_PIN_UNTIL: parse_instant}
COMPONENTS = {
    "controller": f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}-sandkeep-controller",
    "agent": f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}-sandkeep-agent",
}


@dataclass
class Pins:
    """The chart's pin policy bound to `namespace`, with the ways a person (or a component) writes a pin."""

    cluster: LocalCluster
    kube: Kube
    namespace: str

    def create(self, name: str, annotations: dict[str, str] | None = None, *, finalizer: bool = False) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "annotations": annotations or {}}
        if finalizer:
            meta["finalizers"] = [c.FINALIZER]
        body = {"apiVersion": c.API_VERSION, "kind": c.SANDBOX_KIND, "metadata": meta}
        body["spec"] = {"nodeName": "node-a", "createdAt": "2026-01-01T00:00:00Z"}
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(body))

    def annotate(self, name: str, *args: str, as_user: str | None = None) -> subprocess.CompletedProcess[str]:
        """The real `kubectl annotate`, as admin (or impersonating `as_user` with every right)."""
        who = [] if as_user is None else [f"--as={as_user}", "--as-group=system:masters"]
        return self.cluster.kubectl("annotate", c.SANDBOX_SHORT, name, "-n", self.namespace, *who, *args, check=False)

    def annotations(self, name: str) -> dict[str, str]:
        obj = self.kube.get_sandbox(self.namespace, name) or {}
        annotations: dict[str, str] = obj.get("metadata", {}).get("annotations") or {}
        return annotations

    def refusal(self, key: str, value: str, status: int = 422) -> str | None:
        """The API server's verdict on setting `key` to `value` on `probe` (a dry run): None, or its words
        (`status`: 422 for a malformed pin, 403 for a write that is not a person's to make)."""
        patch = {"metadata": {"annotations": {key: value}}}
        try:
            self.kube.request(
                "PATCH",
                sandbox_path(self.namespace, "probe"),
                body=patch,
                query={"dryRun": "All"},
                content_type="application/merge-patch+json",
            )
        except KubeError as err:
            assert err.status == status and DENIED in err.message, f"not the policy's refusal: {err}"
            return err.message
        return None

    def invalid(self, name: str, key: str, value: str, why: str) -> str:
        """kubectl's words for a refused malformed pin (`why` may name `{fix}`: how to pin for 72h instead)."""
        refused = f"{key} {json.dumps(value, ensure_ascii=False)} refused: {why.format(fix=self.fix(name))}"
        return f'The {c.SANDBOX_PLURAL} "{name}" is invalid: : {DENIED}: {self.sandbox(name)}: {refused}\n'

    def release(self, name: str) -> None:
        """Drop the disk finalizer (no agent runs here), so a deleted sandbox goes."""
        patch = ("--type=merge", "-p", '{"metadata":{"finalizers":null}}')
        self.cluster.kubectl("patch", c.SANDBOX_SHORT, name, "-n", self.namespace, *patch)

    def sandbox(self, name: str) -> str:
        return f"RetainedSandbox {self.namespace}/{name}"

    def fix(self, name: str) -> str:
        return f"kubectl annotate rsb {name} -n {self.namespace} --overwrite {c.ANN_PIN_FOR}=72h"


@pytest.fixture(scope="module")
def pins(cluster: LocalCluster) -> Iterator[Pins]:
    install_crds(cluster)
    namespace = f"t-pins-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    policy = render_templates(RELEASE, RELEASE_NAMESPACE, ("pin-admission.yaml",), only_in(namespace))
    cluster.apply(policy)
    kube = kube_for(cluster)
    bed = Pins(cluster, kube, namespace)
    try:
        bed.create("probe")
        wait_for("the pin policy to take effect", lambda: bed.refusal(c.ANN_PIN_FOR, "forever"), timeout=30)
        yield bed
    finally:
        for doc in policy:
            cluster.kubectl("delete", doc["kind"], doc["metadata"]["name"], "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        kube.close()


# --- malformed pins are refused at annotate time, word for word -----------------------------------------------
NOT_A_DURATION = "not a duration; use a number with a unit: 90m, 72h, 3d, 2w (or 1h30m), e.g. {fix}"
TOO_LARGE = f"too large; at most {MAX_DURATION.days}d (and any pin is capped at maxPin)"
NOT_RFC3339 = "not an RFC 3339 time with a zone, e.g. 2026-12-01T10:00:00Z; or pin for a while: {fix}"
NOT_REAL = "not a real date or time (check the day of the month; hours run 00-23, minutes and seconds 00-59)"
OUT_OF_RANGE = "out of range; sandkeep takes times from 1970 to 9000 (a typo in the year?)"


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        (c.ANN_PIN_FOR, "forever", NOT_A_DURATION),
        (c.ANN_PIN_FOR, "3d2w", NOT_A_DURATION),  # units largest first, as durations.py reads them
        (c.ANN_PIN_FOR, "\uff13h", NOT_A_DURATION),  # a full-width digit: int() reads it, the CRD does not
        (c.ANN_PIN_FOR, "-1h", NOT_A_DURATION),
        (c.ANN_PIN_FOR, "", NOT_A_DURATION),
        (c.ANN_PIN_FOR, f"{MAX_DURATION.days + 1}d", TOO_LARGE),
        (c.ANN_PIN_FOR, "999999999w", TOO_LARGE),
        (c.ANN_PIN_UNTIL, "next-tuesday", NOT_RFC3339),
        (c.ANN_PIN_UNTIL, "2026-12-01T10:00:00", NOT_RFC3339),  # no zone: whose 10 o'clock?
        (c.ANN_PIN_UNTIL, "2026-12-01T10:00:00+00:99", NOT_RFC3339),
        (c.ANN_PIN_UNTIL, "2026-02-30T10:00:00Z", NOT_REAL),
        (c.ANN_PIN_UNTIL, "2026-12-01T24:00:00Z", NOT_REAL),
        (c.ANN_PIN_UNTIL, "0001-01-01T00:00:00+01:00", OUT_OF_RANGE),  # before year 1 in UTC
        (c.ANN_PIN_UNTIL, "9999-12-31T23:00:00Z", OUT_OF_RANGE),
    ],
)
def test_a_pin_sandkeep_cannot_read_is_refused_at_annotate_time_saying_what_to_write(
    pins: Pins, key: str, value: str, why: str
) -> None:
    name = f"typo-{secrets.token_hex(3)}"
    pins.create(name)
    result = pins.annotate(name, f"{key}={value}")
    assert result.returncode != 0
    assert result.stderr == pins.invalid(name, key, value, why)
    assert key not in pins.annotations(name)
    _same_verdict(pins, key, value)  # and durations.py says the same of the same text


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (c.ANN_PIN_FOR, "72h"),
        (c.ANN_PIN_FOR, " 1h30m "),
        (c.ANN_PIN_FOR, "2W"),
        (c.ANN_PIN_FOR, "0"),  # accepted, and reported as having no effect (a pin only extends)
        (c.ANN_PIN_FOR, f"{MAX_DURATION.days}d"),
        (c.ANN_PIN_UNTIL, "2026-12-01T10:00:00Z"),
        (c.ANN_PIN_UNTIL, "2026-12-01t10:00:00.123456789z"),
        (c.ANN_PIN_UNTIL, "2026-12-01 10:00:00+23:59"),
        (c.ANN_PIN_UNTIL, "1970-01-01T00:00:00Z"),
        (c.ANN_PIN_UNTIL, "9000-01-01T00:00:00Z"),
    ],
)
def test_a_pin_sandkeep_reads_is_accepted_and_can_be_removed(pins: Pins, key: str, value: str) -> None:
    name = f"ok-{secrets.token_hex(3)}"
    pins.create(name)
    result = pins.annotate(name, f"{key}={value}")
    assert result.returncode == 0, result.stderr
    assert pins.annotations(name)[key] == value
    assert pins.annotate(name, f"{key}-").returncode == 0
    assert key not in pins.annotations(name)


def test_only_the_pin_a_request_changes_is_judged(pins: Pins) -> None:
    # A malformed pin already on an object (copied from a manifest by the agent, or older than the policy)
    # does not block other edits, and can be removed; changing it to another malformed value is refused.
    name = f"carried-{secrets.token_hex(3)}"
    pins.create(name)
    assert pins.annotate(name, f"{c.ANN_PIN_UNTIL}=next-tuesday", as_user=COMPONENTS["agent"]).returncode == 0
    assert pins.annotate(name, "team=ci").returncode == 0
    assert pins.annotate(name, f"{c.ANN_PIN_FOR}=72h").returncode == 0
    refused = pins.annotate(name, f"{c.ANN_PIN_UNTIL}=next-wednesday", "--overwrite")
    assert refused.stderr == pins.invalid(name, c.ANN_PIN_UNTIL, "next-wednesday", NOT_RFC3339)
    assert pins.annotations(name)[c.ANN_PIN_UNTIL] == "next-tuesday"
    assert pins.annotate(name, f"{c.ANN_PIN_UNTIL}-").returncode == 0


# --- a sandbox being deleted takes no new pin -------------------------------------------------------------
def test_a_pin_on_a_sandbox_being_deleted_is_refused_and_removing_one_is_allowed(pins: Pins) -> None:
    # The issue-12 lie: `kubectl annotate ... pin-for=72h` on a Terminating sandbox said "annotated", and
    # the directory was deleted anyway once its holder exited. Now it says no, and why.
    name = f"going-{secrets.token_hex(3)}"
    pins.create(name, {c.ANN_PIN_UNTIL: "2026-12-01T10:00:00Z"}, finalizer=True)
    pins.cluster.kubectl("delete", c.SANDBOX_SHORT, name, "-n", pins.namespace, "--wait=false")
    since = pins.kube.get_sandbox(pins.namespace, name)["metadata"]["deletionTimestamp"]  # type: ignore[index]

    def forbidden(what: str) -> str:
        return (
            f'Error from server (Forbidden): {c.SANDBOX_PLURAL}.{c.GROUP} "{name}" is forbidden: {DENIED}: '
            f"{pins.sandbox(name)} is being deleted (since {since}), so a pin can no longer keep it: {what} refused. "
            "Its directory on node node-a is removed as soon as nothing uses it: copy out what you still need now "
            "(removing a pin is still allowed)\n"
        )

    try:
        assert pins.annotate(name, f"{c.ANN_PIN_FOR}=72h").stderr == forbidden(c.ANN_PIN_FOR)
        assert pins.annotate(name, f"{c.ANN_PIN_UNTIL}=2027-01-01T00:00:00Z", "--overwrite").stderr == forbidden(
            c.ANN_PIN_UNTIL
        )
        both = pins.annotate(name, f"{c.ANN_PIN_UNTIL}=2027-01-01T00:00:00Z", f"{c.ANN_PIN_FOR}=3d", "--overwrite")
        assert both.stderr == forbidden(f"{c.ANN_PIN_UNTIL} and {c.ANN_PIN_FOR}")
        assert pins.annotate(name, "note=copied-out").returncode == 0, "other annotations are not pins"
        assert pins.annotations(name)[c.ANN_PIN_UNTIL] == "2026-12-01T10:00:00Z"
        removed = pins.annotate(name, f"{c.ANN_PIN_UNTIL}-")
        assert removed.returncode == 0, removed.stderr
        assert c.ANN_PIN_UNTIL not in pins.annotations(name)
    finally:
        pins.release(name)


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_the_components_own_writes_are_never_refused(pins: Pins, component: str) -> None:
    # The controller settles pin-for into pin-until, the agent copies a manifest's pin (whatever it holds)
    # into the object it adopts: neither is a person's annotation, and refusing them would wedge the pass.
    user = COMPONENTS[component]
    name = f"{component}-{secrets.token_hex(3)}"
    pins.create(name, finalizer=True)
    try:
        assert pins.annotate(name, f"{c.ANN_PIN_UNTIL}=next-tuesday", as_user=user).returncode == 0
        pins.cluster.kubectl("delete", c.SANDBOX_SHORT, name, "-n", pins.namespace, "--wait=false")
        written = pins.annotate(name, f"{c.ANN_PIN_UNTIL}=2027-01-01T00:00:00Z", "--overwrite", as_user=user)
        assert written.returncode == 0, written.stderr
        assert pins.annotate(name, f"{c.ANN_PIN_UNTIL}=2028-01-01T00:00:00Z", "--overwrite").returncode != 0
    finally:
        pins.release(name)


# --- sandkeep's own bookkeeping is written by sandkeep alone ----------------------------------------------------
BOOKKEEPING = (c.ANN_PINNED_AT,)


def bookkeeping_refused(pins: Pins, name: str, keys: str) -> str:
    return (
        f'Error from server (Forbidden): {c.SANDBOX_PLURAL}.{c.GROUP} "{name}" is forbidden: {DENIED}: '
        f"{pins.sandbox(name)}: {keys} refused: sandkeep writes its own bookkeeping (when it first saw a pin), "
        "people do not. To pin, "
        f"write {pins.fix(name)} (or {c.ANN_PIN_UNTIL}=<RFC 3339 time>)\n"
    )


@pytest.mark.parametrize("key", BOOKKEEPING)
def test_a_person_writing_sandkeeps_bookkeeping_is_refused_and_removing_it_is_allowed(pins: Pins, key: str) -> None:
    # Issue 25: a pinned-at written in the future (or as garbage) made the maxPin cap slide with now. Adding or
    # changing it is refused, word for word; the component that owns it may; removing it changes nothing the
    # rule reads (the controller's status.pinSeen is what the cap counts from), so it stays allowed.
    name = f"books-{secrets.token_hex(3)}"
    pins.create(name)
    added = pins.annotate(name, f"{key}=2099-01-01T00:00:00Z")
    assert added.stderr == bookkeeping_refused(pins, name, key)
    assert pins.annotate(name, f"{key}=2026-01-01T00:00:00Z", as_user=COMPONENTS["controller"]).returncode == 0
    changed = pins.annotate(name, f"{key}=garbage", "--overwrite")
    assert changed.stderr == bookkeeping_refused(pins, name, key)
    assert pins.annotations(name)[key] == "2026-01-01T00:00:00Z"
    assert pins.annotate(name, "team=ci").returncode == 0, "an object carrying it takes other edits"
    removed = pins.annotate(name, f"{key}-")
    assert removed.returncode == 0, removed.stderr
    assert key not in pins.annotations(name)


def test_a_sandbox_created_with_bookkeeping_by_a_person_is_refused(pins: Pins) -> None:
    name = f"forged-{secrets.token_hex(3)}"
    body = {
        "apiVersion": c.API_VERSION,
        "kind": c.SANDBOX_KIND,
        "metadata": {"name": name, "namespace": pins.namespace, "annotations": dict.fromkeys(BOOKKEEPING, "x")},
        "spec": {"nodeName": "node-a", "createdAt": "2026-01-01T00:00:00Z"},
    }
    created = pins.cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)
    assert created.returncode != 0
    assert f"{c.ANN_PINNED_AT} refused: sandkeep writes its own bookkeeping" in created.stderr
    assert pins.kube.get_sandbox(pins.namespace, name) is None


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(max_size=80))
def test_no_value_of_pinned_at_gets_past_the_policy(pins: Pins, value: str) -> None:
    assert pins.refusal(c.ANN_PINNED_AT, value, status=403) is not None


# --- the policy accepts exactly what durations.py accepts -----------------------------------------------------
# Texts near the grammar: every unit in both cases, amounts at the bounds, non-ASCII digits and letters that
# fold to units in Unicode (U+017F folds to s, U+212A to k), whitespace durations.py strips and some it keeps.
_SPACE = st.text(alphabet=" \t\r\n\v\x0c\xa0\u2003\u0085", max_size=2)
_NOISE = st.text(alphabet=string.digits + "wdhmsWDHMS0.:+-TtZz \uff13\u0663\u017f\u212a", max_size=8)
_AMOUNT = st.one_of(
    st.integers(0, 99),
    st.sampled_from([36500, 36501, 52143, 876000, 876001, 52560000, 52560001, 3153600000, 3153600001]),
    st.integers(0, 10**12),
).flatmap(lambda n: st.sampled_from([str(n), str(n).zfill(9), str(n).zfill(10)]))
_DURATIONS = st.one_of(
    st.lists(st.tuples(_AMOUNT, st.sampled_from("wdhmsWDHMS")), max_size=5).map(
        lambda parts: "".join(amount + unit for amount, unit in parts)
    ),
    _NOISE,
)


def _two(low: int, high: int) -> st.SearchStrategy[str]:
    return st.integers(low, high).map(lambda n: f"{n:02d}")


_YEAR = st.one_of(st.sampled_from([0, 1, 1969, 1970, 2026, 8999, 9000, 9001, 9999]), st.integers(0, 9999))
_ZONE = st.one_of(
    st.sampled_from(["Z", "z", "", "+00:00", "-00:00", "+23:59", "-23:59", "+24:00", "+00:60"]),
    st.tuples(st.sampled_from("+-"), _two(0, 99), _two(0, 99)).map(lambda t: f"{t[0]}{t[1]}:{t[2]}"),
)
_FRACTION = st.one_of(
    st.just(""), st.sampled_from([".5", ".000000999", ".0000009991", ".9999999"]), st.from_regex(r"\A\.[0-9]{1,11}\Z")
)
_INSTANTS = st.one_of(
    st.tuples(
        _YEAR.map(lambda y: f"{y:04d}"),
        _two(0, 13),
        _two(0, 32),
        st.sampled_from("TTt _"),
        _two(0, 25),
        _two(0, 61),
        _two(0, 61),
        _FRACTION,
        _ZONE,
    ).map(lambda p: f"{p[0]}-{p[1]}-{p[2]}{p[3]}{p[4]}:{p[5]}:{p[6]}{p[7]}{p[8]}"),
    st.sampled_from(  # the bounds, where offsets and Python's microseconds decide
        [
            "1969-12-31T23:00:00-01:00",
            "1969-12-31T23:59:59.9999999Z",
            "9000-01-01T01:00:00+01:00",
            "9000-01-01T00:00:00.0000009Z",
            "9000-01-01T00:00:00.000001Z",
        ]
    ),
    _NOISE,
)


def _padded(texts: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(_SPACE, texts, _SPACE).map("".join)


def _same_verdict(pins: Pins, key: str, text: str) -> None:
    parsed, refusal = PARSERS[key](text), pins.refusal(key, text)
    if isinstance(parsed, Invalid):  # refused in durations.py's words (up to its detail in parentheses)
        assert refusal is not None and f"refused: {parsed.why.split(' (')[0]}" in refusal, (text, parsed)
    else:
        assert refusal is None, (text, parsed, refusal)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_padded(_DURATIONS))
def test_the_policy_accepts_exactly_the_durations_sandkeep_parses(pins: Pins, text: str) -> None:
    _same_verdict(pins, c.ANN_PIN_FOR, text)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_padded(_INSTANTS))
def test_the_policy_accepts_exactly_the_instants_sandkeep_parses(pins: Pins, text: str) -> None:
    _same_verdict(pins, c.ANN_PIN_UNTIL, text)
