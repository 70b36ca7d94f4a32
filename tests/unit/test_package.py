from __future__ import annotations

import operator
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_operator_folder_can_never_shadow_the_stdlib():
    """With no __init__.py, operator/ is at most a namespace portion, which always loses to the stdlib module,
    even with the checkout first on sys.path and nothing imported yet (python -S from the repository root)."""
    assert not (REPO / "operator" / "__init__.py").exists()
    out = subprocess.run([sys.executable, "-S", "-c", "import operator; print(operator.__file__)"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    assert out.endswith("operator.py") and not out.startswith(str(REPO))


def test_stdlib_operator_is_not_shadowed():
    """Even run from the repository root (cwd first on sys.path), `operator` is the stdlib module."""
    assert operator.itemgetter(1)([0, 7]) == 7
    out = subprocess.run([sys.executable, "-c", "import operator, disagg.operator; print(operator.__file__);"
                          "print(disagg.operator.__name__)"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    stdlib_file, pkg = out.split()
    assert "site-packages" not in stdlib_file and stdlib_file.endswith("operator.py")
    assert pkg == "disagg.operator"


def test_console_command_is_installed():
    out = subprocess.run([str(Path(sys.executable).parent / "disagg"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    for cmd in ("cluster", "demo"):
        assert cmd in out


def test_every_python_folder_is_a_package_of_the_wheel():
    """setuptools gets an explicit package list (the folder mapping rules out discovery): a folder of modules left
    out of it works in the editable checkout and is missing from the wheel, so the operator's image cannot import
    it."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    for name, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("*.py"):
            rel = init.parent.relative_to(REPO / folder)
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            package = ".".join((name, *rel.parts))
            assert package in listed, f"{init.parent} holds modules but {package} is not in pyproject's packages"
