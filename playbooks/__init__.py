"""Optimisation playbooks: YAML skeletons of techniques from the best public inference code.

Each playbook names where the technique comes from, when it applies (predicates over the
harness's feedback *and* code patterns in the target), how to apply it (text for a model and,
where possible, an executable transform), its resource constraints, how to validate it (probes
and thresholds), and the risk categories it touches.  Applicability rests on evidence: a pattern
in the code alone never makes a playbook apply.
"""

from playbooks.model import Applicability, Playbook, evaluate, load_library, load_playbook

__all__ = ["Applicability", "Playbook", "evaluate", "load_library", "load_playbook"]
