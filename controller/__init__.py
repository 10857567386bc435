"""sandkeep: keep finished jobs' workspaces on each node for a retention window, then delete them safely."""

__version__ = "0.1.0"
