"""Serving a model line: the global model and every client's personalized model behind one endpoint.

- `predictor`: the serving logic (which model answers, a bounded cache, input checks, following the promoted
  version), with no web framework in it;
- `kserve_model`: that logic as a KServe custom predictor (a `kserve.Model` behind KServe's REST server, with
  readiness that follows the model and the model repository extension refused), for `fedpipe models serve` and
  the InferenceService's container (the `serve` extra);
- `inference_service`: the KServe InferenceService that runs it on a cluster (`fedpipe models deploy`).
"""
