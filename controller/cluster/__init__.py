"""The controller: one decision per object, the sessions, the policies."""
