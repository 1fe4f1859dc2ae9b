"""Inputs: feeds built from the model's signature, or read from files, and validated."""
