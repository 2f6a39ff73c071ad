"""Kubernetes: the manifest of a phase that outgrows one pod, as a Training Operator PyTorchJob or a
Trainer v2 TrainJob (phasejob.py: what both share), and the launcher that submits it and waits
(through the `kubernetes` client)."""
