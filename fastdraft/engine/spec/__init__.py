"""Speculative decoding: draft trees, proposers, lossless verification, tuner.

Kept empty on purpose: importing the package must not pull in torch-heavy modules.
"""
