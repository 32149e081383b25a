"""Sinkhorn normalisation of mHC's stream-mixing matrices."""
