"""Optimisation playbooks: YAML skeletons with applicability conditions, transforms and validation."""
