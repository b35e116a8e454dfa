"""Ops with TensorFlow's names, each with its vector-Jacobian product."""
