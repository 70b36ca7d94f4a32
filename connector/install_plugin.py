"""`disagg install-plugin DIR`: put what an engine needs of `disagg.connector` where the engine's Python finds it.

Engine pods run the vLLM image, which has no disagg installed. The operator gives each engine pod an init
container running this command from the operator image into an emptyDir mounted at DIR, and the engine
container `PYTHONPATH=DIR`; vLLM then imports `disagg.connector.plugin` (`kv_connector_module_path`) from
DIR/disagg/connector/. What the copy relies on:
- the source is this installed package, found from this module's own location (the wheel in the operator
  image, or a checkout in development): the `*.py` files of the parts an engine imports (`ENGINE_PARTS`: the
  plugin, the wire contract and the rendezvous client), nothing else (no bytecode, no router or server);
- `disagg` stays a namespace package: DIR/disagg/ gets no `__init__.py`, so a `disagg` installed elsewhere in
  the engine's environment could still contribute its other portions;
- everything `disagg.connector` imports at run time outside the standard library (pydantic, aiohttp) is in
  vLLM's own dependencies; the package never imports `disagg.operator`.

Re-running is safe. The new tree is written beside the old one (a hidden sibling, which is no valid module
name and so never importable) and renamed into place, so an importer sees the old complete tree, briefly no
tree, or the new complete tree, never a half-copied one. Stale files of an earlier version go with the old
tree. An identical tree already in place is left alone.
"""
from __future__ import annotations

import filecmp
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

SOURCE = Path(__file__).resolve().parent
PACKAGE = ("disagg", "connector")
_STAGING = ".connector-new-"
_RETIRED = ".connector-old-"
FILE_MODE = 0o644  # the engine container may run as another user than this init container
DIR_MODE = 0o755


class InstallError(Exception):
    """The plugin could not be installed; the message says where and why."""


ENGINE_PARTS = ("__init__.py", "plugin/", "wire/", "rendezvous/__init__.py", "rendezvous/client.py")
"""What an engine imports of the package, relative to it: a file, or a folder with every module below it. The
plugin's import contract (pyproject.toml) keeps it to these."""


def _engine_part(rel: Path) -> bool:
    path = rel.as_posix()
    return any(path.startswith(part) if part.endswith("/") else path == part for part in ENGINE_PARTS)


def package_files(source: Path = SOURCE) -> list[Path]:
    """The Python files engines need (`ENGINE_PARTS`), relative to `source`, sorted (bytecode excluded)."""
    return sorted(rel for rel in (p.relative_to(source) for p in source.rglob("*.py"))
                  if "__pycache__" not in rel.parts and _engine_part(rel))


def _same_tree(dest: Path, source: Path, files: list[Path]) -> bool:
    if not dest.is_dir() or dest.is_symlink():
        return False
    present = sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file() and "__pycache__" not in
                     p.relative_to(dest).parts)
    return present == files and all(filecmp.cmp(source / f, dest / f, shallow=False) for f in files)


def _copy_tree(source: Path, staging: Path, files: list[Path]) -> None:
    for rel in files:
        target = staging / rel
        if not target.parent.exists():
            target.parent.mkdir(parents=True)
            target.parent.chmod(DIR_MODE)
        shutil.copyfile(source / rel, target)
        target.chmod(FILE_MODE)
        # Exactly these bytes, or fail now rather than at the engine's import.
        if not filecmp.cmp(source / rel, target, shallow=False):
            raise InstallError(f"{target} differs from {source / rel} after copying")
    staging.chmod(DIR_MODE)


def _remove_leftovers(parent: Path) -> None:
    """Staging and retired trees of an interrupted earlier run."""
    for entry in parent.iterdir():
        if entry.name.startswith((_STAGING, _RETIRED)) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def install(target: str | os.PathLike[str], source: Path = SOURCE) -> tuple[Path, int, bool]:
    """Install into `target`/disagg/connector. Returns (that directory, files, whether anything changed).

    Raises InstallError (never a bare OSError) naming the directory when it cannot be written."""
    target = Path(target)
    files = package_files(source)
    if Path("__init__.py") not in files:
        raise InstallError(f"{source} is not the disagg.connector package (no __init__.py)")
    parent = target.joinpath(*PACKAGE[:-1])
    dest = parent / PACKAGE[-1]
    try:
        target.mkdir(parents=True, exist_ok=True)
        if not os.access(target, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(target))
        if not parent.exists():
            parent.mkdir()
            parent.chmod(DIR_MODE)
        _remove_leftovers(parent)
        if _same_tree(dest, source, files):
            return dest, len(files), False
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=parent))
        retired: Path | None = None
        try:
            _copy_tree(source, staging, files)
            if dest.is_symlink() or dest.is_file():
                dest.unlink()
            elif dest.exists():
                retired = parent / f"{_RETIRED}{uuid.uuid4().hex[:8]}"
                dest.rename(retired)
            staging.rename(dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
            if retired is not None:
                shutil.rmtree(retired, ignore_errors=True)
    except OSError as e:
        where = e.filename or target
        raise InstallError(f"cannot install the connector plugin into {target}: {where}: "
                           f"{e.strerror or e} (the directory must exist or be creatable, and be writable by "
                           f"uid {os.getuid()})") from e
    return dest, len(files), True


def main(target: str) -> int:
    try:
        dest, count, changed = install(target)
    except InstallError as e:
        print(f"disagg install-plugin: {e}", file=sys.stderr)
        return 1
    verb = "installed" if changed else "already up to date:"
    print(f"disagg install-plugin: {verb} disagg.connector ({count} files) in {dest}; engines import "
          f"disagg.connector.plugin with PYTHONPATH={target}", flush=True)
    return 0
