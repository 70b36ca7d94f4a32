"""`disagg render`: a CR file in, every child object out as a multi-document YAML stream. No cluster."""
from __future__ import annotations

import sys
from typing import Any, TextIO

import pydantic
import yaml

from .api import KIND, DisaggregatedInference
from .builders import OperatorImages, build_children
from .meta import DEFAULT_IMAGES
from .rollout.state import ROLES
from .scale.counts import RoleWrite
from .scale.objects import role_object


class RenderError(Exception):
    """Bad input, with a message naming the file and field."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Launch scripts read as scripts, not as one escaped line.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def validation_message(err: pydantic.ValidationError, source: str) -> str:
    lines = [f"{source}: invalid {KIND}:"]
    for e in err.errors():
        lines.append(f"  {_field_path(e['loc'])}: {e['msg']}")
    return "\n".join(lines)


def load_crs(text: str, source: str) -> list[DisaggregatedInference]:
    """Every DisaggregatedInference document in `text` (documents of other kinds are ignored)."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError(f"{source}: not valid YAML: {exc}") from exc
    crs = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise RenderError(f"{source}: expected a mapping, got {type(doc).__name__}")
        if doc.get("kind", KIND) != KIND:
            continue
        try:
            crs.append(DisaggregatedInference.model_validate(doc))
        except pydantic.ValidationError as exc:
            raise RenderError(validation_message(exc, source)) from exc
        if not crs[-1].metadata.get("name"):
            raise RenderError(f"{source}: metadata.name: required")
    if not crs:
        raise RenderError(f"{source}: no {KIND} document found")
    return crs


def render(text: str, *, source: str = "<input>", images: OperatorImages = DEFAULT_IMAGES) -> str:
    """Every child, and each role's DisaggregatedRole as the operator first creates it (it then keeps the count
    /scale sets: scale/counts.py)."""
    children: list[dict[str, Any]] = []
    for cr in load_crs(text, source):
        try:
            children += build_children(cr, images=images)
        except ValueError as exc:
            raise RenderError(f"{source}: {exc}") from exc
        for role in ROLES:
            asked = cr.spec.prefill if role == "prefill" else cr.spec.decode
            children.append(role_object(cr, role, RoleWrite(asked.initial_replicas, asked.replicas)))
    return yaml.dump_all(children, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def main(path: str, *, operator_image: str | None = None, stdin: TextIO | None = None,
         stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Exit code: 0 rendered, 2 bad input."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    images = OperatorImages(operator=operator_image) if operator_image else OperatorImages()
    try:
        if path == "-":
            text, source = stdin.read(), "<stdin>"
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise RenderError(f"{path}: {exc.strerror}") from exc
            source = path
        stdout.write(render(text, source=source, images=images))
    except RenderError as exc:
        print(f"disagg render: {exc}", file=stderr)
        return 2
    return 0
