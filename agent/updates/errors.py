"""What ends an update job early: JobFailed (a final state and its reason) and JobPaused (the agent is
stopping), raised by the model store, the downloader and the job, and caught where the job reports how it
ended; and which storage errors mean the device's card failed rather than a bug or the network.
"""
from __future__ import annotations

import errno

from agent.wire import JobState


class JobFailed(Exception):
    """The job ends here in `state` (FAILED, REJECTED, or SUCCEEDED when nothing is left to do), for `reason`."""

    def __init__(self, state: JobState, reason: str, keep_download: bool = False):
        super().__init__(reason)
        self.state, self.reason = state, reason
        self.keep_download = keep_download  # the network failed: a later job for this manifest resumes it


class JobPaused(Exception):
    """The agent is stopping during the job's download: it ends unreported and runs again after the restart."""


# A card that failed under us: ext4 remounts itself read-only after an I/O error (errors=remount-ro)
STORAGE_ERRNOS = (errno.EROFS, errno.EIO)
