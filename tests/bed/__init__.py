"""The test bed the folders share, imported as `tests.bed.<module>` (the repository root is on pytest's path).

- `controller_harness`: the CRDs installed, a real `sandkeep controller` process, small builders, `wait_for`.
- `chart`: the built helm, `helm template` of the chart, and the values the chart tests share.
- `own_cluster`: a control plane of a test module's own, for questions about the whole cluster.
- `diskkit`: real directories for the node side: jobs, immutable files, bind mounts, a throwaway user.
- `procs`: whether a pid still runs, and the pids no agent may inspect.
- `agentkit`: the node agent's bed: simulated nodes with roots of their own, `sandkeep agent` as a real process.
- `rbackit`: the chart's RBAC installed on the API server, and the components run as its ServiceAccounts.
- `e2e_bed`: the end-to-end bed: the local control plane with one real node, or kind.

The local control plane and the real node themselves are `hack.localcluster` and `hack.localnode`, which the
demo and `make cluster` / `make node` run too.
"""
