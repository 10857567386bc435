"""The CSI protocol half of sandkeep's node plugin (issue 27)."""
