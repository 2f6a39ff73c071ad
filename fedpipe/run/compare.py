"""The models a method compares, scored on every client's local test split and on the global test set: the
federated mixture of experts' evaluation (Listo Zec et al., Sec. 4, Evaluation: FedAvg, Local, Fine-tuned and the
Mixture on a local test set that mirrors each client's distribution and on a balanced global test set, the mean
over clients). Used by `fedpipe reproduce` (fedpipe.study.reproduce) and benchmarks/mixture.py's table."""

from __future__ import annotations

import numpy as np

from fedpipe.data.federated import prepare_data
from fedpipe.engine.evaluation import evaluate_model
from fedpipe.engine.state import PhaseState
from fedpipe.errors import ConfigError
from fedpipe.run.run import Run


def compared_model_scores(run: Run, state: PhaseState) -> dict[str, float]:
    """{"<model>.local": mean accuracy over clients on their own test splits, "<model>.global": on the global
    test set} for each model of `Algorithm.compared_models` (fractions)."""
    algorithm, _ = run.build_algorithm()
    if not hasattr(algorithm, "compared_models"):
        raise ConfigError(f"scoring compared models needs a method that compares models (fedmoe); {algorithm.name} does not")
    data = prepare_data(run.bundle, run.load_partition(), run.device, run.cfg.standardisation())  # as the run trained
    if data.global_test is None:
        raise ConfigError("scoring compared models needs a global test set; this dataset and partition have none")
    cfg = run.cfg.eval
    scores: dict[str, list[float]] = {}
    for client in data.clients:
        for name, params in algorithm.compared_models(state.server, state.clients.get(client.client_id)).items():
            for split, where in (("local", client.test), ("global", data.global_test)):
                scores.setdefault(f"{name}.{split}", []).append(evaluate_model(algorithm, params, where, cfg.batch_size, cfg.ece_bins).accuracy)
    return {measure: float(np.mean(values)) for measure, values in scores.items()}
