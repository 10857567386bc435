"""A real local control plane: etcd, kube-apiserver and kube-controller-manager on loopback, from the pinned Go tools.

One implementation used by the tests (`tests/apiserver/conftest.py`), the demo (`hack/demo.py`) and
people (`make cluster`, which runs this module: `python -m hack.localcluster`). It starts etcd and
kube-apiserver on free 127.0.0.1 ports with certificates made on the fly by the `openssl` CLI, RBAC
authorization and a service-account issuer (so TokenRequest and impersonation work), waits for `/readyz`,
keeps each component's log in a file, and stops every process it started by pid. kube-controller-manager
runs the loops named in CONTROLLERS (Deployments and DaemonSets get Pods, deleted namespaces go away,
ClusterRoles are aggregated). By itself no scheduler or kubelet runs, so those Pods are never bound to a
node and never start; `hack/localnode.py` joins a real node (kubelet, containerd, kube-scheduler) to a
cluster started with `LocalCluster(node_mode=True)`.

    from hack.localcluster import LocalCluster, tools_bin
    with LocalCluster() as cluster:
        cluster.kubectl("get", "namespaces")
"""

from __future__ import annotations

import argparse
import atexit
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.rules.contracts import GROUP
from hack.processes import Component, Lifecycle, free_port, signals_raise, spawn, tail

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("kube-apiserver", "kube-controller-manager", "kubectl", "etcd", "helm", "promtool")
CLUSTER_TOOLS = ("kube-apiserver", "kube-controller-manager", "etcd", "kubectl")
# The kube-controller-manager loops whose work the tests and the demo rely on or check: Pods for the
# chart's Deployment and DaemonSet, `default` ServiceAccounts, deleted namespaces emptied and removed,
# dependents collected, the chart's aggregated ClusterRoles folded into view/edit/admin, and the
# PodDisruptionBudget's status (which Pods it covers), and ResourceQuotas' status (quota admission
# refuses every Pod of a namespace whose quota has no status.hard yet). Node
# lifecycle is left out on purpose: with no kubelet it would mark every Node unreachable.
CONTROLLERS = (
    "serviceaccount-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "clusterrole-aggregation-controller",
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "disruption-controller",
    "resourcequota-controller",
    # Pods' projected ServiceAccount tokens carry this ConfigMap's CA.
    "root-ca-certificate-publisher-controller",
)
# With a real node, the node lifecycle controller lifts the kubelet's registration taint once the Node
# is Ready (and would mark a silent kubelet's Node unreachable, which is why it is off without one).
NODE_CONTROLLERS = ("node-lifecycle-controller", "job-controller", "endpoints-controller")
KEEP_DIR_ENV = "SANDKEEP_KEEP_CLUSTER_DIR"
# TEST-NET-3 (RFC 5737). No kube-proxy runs: the only Service IP anything reaches is the `kubernetes`
# Service's first address, which a real node (hack/localnode.py) forwards to the API server.
SERVICE_CIDR = "203.0.113.0/24"
SERVICE_IP = "203.0.113.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
LOG_TAIL_LINES = 60


class ClusterError(RuntimeError):
    """The control plane could not be started or used; the message says why and carries component logs."""


class ToolsMissingError(ClusterError):
    """A Go tool is not built: the message names it and says to run `make tools`."""


class KubectlError(subprocess.CalledProcessError):
    """`kubectl` exited non-zero; str() shows the command and what kubectl printed on stderr."""

    def __str__(self) -> str:
        return f"kubectl {' '.join(self.cmd[1:])} exited {self.returncode}: {(self.stderr or '').strip()}"


def tools_dir() -> Path:
    """Where `hack/tools/build.sh` puts the tools: `$SANDKEEP_TOOLS_DIR/bin`, default `<repo>/.cache/tools/bin`."""
    return Path(os.environ.get("SANDKEEP_TOOLS_DIR") or REPO / ".cache" / "tools") / "bin"


def tools_bin(required: Sequence[str] = TOOLS) -> Path:
    """The tools bin dir, after checking every required tool is there and executable.

    Raises instead of returning a partial directory, so a test that needs the control plane fails
    with the reason (never skips) on a machine where the tools were not built.
    """
    bin_dir = tools_dir()
    missing = [t for t in required if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        raise ToolsMissingError(
            f"tools not built: {', '.join(missing)} missing from {bin_dir}; "
            "run `make tools` (hack/tools/build.sh) or set SANDKEEP_TOOLS_DIR to a built cache"
        )
    return bin_dir


def kube_version() -> str:
    """The Kubernetes version the tools are pinned to (and stamped with), read from the kube wrapper's go.mod."""
    for line in (REPO / "hack" / "tools" / "kube" / "go.mod").read_text().splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "require" and words[1] == "k8s.io/kubernetes":
            return words[2]
        if len(words) >= 2 and words[0] == "k8s.io/kubernetes" and words[1].startswith("v"):
            return words[1]
    raise ClusterError("k8s.io/kubernetes is not required in hack/tools/kube/go.mod")


class LocalCluster(Lifecycle):
    """etcd + kube-apiserver on 127.0.0.1, with an admin kubeconfig, as a context manager.

    `workdir` is the parent of the cluster's own temporary directory (default: the system temp dir);
    everything the cluster writes (certificates, kubeconfigs, etcd data, logs) lands in that directory,
    which `stop()` removes unless the cluster failed and SANDKEEP_KEEP_CLUSTER_DIR is set.
    """

    def __init__(
        self, workdir: Path | str | None = None, tools_bin: Path | str | None = None, *, node_mode: bool = False
    ) -> None:
        self._parent = Path(workdir) if workdir is not None else None
        # node_mode: ready for a real kubelet (ServiceAccount admission mounts tokens into Pods, the node
        # lifecycle controller runs); see hack/localnode.py.
        self.node_mode = node_mode
        self._tools_bin = Path(tools_bin) if tools_bin is not None else None
        self.dir: Path | None = None
        self.components: list[Component] = []
        self.server = ""
        self.etcd_url = ""
        self.startup_seconds: float | None = None
        self.failed = False
        self._lock = threading.Lock()
        self._admin_context: ssl.SSLContext | None = None

    # --- paths ----------------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        if self.dir is None:
            raise ClusterError("the cluster is not started")
        return self.dir / name

    @property
    def bin(self) -> Path:
        """The tools bin dir this cluster runs its components and kubectl from."""
        if self._tools_bin is None:
            self._tools_bin = tools_bin(CLUSTER_TOOLS)
        return self._tools_bin

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (client certificate in group system:masters)."""
        return self._path("admin.kubeconfig")

    @property
    def ca_file(self) -> Path:
        """The CA that signed the serving and client certificates."""
        return self._path("pki/ca.crt")

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (node mode): every write a service account made (tests/bed/audit.py)."""
        return self._path("audit.log")

    def _audit_args(self) -> list[str]:
        """What a test needs to count writes across Pods that come and go (a rollout replaces the agents
        and their logs): each service account's write, with its body for the sandkeep.io resources."""
        policy = self._path("audit-policy.yaml")
        writes = ["create", "update", "patch", "delete", "deletecollection"]
        accounts = ["system:serviceaccounts"]
        rules = [
            {"level": "Request", "userGroups": accounts, "verbs": writes, "resources": [{"group": GROUP}]},
            {"level": "Metadata", "userGroups": accounts, "verbs": writes},
            {"level": "None"},
        ]
        body = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"], "rules": rules}
        policy.write_text(json.dumps(body))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
        ]

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self, timeout: float = 90.0, attempts: int = 3) -> None:
        """Start etcd, kube-apiserver and kube-controller-manager; return once all three are ready.

        Free ports are picked before the processes bind them, so another process can take one first;
        a start that fails on a port already in use is retried with new ports, anything else raises
        ClusterError with the component logs. On any failure every started process is stopped.
        """
        if self.components:
            raise ClusterError("the cluster is already started")
        began = time.monotonic()
        tools = self.bin
        for name in CLUSTER_TOOLS:
            if not os.access(tools / name, os.X_OK):
                raise ToolsMissingError(f"{tools / name} is not an executable; run `make tools`")
        if self._parent is not None:
            self._parent.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="sandkeep-cluster-", dir=self._parent))
        atexit.register(self.stop)
        try:
            self._make_pki()
            self._admin_context = None  # read() loads the new admin certificate
            for attempt in range(1, attempts + 1):
                try:
                    self._start_once(timeout)
                    break
                except ClusterError as e:
                    if attempt == attempts or "address already in use" not in str(e):
                        raise
                    self._stop_components()
        except BaseException:
            self.failed = True
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began

    def _start_once(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        data = self._path("etcd-data")
        shutil.rmtree(data, ignore_errors=True)
        client, peer, secure = free_port(), free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        self._spawn(
            "etcd",
            [
                "--name=sandkeep",
                f"--data-dir={data}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=sandkeep={peer_url}",
                "--initial-cluster-state=new",
                # Test data is thrown away: skipping fsync makes every write (and the start) much faster.
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._await("etcd", f"{self.etcd_url}/health", deadline, tls=False)
        pki = self._path("pki")
        self.server = f"https://127.0.0.1:{secure}"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={secure}",
                f"--tls-cert-file={pki / 'server.crt'}",
                f"--tls-private-key-file={pki / 'server.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=Node,RBAC",
                "--anonymous-auth=false",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--api-audiences={SA_ISSUER}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # ServiceAccount admission rejects a Pod whose ServiceAccount does not exist yet: tests
                # create Pods in namespaces they made a moment before the `default` account appears.
                # With a real node it runs: it is what mounts the token a Pod's client uses.
                *([] if self.node_mode else ["--disable-admission-plugins=ServiceAccount"]),
                # `kubectl logs` and `exec` go through the kubelet, which authorizes this client with a
                # SubjectAccessReview (system:masters may do everything).
                f"--kubelet-client-certificate={pki / 'admin.crt'}",
                f"--kubelet-client-key={pki / 'admin.key'}",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                # The `kubernetes` Service's Endpoints may not hold a loopback address: the default lease
                # reconciler would log a validation error every few seconds, so it is off.
                "--endpoint-reconciler-type=none",
                f"--cert-dir={pki}",
                "--profiling=false",
                "--v=1",
                *(self._audit_args() if self.node_mode else []),
            ],
        )
        self._await("kube-apiserver", f"{self.server}/readyz", deadline, tls=True)
        self._write_kubeconfig(self.kubeconfig, {"client-certificate": "admin.crt", "client-key": "admin.key"})
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--controllers={','.join(CONTROLLERS + (NODE_CONTROLLERS if self.node_mode else ()))}",
                "--secure-port=0",  # serves nothing: readiness is read from the work it does
                "--leader-elect=false",
                "--concurrent-gc-syncs=2",
                "--profiling=false",
                "--v=1",
            ],
        )
        # Ready once the serviceaccount controller (the first of its loops) has given `default` its account.
        self._await(
            "kube-controller-manager",
            f"{self.server}/api/v1/namespaces/default/serviceaccounts/default",
            deadline,
            tls=True,
        )

    def stop(self) -> None:
        """Stop every process this cluster started (apiserver first) and remove its directory.

        Safe to call more than once and from atexit. The directory is kept when the cluster failed and
        SANDKEEP_KEEP_CLUSTER_DIR is set, so the logs and etcd data can be read afterwards.
        """
        with self._lock:
            self._stop_components()
            atexit.unregister(self.stop)
            if self.dir is not None and self.dir.exists():
                if self.failed and os.environ.get(KEEP_DIR_ENV):
                    print(f"localcluster: kept {self.dir} ({KEEP_DIR_ENV} is set)", file=sys.stderr)
                else:
                    shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_components(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components.clear()

    def _spawn(self, name: str, args: list[str]) -> None:
        self.components.append(spawn(name, [str(self.bin / name), *args], self._path(f"{name}.log"), cwd=self.dir))

    def _await(self, name: str, url: str, deadline: float, *, tls: bool) -> None:
        """Poll a health URL until it answers 200; fail fast with the logs if the component exits."""
        context = self._ssl_context(client_cert=True) if tls else None
        last = ""
        while True:
            component = next(c for c in self.components if c.name == name)
            if component.proc.poll() is not None:
                raise ClusterError(f"{name} exited with {component.proc.returncode}\n{self.logs()}")
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"{e.code} {e.read().decode(errors='replace')[-2000:]}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} not ready at {url} in time (last answer: {last})\n{self.logs()}")
            time.sleep(0.1)

    # --- certificates and kubeconfigs ------------------------------------------------------------------
    def _make_pki(self) -> None:
        """A CA, the apiserver's serving cert (127.0.0.1, localhost), an admin client cert, the SA key pair.

        EC P-256 keys: generated in milliseconds, where RSA would add about a second to every start.
        The extensions satisfy strict X.509 verification (key usage, AKI/SKI), which Python's ssl and
        Go's crypto/tls both apply.
        """
        pki = self._path("pki")
        pki.mkdir(mode=0o700)

        for key in ("ca", "server", "admin", "sa"):
            self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{key}.key")
        self._openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        (pki / "ext.cnf").write_text(
            "[req]\ndistinguished_name=dn\n[dn]\n"
            "[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign,digitalSignature\n"
            "subjectKeyIdentifier=hash\n"
            "[server]\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:{SERVICE_IP},DNS:localhost\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
            "[client]\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=clientAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        ca = ("-key", "ca.key", "-subj", "/CN=sandkeep-local-ca", "-days", "3650")
        self._openssl("req", "-x509", "-new", *ca, "-config", "ext.cnf", "-extensions", "ca", "-out", "ca.crt")
        self._sign("server", "/CN=kube-apiserver", "server")
        self._sign("admin", "/O=system:masters/CN=sandkeep-admin", "client")

    def _openssl(self, *args: str) -> None:
        result = subprocess.run(["openssl", *args], cwd=self._path("pki"), capture_output=True, text=True)
        if result.returncode != 0:
            raise ClusterError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")

    def _sign(self, name: str, subject: str, section: str) -> None:
        """pki/NAME.crt for the existing pki/NAME.key, signed by the cluster's CA."""
        serial = str(int.from_bytes(os.urandom(8), "big") | 1)
        self._openssl(
            "req", "-new", "-key", f"{name}.key", "-subj", subject, "-config", "ext.cnf", "-out", f"{name}.csr"
        )
        signing = ("-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial", serial, "-days", "365")
        extensions = ("-extfile", "ext.cnf", "-extensions", section)
        self._openssl("x509", "-req", "-in", f"{name}.csr", *signing, *extensions, "-out", f"{name}.crt")

    def client_kubeconfig(self, name: str, subject: str, path: Path, server: str | None = None) -> Path:
        """A kubeconfig at `path` for a new client certificate with `subject` (e.g. a kubelet's
        `/O=system:nodes/CN=system:node:NAME`), talking to `server` (default: this cluster's URL)."""
        self._openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")
        self._sign(name, subject, "client")
        return self._write_kubeconfig(
            path, {"client-certificate": f"{name}.crt", "client-key": f"{name}.key"}, server=server
        )

    def _ssl_context(self, *, client_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if client_cert:
            pki = self._path("pki")
            context.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        return context

    def _write_kubeconfig(self, path: Path, user: dict[str, str], server: str | None = None) -> Path:
        """Write a kubeconfig for this server; certificate files named in `user` are embedded as data.

        Self-contained (no paths into the cluster dir), so it still works when copied or read from
        another working directory, and JSON, which every kubeconfig reader accepts as YAML.
        """
        pki = self._path("pki")
        embedded = {}
        for key, value in user.items():
            if key in ("client-certificate", "client-key"):
                embedded[f"{key}-data"] = base64.b64encode((pki / value).read_bytes()).decode()
            else:
                embedded[key] = value
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "sandkeep-local",
                    "cluster": {
                        "server": server or self.server,
                        "certificate-authority-data": base64.b64encode(self.ca_file.read_bytes()).decode(),
                    },
                }
            ],
            "users": [{"name": "user", "user": embedded}],
            "contexts": [{"name": "sandkeep-local", "context": {"cluster": "sandkeep-local", "user": "user"}}],
            "current-context": "sandkeep-local",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)
        return path

    def kubeconfig_for_token(self, token: str, path: Path | str) -> Path:
        """Write a kubeconfig at `path` that authenticates with a bearer token (e.g. a ServiceAccount's)."""
        return self._write_kubeconfig(Path(path), {"token": token})

    # --- using it -------------------------------------------------------------------------------------
    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        as_user: str | None = None,
        kubeconfig: Path | str | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster (as admin unless `kubeconfig` is given).

        `as_user` impersonates (`--as`), e.g. `system:serviceaccount:NS:NAME`; the apiserver then adds
        the ServiceAccount's groups itself, as the real token would. Raises KubectlError (with kubectl's
        stderr) on a non-zero exit when `check` is true.
        """
        cmd = [str(self.bin / "kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}"]
        if as_user is not None:
            cmd.append(f"--as={as_user}")
        cmd.extend(args)
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any | None:
        """One API request as admin, its answer parsed; None when the server answers 404 (or 410).

        What polling loops and per-test set-up should use: a request costs about 6 ms of CPU on both ends, a
        `kubectl` run 75 ms (a Go process starting, its TLS handshake); at ten polls a second kubectl took
        most of the CPU that a test waiting on a component used, on two shared cores. Other refusals raise
        ClusterError with the server's message.
        """
        if self._admin_context is None:
            self._admin_context = self._ssl_context(client_cert=True)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self._admin_context) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                return None
            raise ClusterError(f"{method} {path}: {e.code} {e.read().decode(errors='replace')}") from None

    def read(self, path: str) -> Any | None:
        """GET an API `path` as admin (see `request`), parsed; None when it is not there."""
        return self.request("GET", path)

    def kubectl_json(self, *args: str, **kwargs: Any) -> Any:
        """`kubectl ... -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def apply(self, manifest: str | dict[str, Any] | list[dict[str, Any]], *args: str) -> str:
        """`kubectl apply -f -` of a YAML/JSON string or of objects; returns kubectl's output."""
        if not isinstance(manifest, str):
            items = manifest if isinstance(manifest, list) else [manifest]
            manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return self.kubectl("apply", "-f", "-", *args, input=manifest).stdout

    def token_for(self, namespace: str, serviceaccount: str, audience: str | None = None, duration: str = "1h") -> str:
        """A real, signed token for an existing ServiceAccount, from the TokenRequest API."""
        args = ["create", "token", serviceaccount, "-n", namespace, f"--duration={duration}"]
        if audience is not None:
            args.append(f"--audience={audience}")
        return self.kubectl(*args).stdout.strip()

    def create_node(self, name: str, *, ready: bool = False, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Create a real Node object (no kubelet behind it), optionally with a Ready=True condition.

        Agents need real node names: field selectors on spec.nodeName, owner references and the
        Node authorizer all look the Node up. Ready is written through the status subresource, as a
        kubelet would; nothing keeps it fresh, and nothing marks it NotReady either.
        """
        # A node name may run to 253 characters, a label value to 63: the hostname label gets the
        # name's first DNS label, as a kubelet on a host named that way would set it.
        hostname = name.split(".")[0][:63].rstrip("-")
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": hostname, **(labels or {})}},
        }
        created: dict[str, Any] = self.request("POST", "/api/v1/nodes", node)
        if ready:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            condition = {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "sandkeep localcluster: no kubelet, marked ready by hand",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            patch = {"status": {"conditions": [condition]}}
            merge = "application/merge-patch+json"
            created = self.request("PATCH", f"/api/v1/nodes/{name}/status", patch, content_type=merge)
        return created

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` authenticated as admin (the caller closes it)."""
        from kubernetes import config  # imported here: the CLI and tools_bin() do not need the client

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def metrics_text(self) -> str:
        """kube-apiserver's Prometheus /metrics, read as admin."""
        return self.kubectl("get", "--raw", "/metrics").stdout

    def logs(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of each component's log, one headed block per component."""
        if self.dir is None:
            return "(cluster not started: no logs)"
        blocks = []
        for name in ("etcd", "kube-apiserver", "kube-controller-manager"):
            path = self.dir / f"{name}.log"
            blocks.append(f"----- {name} ({path}), last {lines} lines -----\n{tail(path, lines)}")
        return "\n".join(blocks)

    def pids(self) -> list[int]:
        """The pids of the processes this cluster started and has not stopped."""
        return [c.proc.pid for c in self.components if c.proc.poll() is None]


def main(argv: Sequence[str] | None = None) -> int:
    """`make cluster`: start a control plane, print how to use it, wait for Ctrl-C, stop it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, help="parent of the cluster's temp dir (default: system temp)")
    parser.add_argument("--node", action="append", default=[], help="create a Ready Node of this name (repeatable)")
    args = parser.parse_args(argv)
    try:
        bin_dir = tools_bin(CLUSTER_TOOLS)
    except ToolsMissingError as e:
        print(f"localcluster: {e}", file=sys.stderr)
        return 2
    with signals_raise():
        try:
            with LocalCluster(args.workdir, bin_dir) as cluster:
                for node in args.node:
                    cluster.create_node(node, ready=True)
                print(f"# local control plane ready in {cluster.startup_seconds:.1f}s: {cluster.server}")
                print(f"# etcd {cluster.etcd_url}, pids {' '.join(map(str, cluster.pids()))}, dir {cluster.dir}")
                print(f"export KUBECONFIG={cluster.kubeconfig}")
                print(f'export PATH="{bin_dir}:$PATH"   # the built kubectl, helm and promtool')
                print("# then e.g.: kubectl get --raw /version; kubectl get namespaces")
                print("# Ctrl-C stops every component and removes the directory.", flush=True)
                while all(c.proc.poll() is None for c in cluster.components):
                    time.sleep(0.5)
                cluster.failed = True
                print(f"localcluster: a component exited\n{cluster.logs()}", file=sys.stderr)
                return 1
        except KeyboardInterrupt:
            print("\nlocalcluster: stopped", file=sys.stderr)
            return 130
        except ClusterError as e:
            print(f"localcluster: {e}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
