"""The ``nbaccel`` command: config, launch (torch elastic), export, env, demo.

May import every other nbaccel package.
"""
