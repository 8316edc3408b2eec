"""Imported first by the fork server: it leaves the kernel's process group, becomes a child
subreaper, and kills everything below it before it exits (see :mod:`nbaccel.rank.containment`)."""

from nbaccel.rank.containment import guard_server

guard_server()
