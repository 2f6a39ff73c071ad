"""Kubeflow Pipelines components (installed as fedpipe.components)."""
