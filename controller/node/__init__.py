"""The node's disk and processes: the store, the one deletion pipeline, in-use checks, orphans."""
