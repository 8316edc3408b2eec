"""The kernel side of a launch: validate, start ranks, relay their events to a view, clean up.

May import: ``nbaccel.core`` and ``nbaccel.forkserver``; never ``nbaccel.ui``: views are known by
the :class:`~nbaccel.launch.protocols.View` protocol, given by the launcher (``nbaccel.launchers``).
Never imported inside a rank.
"""
