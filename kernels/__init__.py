"""Packed-integer formats and kernels (imported as `compress.kernels`)."""
