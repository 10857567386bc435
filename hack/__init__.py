"""Developer tools, a package so the tests and the demo import the local control plane and node as
`hack.localcluster` and `hack.localnode`; the scripts run from the repository root as `python -m hack.<name>`."""
