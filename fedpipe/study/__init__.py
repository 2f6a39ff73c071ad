"""Studies: many runs of many methods, tuned on validation, repeated over seeds, compared with statistics."""
