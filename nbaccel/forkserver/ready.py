"""Imported last by the fork server: says the server has finished importing and now serves.

The kernel creates an empty file and names it in ``NBACCEL_SERVER_READY_FILE`` when it starts
the server; removing it tells the kernel that a rank can be started without waiting, so the
kernel can wait for the server interruptibly (a Stop pressed meanwhile leaves nothing behind).
"""

import os

_marker = os.environ.get("NBACCEL_SERVER_READY_FILE")
if _marker:
    try:
        os.unlink(_marker)
    except OSError:
        pass
