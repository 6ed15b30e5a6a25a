"""Modules built from :mod:`companion.ops`: attention, FFNs, norms, caches, the block.

A layer takes plain arguments (widths, counts, flags), never a config.
"""
