"""The fork server that starts every notebook rank, and its mirror of the kernel's imports.

One concept, both of its sides. In the kernel: ``server`` (``ForkServer``: the process's one
server, its state, rank starts, retiring a server that stops answering) and ``mirror`` (which of
the kernel's modules the server imports too, and when). In the server process, first to last:
``guard`` (leave the kernel's process group, subreaper, die with the kernel), ``preload``
(torch), ``importer`` (imports the kernel's modules in a thread) and ``ready``. ``protocol`` is
the kernel <-> server lines of the mirror, read by both sides. See docs/architecture.md.

May import: core, rank, launch and ui (the server's side — guard, preload, importer, ready,
protocol — only core, rank and each other; a rank may ask ``guard`` whether it runs in the
server).
"""
