"""Ranks on a cluster instead of this machine: ``notebook_launcher(..., cluster=RayCluster())``.

Kernel side (``ray_cluster``, ``ray_group``, ``wire``) and what runs on a cluster's node
(``node``: the Ray actor that starts a rank; ``remote_entry``: the rank process). See
docs/multi_machine.md.
"""
