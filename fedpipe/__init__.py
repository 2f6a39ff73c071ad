"""fedpipe: personalized federated learning methods, run as a Kubeflow pipeline or on one machine."""

__version__ = "0.1.0"
