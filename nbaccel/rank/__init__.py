"""What runs inside a rank: its entry points, exit protocol, progress reporting, torch fixes.

May import: ``nbaccel.core``. Never imports the launcher, views, IPython or ipywidgets.
"""
