"""Calibration: fit the cost model's named parameters to measurements, and apply them.

builtin  the built-in calibration file (meshplan/data/calibration.json), read without cycles
space    the fittable parameters: bounds, priors, meaning
store    Calibration (values + provenance), load/save, apply to CostParams and clusters
fit      the MAP fit (Levenberg-Marquardt) and leave-one-source-out cross-validation
"""
