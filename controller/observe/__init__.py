"""Logs and metrics: how every component tells a person and Prometheus what it does."""
