"""Model lines: versioned models in the store, the promoted pointer, the promotion gate, warm starts and
models exported for serving (the `models` layer: above one run, below the entry points; it reads a run's
outputs and writes its own keys, `models/<name>/...`)."""
