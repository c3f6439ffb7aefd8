"""Experimental public API, built on the core layers (never imported by them)."""

from .register_sharding import register_sharding

__all__ = ["register_sharding"]
