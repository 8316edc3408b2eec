"""A runner for Accelerate's own multi-process test scripts against nbaccel (issue 24).

``redirect`` loads a script from the installed accelerate with its imports answered by nbaccel,
``cases`` lists every test function the scripts run, ``runner`` launches one case per launch on
2 CPU ranks with either library and tabulates the outcomes.
"""
