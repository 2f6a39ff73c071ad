"""Flower 1.42's own FedAvg app on fedpipe's site folders (see ../pyproject.toml)."""
