"""The shared core: settings, hardware, the kernel<->rank contract, errors, atomic writes.

Both sides import it; it imports no other nbaccel package.
"""
