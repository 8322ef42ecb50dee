"""Calibration: fit the cost model's named parameters to measurements, and apply them.

The built-in calibration file (meshplan/data/calibration.json) is read by the leaf module
meshplan.builtin_calibration, so that spec and cost can read it without importing this package.

space    the fittable parameters: bounds, priors, meaning
store    Calibration (values + provenance), load/save, apply to CostParams and clusters
fit      the MAP fit (Levenberg-Marquardt) and leave-one-source-out cross-validation
"""
