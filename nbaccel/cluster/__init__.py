"""Ranks on a cluster instead of this machine: ``notebook_launcher(..., cluster=RayCluster())``.

Kernel side: ``ray_cluster`` (``RayCluster``: connect, place), ``ray_group`` (the launch's rank
group on the cluster), ``wire`` (the rank ↔ kernel connections). On a cluster node: ``node``
(the Ray actor that starts one rank) and ``remote_entry`` (the rank process). See
docs/multi_machine.md.

May import: core, rank (the node's side only those two), launch and ui.
"""
