"""Numerics the faces build on: fp8's scaling state and matmuls."""
