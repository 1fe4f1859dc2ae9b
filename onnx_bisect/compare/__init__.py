"""Comparing tensors: pure metrics, the divergence criterion, noise floors, task-level top-k."""
