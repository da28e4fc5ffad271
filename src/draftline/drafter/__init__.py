"""The DFlash drafter: model, objective, target features, extraction, training, export and
evaluation."""
