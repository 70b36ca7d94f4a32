"""The control plane: API models, builders, and thin kopf handlers.

Imported only as `disagg.operator` (pyproject.toml maps this folder). Never put the repository root on
sys.path: this folder would then shadow the stdlib `operator` (tests/unit/test_package.py guards it).
"""
