"""A chaos harness for celery-leases: real workers under a nemesis, a history, a checker.

``python -m chaos run --profile ci`` starts throwaway servers, real
``celery worker`` processes (``chaos.app``), submits leased jobs that write
through fenced targets, injects faults from a seeded nemesis, then checks
the recorded history against the protocol's invariants. See
docs/testing.md ("The chaos harness") and docs/guarantees.md.
"""
