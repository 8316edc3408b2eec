"""Training inside a rank (or in the kernel with one process): the Accelerator and its parts.

May import: ``nbaccel.core`` and ``nbaccel.rank`` (progress and metric reporting).
"""
