"""The commands people run: `sandkeep`, `kubectl sandkeep`, exec, the standalone sweep, doctor."""
