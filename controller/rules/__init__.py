"""The pure rules and the contracts: no I/O, no Kubernetes client, no processes (import-linter checks)."""
