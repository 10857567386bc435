"""Names other systems depend on: the API group, annotation keys, the finalizer, reason codes, metric names.

Each is defined here once and imported everywhere else; the tests check the CRDs, the chart, the alert
rules, the dashboard and the docs against these values, so renaming one is a visible, deliberate change.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

# --- The API -------------------------------------------------------------------------------------------
GROUP = "sandkeep.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SANDBOX_KIND = "RetainedSandbox"
SANDBOX_PLURAL = "retainedsandboxes"
SANDBOX_SINGULAR = "retainedsandbox"
SANDBOX_SHORT = "rsb"
POLICY_KIND = "SandboxPolicy"
POLICY_PLURAL = "sandboxpolicies"
POLICY_SINGULAR = "sandboxpolicy"
POLICY_SHORT = "sbp"
SESSION_KIND = "SandboxSession"
SESSION_PLURAL = "sandboxsessions"
SESSION_SINGULAR = "sandboxsession"
SESSION_SHORT = "sbs"
CATEGORY = "sandkeep"

# --- Annotations, labels, finalizer, leases ------------------------------------------------------------
ANN_PIN_UNTIL = f"{GROUP}/pin-until"  # RFC 3339 instant; a valid one wins over every other deadline
ANN_PIN_FOR = f"{GROUP}/pin-for"  # a duration; the controller turns it into pin-until once and removes it
ANN_PINNED_AT = f"{GROUP}/pinned-at"  # when the pin was set: the reference the maxPin cap counts from

LABEL_NODE = f"{GROUP}/node"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "sandkeep"

FINALIZER = f"{GROUP}/disk"  # owned by the node agent alone; the controller never adds one

CONTROLLER_LEASE = "sandkeep-controller"
AGENT_LEASE_PREFIX = "sandkeep-agent-"  # + node name: the per-node heartbeat
ANN_ORPHAN_TOMBSTONES = f"{GROUP}/orphan-tombstones"  # on an agent's heartbeat Lease: JSON list, for doctor
ANN_PRESSURE = f"{GROUP}/pressure"  # on an agent's heartbeat Lease: JSON, the node's unrelieved disk pressure
ANN_QUARANTINE = f"{GROUP}/quarantine"  # on an agent's heartbeat Lease: JSON, the node's unadoptable entries

# A session's Pod (controller/cluster/sessions.py), in its sandbox's namespace: labels the controller selects its
# Pods by, and its one container and the path it mounts the sandbox at.
LABEL_SESSION_UID = f"{GROUP}/session-uid"  # the SandboxSession's uid
LABEL_SANDBOX_UID = f"{GROUP}/sandbox-uid"  # the RetainedSandbox's uid
ANN_SESSION = f"{GROUP}/session"  # on a session's Pod: `<namespace>/<name>` of the session
ANN_SANDBOX = f"{GROUP}/sandbox"  # on a session's Pod: `<namespace>/<name>` of the sandbox it mounts
SESSION_CONTAINER = "session"
SESSION_POD_PREFIX = "session-"  # a SandboxSession's Pod is named session-<the session's uid>
REOPEN_HOLDER = "pod {namespace}/{pod} (reopen volume)"  # a Pod's reopen volume among a sandbox's `heldBy`
SESSION_MOUNT = "/sandbox"  # where a session's container sees the sandbox's workspace


# What bounds sessions (issue 25): each a controller flag, the chart value `sessions.<value>` and its default.
class SessionBound(NamedTuple):
    flag: str
    value: str
    default: int


SESSIONS_MAX_PER_USER = SessionBound("--sessions-max-per-user", "maxPerUser", 3)  # live sessions of one user
SESSIONS_MAX_PER_NAMESPACE = SessionBound("--sessions-max-per-namespace", "maxPerNamespace", 20)  # ... in a namespace
SESSIONS_MIN_OWNER_ID = SessionBound("--sessions-min-owner-id", "minOwnerId", 1000)  # lower ids from disk: NOBODY
SESSIONS_ALLOWED_IMAGE = "--sessions-allowed-image"  # once per image of sessions.allowedImages (+ the default)
SESSIONS_RESOURCES = "--sessions-resources"  # JSON of sessions.resources: the session container's resources
SESSIONS_TOLERATIONS = "--sessions-tolerations"  # JSON of agent.tolerations: which taints a session may tolerate
SESSIONS_ADMISSION_POLICY = "--sessions-admission-policy"  # the ValidatingAdmissionPolicy its binding must bind
NOBODY = 65534  # the uid and gid of `nobody`
SESSION_USER_CHECK = "object.spec.user == request.userInfo.username"  # the sessions policy's proof of spec.user

# --- The CSI driver (issue 27): a Pod keeps or reopens a workspace by declaring an inline volume -------------
CSI_DRIVER = f"csi.{GROUP}"  # the CSIDriver object's name, every Pod's `volumes[].csi.driver`, the plugin's name
# `volumes[].csi.volumeAttributes` keys a user writes
VOLUME_KEEP = "keep"  # Keep: when the workspace is kept as its Pod ends
VOLUME_NAME = "name"  # the kept sandbox's name (bounded, made unique per Pod when absent)
VOLUME_RETENTION = "retention"  # a duration: the kept sandbox's retention (capped by its policy, as retain's)
VOLUME_SANDBOX = "sandbox"  # reopen: the name of a retained sandbox of the Pod's own namespace
VOLUME_READ_WRITE = "readWrite"  # reopen: "true" mounts it read-write; read-only otherwise (and with csi.readOnly)
# what the kubelet adds to them (podInfoOnMount, inline ephemeral volumes); names are the kubelet's
POD_INFO_NAME = "csi.storage.k8s.io/pod.name"
POD_INFO_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_INFO_UID = "csi.storage.k8s.io/pod.uid"
POD_INFO_SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
POD_INFO_EPHEMERAL = "csi.storage.k8s.io/ephemeral"


class Keep(StrEnum):
    """`volumeAttributes.keep`: which ends of a Pod keep its workspace."""

    ALWAYS = "Always"  # the default: nothing a Pod wrote is lost unless it said so
    ON_FAILURE = "OnFailure"
    NEVER = "Never"


class Outcome(StrEnum):
    """How the job a workspace belonged to ended, as read from the API; Unknown when it could not be read."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"  # fail closed: kept, whatever `keep` says short of Never


# Retention by outcome (issue 28): the SandboxPolicy field (`spec.retentionByOutcome.<outcome in lower case>`),
# the chart's `settings.retentionByOutcome.<same>` and the cluster default `SANDKEEP_RETENTION_<OUTCOME>`.
RETENTION_BY_OUTCOME = "retentionByOutcome"
# The hard end (issue 28): the SandboxPolicy field `spec.maxAge`, the chart's `settings.maxAge` (SANDKEEP_MAX_AGE,
# the default of every namespace and the ceiling of every policy's).
MAX_AGE = "maxAge"
# History limits (issue 28): the SandboxPolicy field `spec.historyLimits`; its `groupBy` is one of ORIGIN_LABELS or
# GROUP_BY_OWNER (the Pod's controlling owner, `spec.origin.owner`, as `Kind/name`).
HISTORY_LIMITS = "historyLimits"
WARN_BEFORE = "warnBefore"  # a SandboxPolicy's: this long before a deadline, condition and Event ExpiringSoon
# A SandboxPolicy's `spec.warnWebhook.url` (http or https): one JSON notice per sandbox at its ExpiringSoon.
WARN_WEBHOOK = "warnWebhook"
WARN_NOTICE_KIND = "ExpiringSoon"  # the notice's `kind`; its fields are documented in docs/usage.md
GROUP_BY_OWNER = "owner"
# The CronJob that made a sandbox's Job, as `CronJob/name`: read from the Job's name, `<cronjob>-<minute>` (the
# CronJob controller's: its scheduled time in minutes since the epoch, at most CRONJOB_RUN_MAX_DAYS before createdAt).
GROUP_BY_CRONJOB = "cronjob"
CRONJOB_RUN_MAX_DAYS = 31
OUTCOME_FLAG = "--outcome"  # `sandkeep retain --outcome`: the outcome a retained job records in its manifest


# The labels of a captured workspace's Pod copied to its sandbox's `spec.origin.labels`: the pipelines that name
# the run (a Job's Pods, a Tekton TaskRun's and PipelineRun's, an Argo Workflow's). Only these, so it stays bounded.
# The Pod labels a capture records (`spec.origin.labels`) and history limits may group by: a run's own (job-name,
# taskRun, pipelineRun, workflow) and, for Tekton, what stays the same across runs (its Pipeline and Task).
ORIGIN_LABELS = (
    "job-name",
    "tekton.dev/taskRun",
    "tekton.dev/pipelineRun",
    "workflows.argoproj.io/workflow",
    "tekton.dev/pipeline",
    "tekton.dev/task",
)
GROUP_BYS = (GROUP_BY_OWNER, GROUP_BY_CRONJOB, *ORIGIN_LABELS)  # what historyLimits.groupBy may name (the CRD's enum)
ORIGIN_CONTAINERS_MAX = 16  # containers listed in `spec.origin.containers` (the CRD's maxItems)


# --- On disk -------------------------------------------------------------------------------------------
MANIFEST_NAME = "manifest.json"
WORKSPACE_DIR = "workspace"
COMMANDS_DIR = ".commands"
LOCK_NAME = ".sandkeep.lock"
TOMBSTONE_PREFIX = ".reap-"
QUARANTINE_FILE = ".sandkeep-quarantine.json"  # the agent's own record of how long it has watched each entry
VOLUMES_DIR = ".sandkeep-volumes"  # the root's own (0700): one entry per captured volume while its Pod runs


class Phase(StrEnum):
    """`status.phase` of a RetainedSandbox (the CRD's enum is generated from this)."""

    RETAINED = "Retained"
    PINNED = "Pinned"
    OPEN = "Open"  # a SandboxSession's Pod has it mounted, verified by the agent, before its deadline
    HELD = "Held"
    EXPIRED = "Expired"
    DELETING = "Deleting"
    STUCK = "Stuck"
    LOST = "Lost"


class SessionPhase(StrEnum):
    """`status.phase` of a SandboxSession."""

    PENDING = "Pending"  # accepted; its Pod is being started, or started and its container not yet ready
    RUNNING = "Running"  # its Pod runs on the sandbox's node, its container ready with the sandbox mounted
    REFUSED = "Refused"  # never started: the reason says why (expired, being deleted, ...)
    ENDED = "Ended"  # started, then ended: lifetime over, or the Pod ended


class MountCheck(StrEnum):
    """`status.sessions[].mount` of a RetainedSandbox: what a node agent found a session's Pod mounted. Deprecated:
    agents no longer write `status.sessions` and the controller no longer reads it (a session's Pod now mounts the
    sandbox through the CSI driver, and its reopen volume among `heldBy` opens it: `objects.observed_of`); kept in
    the CRD so objects written before stay valid."""

    VERIFIED = "Verified"  # the container's /sandbox is the sandbox's workspace (same device and inode)
    MISMATCH = "Mismatch"  # it is some other directory: the session is ended, nothing is granted
    UNKNOWN = "Unknown"  # the container's processes could not be read yet: checked again


class ReleasePriority(StrEnum):
    """A SandboxPolicy's `releasePriority`: when its namespace's sandboxes go, as a node releases for space."""

    FIRST = "First"
    NORMAL = "Normal"
    LAST = "Last"


class DeadlineSource(StrEnum):
    """Which input decided a sandbox's deadline."""

    PIN = "pin"
    RETAIN = "retain"
    WINDOW = "window"
    HISTORY = "history"  # one of its group's newest failures (historyLimits.keepLastFailed): no window ends it
    MAX_AGE = "maxAge"  # the hard end, createdAt + maxAge: nothing but a live user keeps it past that
    NONE = "none"  # no usable createdAt: expired


class Condition(StrEnum):
    """`status.conditions[].type` of a RetainedSandbox; each type has exactly one writer (its field manager)."""

    # written by the controller
    EXPIRED = "Expired"
    PINNED = "Pinned"
    PIN_VALID = "PinValid"
    POLICY_CEILING = "PolicyCeiling"
    DRY_RUN = "DryRun"
    LOST = "Lost"
    EXPIRING_SOON = "ExpiringSoon"  # within its policy's warnBefore of its deadline (issue 28, item 3)
    # written by the node agent
    DISK_PRESENT = "DiskPresent"
    IN_USE = "InUse"
    TOMBSTONE_STUCK = "TombstoneStuck"
    ORPHANS_SURVIVED = "OrphansSurvived"
    SIZE_PARTIAL = "SizePartial"  # sizeBytes is what was counted before the walk stopped (issue 25, item 8)


class PolicyCondition(StrEnum):
    """`status.conditions[].type` of a SandboxPolicy, written by the controller."""

    ACTIVE = "Active"  # True for the one policy that applies in its namespace (the oldest), False for the rest


class Reason(StrEnum):
    """Stable reason codes: the same string in logs, Events, status conditions and metric labels.

    CamelCase because Kubernetes condition reasons must match `^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`.
    One grep for a code finds every place a decision of that family was taken.
    """

    # decisions of the one rule
    RETAINED = "Retained"
    PINNED = "Pinned"
    UNPINNED = "Unpinned"
    PIN_CAPPED = "PinCapped"
    PIN_EXPIRED = "PinExpired"
    INVALID_PIN = "InvalidPin"
    PIN_NO_EFFECT = "PinNoEffect"  # a pin not later than the deadline without it (pin-for=0, a past year): ignored
    WINDOW = "Window"
    RETAIN_UNTIL = "RetainUntil"
    NO_CREATED_AT = "NoCreatedAt"
    HISTORY_LIMIT = "HistoryLimit"  # older than the newest N of its group and outcome (historyLimits): released
    KEPT_LAST_FAILED = "KeptLastFailed"  # one of its group's newest failures (keepLastFailed): kept past its window
    EXPIRING_SOON = "ExpiringSoon"  # its deadline is within its policy's warnBefore: an Event and a condition, once
    MAX_AGE = "MaxAge"  # past its hard end (createdAt + maxAge): no pin, session or window keeps it (issue 28)
    EXPIRED = "Expired"
    DELETE_REQUESTED = "DeleteRequested"
    WOULD_DELETE = "WouldDelete"
    CONFLICT = "Conflict"
    HELD = "Held"
    LOST = "Lost"
    NODE_GONE = "NodeGone"
    POLICY_CEILING = "PolicyCeiling"
    # what disk reads can say
    MANIFEST_UNREAD = "ManifestUnread"  # transient: EMFILE, EIO, ... held this pass
    MANIFEST_UNPARSED = "ManifestUnparsed"
    MANIFEST_UNREADABLE = "ManifestUnreadable"
    MANIFEST_ABSENT = "ManifestAbsent"
    MANIFEST_CHANGED = "ManifestChanged"
    MANIFEST_MISMATCH = "ManifestMismatch"  # names a namespace/name other than the path it sits under
    NOT_A_DIRECTORY = "NotADirectory"
    SYMLINK = "Symlink"
    BAD_NAME = "BadName"
    NAMESPACE_MISSING = "NamespaceMissing"
    PATH_OUTSIDE_ROOT = "PathOutsideRoot"
    ROOT_FOREIGN_OWNER = "RootForeignOwner"
    ROOT_LOCKED = "RootLocked"
    # the delete path
    TOMBSTONED = "Tombstoned"
    RESTORED = "Restored"
    DELETED = "Deleted"
    REPLACED = "Replaced"  # deleted through the pipeline to free its name for a retain of the same name
    CLUSTER_OWNED = "ClusterOwned"  # retained for a node: only its object's deletion deletes it (pins are in the API)
    RENAME_FAILED = "RenameFailed"
    DELETE_FAILED = "DeleteFailed"
    TOMBSTONE_STUCK = "TombstoneStuck"
    TOMBSTONE_LEFTOVER = "TombstoneLeftover"
    TOMBSTONE_FOREIGN = "TombstoneForeign"
    TOMBSTONE_PINNED = "TombstonePinned"
    CROSS_DEVICE = "CrossDevice"
    # processes
    IN_USE = "InUse"
    IN_USE_UNKNOWN = "InUseUnknown"
    POD_MOUNT = "PodMount"
    ORPHAN_REAPED = "OrphanReaped"
    ORPHAN_SURVIVOR = "OrphanSurvivor"
    ORPHAN_UNPROVEN = "OrphanUnproven"  # a recorded live process not proven the command's inside it: never signalled
    ORPHAN_RECORDS_UNTRUSTED = "OrphanRecordsUntrusted"  # `.commands` or a record another account could have written
    ORPHAN_RECORDS_OVER_LIMIT = "OrphanRecordsOverLimit"  # more or longer records than a recorder writes: not read
    # agent bookkeeping
    ADOPTED = "Adopted"
    AGENT_STALE = "AgentStale"
    # controller bookkeeping (issue 4)
    INVALID_POLICY = "InvalidPolicy"  # a SandboxPolicy field that does not parse: the default applies
    FINALIZER_REMOVED = "FinalizerRemoved"  # the node is gone, so the disk finalizer can never be honoured
    AGENT_ERROR = "AgentError"  # an agent step that raised: logged, retried on the next pass
    ADOPTION_FAILED = "AdoptionFailed"  # the API refused an adoption's create (not AlreadyExists)
    ORPHANS_PENDING = "OrphansPending"  # used only by recorded orphans: not in use, they are reaped before deletion
    # SandboxPolicy status (issue 16)
    IN_FORCE = "InForce"  # this policy applies to its namespace's sandboxes
    SUPERSEDED = "Superseded"  # an older policy in the same namespace applies; this one has no effect
    # releasing for space (issue 14)
    DISK_PRESSURE = "DiskPressure"  # released: the node's root was above its high watermark
    QUOTA_EXCEEDED = "QuotaExceeded"  # released: its namespace kept more than its SandboxPolicy's quota allows
    QUOTA_UNRELIEVED = "QuotaUnrelieved"  # over quota, and only pinned or held sandboxes are left
    PRESSURE_UNRELIEVED = "PressureUnrelieved"  # above high, and only pinned or held sandboxes are left
    # unadoptable entries (issue 12)
    QUARANTINED = "Quarantined"  # no object can own it (its cause says why): kept for the grace, then deleted
    QUARANTINE_EXPIRED = "QuarantineExpired"  # deleted: unadoptable for the whole of --quarantine-grace
    # sessions (issue 13): why a SandboxSession was refused or ended (with EXPIRED, LOST, TOMBSTONE_STUCK,
    # ORPHAN_SURVIVOR of the sandbox it names)
    SANDBOX_NOT_FOUND = "SandboxNotFound"  # no RetainedSandbox of that name in the session's namespace
    SANDBOX_DELETING = "SandboxDeleting"  # the sandbox is being deleted: a deletion is final
    SESSION_STARTING = "SessionStarting"  # its Pod is being created or started
    SESSION_RUNNING = "SessionRunning"  # its Pod runs, its container ready with the sandbox mounted
    LIFETIME_ENDED = "LifetimeEnded"  # the session's lifetime is over: its Pod is deleted
    POD_ENDED = "PodEnded"  # its Pod ended or was deleted
    IMAGE_PULL_FAILED = "ImagePullFailed"  # its Pod's image cannot be pulled (a typo? a private registry?)
    SESSIONS_UNGUARDED = "SessionsUnguarded"  # the admission policy that proves who asked is not installed
    BAD_SESSION = "BadSession"  # a field the controller cannot use (its lifetime, over the cap, ...)
    SESSION_LIMIT = "SessionLimit"  # its user, or its namespace, already has as many live sessions as allowed
    IMAGE_NOT_ALLOWED = "ImageNotAllowed"  # its image is not one of sessions.allowedImages
    POD_REFUSED = "PodRefused"  # the API server refused its Pod: the namespace's quota, LimitRange, Pod Security
    # measuring sizes (issue 25, item 8): why a sandbox's sizeBytes is a lower bound (condition SizePartial)
    SIZE_TOO_SLOW = "SizeTooSlow"  # the walk ran past --size-budget: the bytes counted until then
    SIZE_INTERRUPTED = "SizeInterrupted"  # the tree changed under the walk so it could not go on safely
    SIZE_UNREADABLE = "SizeUnreadable"  # a directory in it could not be opened or read: its contents not counted
    # the CSI node plugin (issue 27)
    VOLUME_REFUSED = "VolumeRefused"  # a publish or unpublish refused with the CSI status its message explains
    REGISTRATION_FAILED = "RegistrationFailed"  # the kubelet said it could not register the plugin: the registrar exits
    PLUGIN_UNREACHABLE = "PluginUnreachable"  # the registrar cannot reach the plugin's socket (or it is not ours) yet
    # capture (issue 27): what became of a Pod's workspace once its Pod ended (an Event on the Pod says why)
    WORKSPACE_KEPT = "WorkspaceKept"  # kept as a RetainedSandbox (by rename), with the Pod's outcome
    WORKSPACE_NOT_KEPT = "WorkspaceNotKept"  # deleted: its `keep` did not ask for this outcome
    CAPTURE_FAILED = "CaptureFailed"  # a keep or discard that did not happen this pass: retried next pass


# --- Metric names (exported names, as Prometheus sees them) ---------------------------------------------
# both components
M_BUILD_INFO = "sandkeep_build_info"  # gauge 1 {version, python}
# controller
M_SANDBOXES = "sandkeep_sandboxes"  # gauge {phase, node}
M_DELETIONS_REQUESTED = "sandkeep_deletions_requested_total"  # counter {reason}
M_EXPIRY_LAG = "sandkeep_expiry_lag_seconds"  # histogram: deadline -> delete request
M_RECONCILE_ERRORS = "sandkeep_reconcile_errors_total"  # counter {component}
M_PINS_ACTIVE = "sandkeep_pins_active"  # gauge
M_PAST_MAX_AGE = "sandkeep_sandboxes_past_max_age"  # gauge {namespace}: past their hard end, still there (held)
M_EVENTS_DROPPED = "sandkeep_events_dropped_total"  # counter: Events not posted because the backlog was full
M_WARN_NOTICES = "sandkeep_warn_notices_total"  # counter {result}: warnWebhook notices, by NoticeResult
M_QUOTA_UNRELIEVED = "sandkeep_quota_unrelieved"  # gauge {namespace}: 1 while over quota with nothing releasable
M_LEADER = "sandkeep_controller_leader"  # gauge 1 on the acting replica
# agent (every series carries {node})
M_AGENT_SANDBOXES = "sandkeep_agent_sandboxes"  # gauge {node, phase}
M_RETAINED_BYTES = "sandkeep_retained_bytes"  # gauge {node, phase}
M_TOMBSTONES = "sandkeep_tombstones"  # gauge {node}
M_TOMBSTONES_STUCK = "sandkeep_tombstones_stuck"  # gauge {node}
M_TOMBSTONE_STUCK_OLDEST = "sandkeep_tombstone_stuck_oldest_seconds"  # gauge {node}
M_DELETIONS = "sandkeep_deletions_total"  # counter {node, reason}
M_DELETION_FAILURES = "sandkeep_deletion_failures_total"  # counter {node, reason}
M_DELETION_DURATION = "sandkeep_deletion_duration_seconds"  # histogram {node}
M_SCAN_DURATION = "sandkeep_scan_duration_seconds"  # histogram {node}
M_INUSE_SCANS = "sandkeep_inuse_scans_total"  # counter {node}: passes over /proc answering "in use?"
M_IN_USE_HOLDS = "sandkeep_in_use_holds"  # gauge {node}
M_QUARANTINED = "sandkeep_quarantined_entries"  # gauge {node, reason}: unadoptable root entries, by cause
M_QUARANTINE_DELETIONS = "sandkeep_quarantine_deletions_total"  # counter {node, reason}: deleted after the grace
M_ROOT_SIZE = "sandkeep_root_filesystem_size_bytes"  # gauge {node}
M_ROOT_AVAIL = "sandkeep_root_filesystem_avail_bytes"  # gauge {node}
M_HEARTBEAT = "sandkeep_agent_heartbeat_timestamp_seconds"  # gauge {node}
M_PRESSURE_UNRELIEVED = "sandkeep_pressure_unrelieved"  # gauge {node}: 1 while above high with nothing releasable
M_PRESSURE_RELEASES = "sandkeep_pressure_releases_total"  # counter {node}: delete requests for disk pressure

# controller-runtime's series, under its exact names and labels (sigs.k8s.io/controller-runtime pkg/metrics and
# pkg/internal/controller/metrics), so the dashboards written for Go operators read sandkeep's too. A queue's
# `name` and `controller` labels are both its name (a `Queue`); the controller's reconciles carry it as `controller`.
M_RECONCILE_TOTAL = "controller_runtime_reconcile_total"  # counter {controller, result}
M_RECONCILE_TIME = "controller_runtime_reconcile_time_seconds"  # histogram {controller}
M_RECONCILE_ERRORS_TOTAL = "controller_runtime_reconcile_errors_total"  # counter {controller}: result error
M_WORKQUEUE_DEPTH = "workqueue_depth"  # gauge {name, controller, priority}: keys waiting
M_WORKQUEUE_ADDS = "workqueue_adds_total"  # counter {name, controller}
M_WORKQUEUE_QUEUE_DURATION = "workqueue_queue_duration_seconds"  # histogram {name, controller}: queued -> taken
M_WORKQUEUE_WORK_DURATION = "workqueue_work_duration_seconds"  # histogram {name, controller}: taken -> done
M_WORKQUEUE_RETRIES = "workqueue_retries_total"  # counter {name, controller}: every add_after, as client-go counts
M_WORKQUEUE_UNFINISHED = "workqueue_unfinished_work_seconds"  # gauge {name, controller}: work under way, summed
M_WORKQUEUE_LONGEST = "workqueue_longest_running_processor_seconds"  # gauge {name, controller}


class Queue(StrEnum):
    """The work queues, by name: the `name`/`controller` of the `workqueue_*` series, the `controller` of the
    reconcile series and the `component` of sandkeep_reconcile_errors_total."""

    CONTROLLER = "controller"  # the controller's RetainedSandboxes
    QUOTA = "quota"  # the controller's namespaces whose quota to check
    SESSIONS = "sessions"  # the controller's SandboxSessions
    AGENT = "agent"  # an agent's RetainedSandboxes of its node


class NoticeResult(StrEnum):
    """`sandkeep_warn_notices_total{result}`: what became of a warnWebhook notice (or of one attempt at it)."""

    SENT = "sent"  # the receiver answered 2xx
    RETRIED = "retried"  # an attempt failed (an error, a non-2xx answer, the timeout): tried again after a backoff
    FAILED = "failed"  # every attempt failed: given up
    DROPPED = "dropped"  # never tried: the backlog of unsent notices was full


class ReconcileResult(StrEnum):
    """`controller_runtime_reconcile_total{result}`, controller-runtime's values (sandkeep never says `requeue`:
    a reconcile asks for its key again at an instant, `requeue_after`)."""

    SUCCESS = "success"
    ERROR = "error"
    REQUEUE = "requeue"
    REQUEUE_AFTER = "requeue_after"
