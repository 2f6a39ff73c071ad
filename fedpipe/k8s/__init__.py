"""Kubernetes: the PyTorchJob manifest of a phase that outgrows one pod, and the launcher that
submits it and waits (through the `kubernetes` client)."""
