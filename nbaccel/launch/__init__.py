"""The kernel side of a launch: validate, start ranks, relay their events to a view, clean up.

May import: ``nbaccel.core`` and ``nbaccel.ui`` (through the :class:`~nbaccel.ui.View` protocol).
Never imported inside a rank.
"""
