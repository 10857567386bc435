"""sandkeep: keep finished jobs' workspaces on each node for a retention window, then delete them safely."""

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml's `version` is the one source: the image installs the package, and so does `pip install -e`.
    __version__ = version("sandkeep")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
