"""The cluster controller (`sandkeep controller`): one decision per sandbox, the quotas, the sessions, the
policies.

Its parts, each named for its job:

    main.py            flags into settings, then start and stop: the election, the watches, the workers
    settings.py        ControllerSettings and the few fixed names
    controller.py      the watches feeding the view, the work queues and their workers
    view.py            what the watches told it, each sandbox slim and packed
    decide.py          pure: one sandbox's status and conditions, delete or not, when to look again
    reconciler.py      one key's reconcile, returning when to look again; the guarded DELETE
    quota_enforcer.py  a namespace over its quota releases its oldest releasable sandboxes
    lost_nodes.py      a deleting sandbox whose node is gone past the grace: its disk finalizer removed
    events.py          Events, posted in the background from a bounded backlog
    sessions.py        SandboxSessions: the queue of sessions, the reads and writes around their decision
    session_decide.py  pure: what one session needs now (caps, images, the admission guard, its Pod)
    session_objects.py pure: a session's Pod in its sandbox's namespace (the CSI volume, `restricted`)
    policyset.py       several SandboxPolicies in one namespace: the oldest applies
"""
