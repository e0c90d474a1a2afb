"""Transports move bytes of flat, contiguous CPU tensors between the ranks of one group.

Each module holds one transport behind the small interface in ``base``; ``select`` decides which
one a group uses.
"""

from .base import Transport
from .select import create_transport

__all__ = ["Transport", "create_transport"]
