"""Transports: how rows move between ranks (see base.py for the interface)."""
from .base import Transport, make_transport

__all__ = ["Transport", "make_transport"]
