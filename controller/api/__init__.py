"""The Kubernetes API adapters: the client, list+watch, leases and the work queue."""
