"""Persistent ranks: ``%ranks start``, ``%%ranks`` cells and ``nbaccel.Ranks``.

One concept, both of its sides. In the kernel: ``session`` (``Ranks``: start, run, push, pull,
stop), ``start`` (starting the group and accepting its command connections), ``cell`` (one
``%%ranks`` cell on the launch's event loop: ``CellJob``), ``status``, ``magics`` and
``cell_view`` (a cell's ranks' output as stream output). In a rank: ``serve`` (the command loop,
run as the rank's function). ``messages`` is the command protocol both sides speak. See
docs/ranks.md.

May import: core, rank, launch and ui (the rank's side — serve, messages — only core and rank).
"""
