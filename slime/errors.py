"""The base class of every error slime reports to its user as a message rather than a traceback.

Each subsystem keeps its own error classes next to its code (``ConfigError`` in
:mod:`slime.utils.config`, ``CheckpointError`` in :mod:`slime.checkpoints.layout`, ...); every one
that a user can cause or fix derives from :class:`SlimeError` and, where callers already catch a
standard type, from that type too (``ConfigError`` is a ``ValueError``).  ``python -m slime.train``
catches :class:`SlimeError` and no other type (:func:`slime.train.main`): it prints ``slime: error:
<message>`` and exits with status 2 (nothing ran) or 1.  Any other exception is a bug or comes from a
library, and keeps its traceback.  This module imports nothing, so any module may import it.
"""

from __future__ import annotations


class SlimeError(Exception):
    """An error in what the user gave (a flag, a file, a data row, the cluster) or a run stopped on a
    condition the user can act on.  The message names the flag, file, row or engine and the fix."""
