"""The README is a front door: at most 200 lines, its links resolve, and every command it tells a user to run is
one that `make demo` or the tests also run.

The commands are the lines of the README's shell code blocks, and its inline code that starts with a program
(`make demo`). Each is proven without running anything:

- `make T`: T is a Makefile target, and either `demo` (its recipe runs `disagg demo`, devcluster/demo.py) or a
  command `.ci/run` runs (CI's entry point, `make test`); `.ci/run` itself is what the tests run in CI.
- `helm install ...`: the demo's own (devcluster/demo.py `_helm_install`, called here with subprocess.run
  recorded instead of run): the same subcommand, release, chart and namespace; every other flag the README passes
  the demo passes too, with the same value; every value it `--set`s is one the demo's values file sets.
- `kubectl ...`: one of the commands devcluster/demo.py and demo_node.py run (their `_kubectl(c, ...)` calls,
  read from the source; a module constant stands for its value, a local variable such as a CR name for any
  argument that is not a flag), argument for argument.
- `kubectl port-forward svc/S L:P`, then `curl`: the one step neither runs (the demo reaches the router
  Service's ClusterIP from the host). S must be the router Service the operator's builders render for an example
  an earlier command applied (what `disagg render` prints), P its port; the request goes to localhost:L, on a
  path the demo posts to, with the header the demo sends, body keys the demo's request has, and the example's
  model.
- anything else is a problem.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
import shlex
import subprocess
import types
from pathlib import Path

import pytest
import yaml

from disagg.devcluster import demo, demo_engines, demo_node
from disagg.operator import names, render

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 200
PROGRAMS = ("make", "helm", "kubectl", "curl", "docker", "disagg", "python", "python3", "pip", "go", "sudo", "bash",
            "sh", "./", ".ci/")
ANY = object()  # a demo argument that is a local variable: any non-flag argument


# -- what the README tells a user to run --------------------------------------------------------------------------
def shell_blocks(text: str) -> list[list[str]]:
    """Each shell code block's commands: continuation lines joined, comments and blank lines dropped."""
    blocks = re.findall(r"^```(?:sh|bash|shell|console)\n(.*?)^```", text, flags=re.M | re.S)
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        out.append([line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")])
    return out


def inline_commands(text: str) -> list[str]:
    """Inline code outside code blocks that starts with a program."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [s for s in spans if s.split()[0] in PROGRAMS or s.startswith(("./", ".ci/"))]


def readme_commands(text: str) -> list[str]:
    return [c for block in shell_blocks(text) for c in block] + inline_commands(text)


# -- what the demo and CI run ---------------------------------------------------------------------------------------
def _relative(value: object) -> object:
    if isinstance(value, Path):
        return str(value.relative_to(REPO)) if value.is_relative_to(REPO) else str(value)
    return value


def _arg(module: types.ModuleType, node: ast.expr) -> object:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args \
            and isinstance(node.args[0], ast.Name) and isinstance(getattr(module, node.args[0].id, None), Path):
        return _relative(getattr(module, node.args[0].id))
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return getattr(module, node.id)
    return ANY


def demo_kubectl_commands() -> list[tuple[object, ...]]:
    """Every `_kubectl(c, ...)` call in the demo, its arguments after the cluster."""
    out = []
    for module in (demo, demo_node):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_kubectl":
                out.append(tuple(_arg(module, a) for a in node.args[1:]))
    assert out, "no kubectl call found in devcluster/demo.py"
    return out


def demo_helm_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict]:
    """The argv of the demo's `helm install` (after the binary and its --kubeconfig) and the values it installs."""
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: calls.append([str(a) for a in argv]))
    cluster = types.SimpleNamespace(bin=tmp_path / "bin", dir=tmp_path, kubeconfig=tmp_path / "kubeconfig")
    demo._helm_install(cluster, "registry.example/disagg:built")
    [argv] = calls
    assert Path(argv[0]).name == "helm" and argv[1].startswith("--kubeconfig=")
    argv = [_relative(Path(a)) if Path(a) == demo.CHART else a for a in argv[2:]]
    values = yaml.safe_load(Path(argv[argv.index("-f") + 1]).read_text())
    return argv, values


def make_targets() -> dict[str, list[str]]:
    """Each Makefile target and its recipe lines."""
    targets: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+):(?!=)", line)
        if m:
            current = targets.setdefault(m.group(1), [])
        elif current is not None and line.startswith("\t"):
            current.append(line.strip())
        elif not line.strip():
            current = None
    return targets


def ci_commands() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith(("#", "set ", "cd "))]


# -- the proofs -----------------------------------------------------------------------------------------------------
VALUE_FLAGS = {"--namespace": "--namespace", "-n": "--namespace", "-f": "-f", "--values": "-f",
               "--timeout": "--timeout", "--set": "--set"}


def _helm_parse(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    positional, options = [], {}
    it = iter(argv)
    for a in it:
        if a in VALUE_FLAGS:
            options.setdefault(VALUE_FLAGS[a], []).append(next(it, ""))
        elif a.startswith("-"):
            options.setdefault(a, [])
        else:
            positional.append(a)
    return positional, options


def _has_value(values: dict, dotted: str) -> bool:
    node: object = values
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


class Checker:
    def __init__(self, helm_argv: list[str], helm_values: dict) -> None:
        self.helm_argv, self.helm_values = helm_argv, helm_values
        self.kubectl = demo_kubectl_commands()
        self.targets = make_targets()
        self.ci = ci_commands()
        self.applied: list[Path] = []
        self.forwarded: dict[str, Path] = {}  # local port -> the example whose router it reaches

    def problem(self, command: str) -> str | None:
        try:
            argv = shlex.split(command, comments=True)
        except ValueError as e:
            return f"{command!r}: cannot parse: {e}"
        if argv and argv[-1] == "&":
            argv = argv[:-1]
        if not argv or any(a in ("&&", "||", "|", ";") for a in argv):
            return f"{command!r}: one command per line, please"
        check = {"make": self.make, "helm": self.helm, "kubectl": self.kubectl_command, "curl": self.curl,
                 ".ci/run": self.ci_run}.get(argv[0])
        if check is None:
            return f"{command!r}: neither `make demo` nor the tests run {argv[0]!r}"
        return check(command, argv[1:])

    def make(self, command: str, args: list[str]) -> str | None:
        if len(args) != 1 or args[0] not in self.targets:
            return f"{command!r}: not one Makefile target"
        if args[0] == "demo" and any("disagg demo" in line for line in self.targets["demo"]):
            return None
        if f"make {args[0]}" in self.ci:
            return None
        return f"{command!r}: neither the demo nor what .ci/run runs"

    def ci_run(self, command: str, args: list[str]) -> str | None:
        return None if not args and "make test" in self.ci else f"{command!r}: .ci/run takes no arguments"

    def helm(self, command: str, args: list[str]) -> str | None:
        theirs, ours = _helm_parse(self.helm_argv), _helm_parse(args)
        if ours[0] != theirs[0]:
            return f"{command!r}: the demo runs `helm {' '.join(theirs[0])}` (subcommand, release, chart)"
        for flag, values in ours[1].items():
            if flag == "--set":
                unset = [v for v in values if not _has_value(self.helm_values, v.partition("=")[0])]
                if unset:
                    return f"{command!r}: the demo's values set none of {unset}"
            elif theirs[1].get(flag) != values:
                return f"{command!r}: the demo passes {flag} {theirs[1].get(flag)}, not {values}"
        if "--namespace" not in ours[1]:
            return f"{command!r}: the demo installs into --namespace {theirs[1]['--namespace']}"
        return None

    def kubectl_command(self, command: str, args: list[str]) -> str | None:
        if args and args[0] == "port-forward":
            return self.port_forward(command, args[1:])
        for theirs in self.kubectl:
            if len(theirs) == len(args) and all(t == a or (t is ANY and not a.startswith("-"))
                                                  for t, a in zip(theirs, args, strict=True)):
                if args[:2] == ["apply", "-f"]:
                    self.applied.append(REPO / args[2])
                return None
        return f"{command!r}: not a kubectl command devcluster/demo.py or demo_node.py runs"

    def port_forward(self, command: str, args: list[str]) -> str | None:
        if len(args) != 2 or not args[0].startswith("svc/") or not re.fullmatch(r"\d+:\d+", args[1]):
            return f"{command!r}: expected `kubectl port-forward svc/NAME LOCAL:PORT`"
        service, (local, port) = args[0].removeprefix("svc/"), args[1].split(":")
        for example in self.applied:
            children = [d for d in yaml.safe_load_all(render.render(example.read_text())) if d]
            cr = yaml.safe_load(example.read_text())
            for child in children:
                if child["kind"] == "Service" and child["metadata"]["name"] == service:
                    if service != names.router_name(cr["metadata"]["name"]):
                        return f"{command!r}: {service} is not {example.name}'s router"
                    if int(port) not in [p["port"] for p in child["spec"]["ports"]]:
                        return f"{command!r}: the router Service has no port {port}"
                    self.forwarded[local] = example
                    return None
        return f"{command!r}: no example applied above has a Service {service}"

    def curl(self, command: str, args: list[str]) -> str | None:
        urls, headers, data = [], [], []
        it = iter(args)
        for a in it:
            if a == "-s":
                continue
            if a == "-H":
                headers.append(next(it, ""))
            elif a == "-d":
                data.append(next(it, ""))
            elif a.startswith("-"):
                return f"{command!r}: the demo's request has no {a}"
            else:
                urls.append(a)
        m = re.fullmatch(r"(?:http://)?localhost:(\d+)(/\S*)", urls[0]) if len(urls) == 1 else None
        if m is None or m.group(1) not in self.forwarded:
            return f"{command!r}: not a request to a router port-forwarded above"
        example, path = self.forwarded[m.group(1)], m.group(2)
        demo_source = ast.parse(inspect.getsource(demo_engines))
        if path not in {n.value for n in ast.walk(demo_source) if isinstance(n, ast.Constant)}:
            return f"{command!r}: the demo posts to no {path}"
        demo_headers = {f"{k.value}: {v.value}" for n in ast.walk(demo_source) if isinstance(n, ast.Dict)
                        for k, v in zip(n.keys, n.values, strict=True)
                        if isinstance(k, ast.Constant) and k.value == "Content-Type" and isinstance(v, ast.Constant)}
        if not set(headers) <= demo_headers:
            return f"{command!r}: the demo sends {demo_headers}, not {headers}"
        if len(data) != 1:
            return f"{command!r}: expected one JSON body"
        body = json.loads(data[0])
        keys = _demo_body_keys() | {"stream"}  # stream() adds it
        if not set(body) <= keys:
            return f"{command!r}: the demo's request has no {sorted(set(body) - keys)}"
        model = yaml.safe_load(example.read_text())["spec"]["model"]["name"]
        if body.get("model") != model:
            return f"{command!r}: {example.name} serves the model {model!r}"
        return None


def _demo_body_keys() -> set[str]:
    fn = ast.parse(inspect.getsource(demo_engines.traced_request))
    [body] = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "body" for t in n.targets)]
    assert isinstance(body, ast.Dict)
    return {k.value for k in body.keys if isinstance(k, ast.Constant)}


@pytest.fixture
def checker(tmp_path, monkeypatch) -> Checker:
    argv, values = demo_helm_install(tmp_path, monkeypatch)
    return Checker(argv, values)


# -- the tests ------------------------------------------------------------------------------------------------------
def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move the detail into docs/"


def test_every_command_the_readme_gives_is_one_the_demo_or_the_tests_run(checker):
    commands = readme_commands(README.read_text())
    assert any(c.startswith("helm install") for c in commands), "the quickstart's helm install is gone"
    assert any(c.startswith("curl") for c in commands), "the quickstart's request is gone"
    assert [p for p in map(checker.problem, commands) if p] == []


def test_the_readme_starts_with_the_two_commands_and_ci_runs_its_test_command():
    first = shell_blocks(README.read_text())[0]
    assert [shlex.split(c, comments=True) for c in first] == [["make", "demo"], ["make", "test"]]
    assert "make test" in ci_commands(), ".ci/run must run the README's test command"


APPLY = "kubectl apply -f manifests/examples/qwen3-32b-p5en.yaml"
FORWARD = "kubectl port-forward svc/qwen3-32b-router 8000:8000"


@pytest.mark.parametrize("commands", [
    ["make test-engines"],
    ["make nothing-such"],
    ["helm install disagg charts/other --namespace disagg-system"],
    ["helm install disagg charts/disagg-operator --namespace elsewhere"],
    ["helm install disagg charts/disagg-operator --namespace disagg-system --set image.nothing=1"],
    ["kubectl delete namespace disagg-system"],
    ["kubectl apply -f manifests/examples/llama-trn2.yaml"],
    ["kubectl get dinf qwen3-32b -w"],
    [APPLY, "kubectl port-forward svc/qwen3-32b-rendezvous 8000:8080"],
    [APPLY, "kubectl port-forward svc/qwen3-32b-router 8000:9999"],
    ["kubectl port-forward svc/qwen3-32b-router 8000:8000"],  # nothing applied
    [APPLY, FORWARD, "curl -s localhost:8000/v1/completions -d '{\"model\": \"tiny\", \"prompt\": \"x\"}'"],
    [APPLY, FORWARD, "curl -s localhost:8000/v1/embeddings -d '{\"model\": \"Qwen/Qwen3-32B\", \"input\": \"x\"}'"],
    [APPLY, FORWARD, "curl -s localhost:8001/v1/completions -d '{\"model\": \"Qwen/Qwen3-32B\", \"prompt\": \"x\"}'"],
    [APPLY, FORWARD, "curl -s localhost:8000/v1/completions -H 'Authorization: x' "
                     "-d '{\"model\": \"Qwen/Qwen3-32B\", \"prompt\": \"x\"}'"],
    [APPLY, FORWARD, "curl -s localhost:8000/v1/completions -d '{\"model\": \"Qwen/Qwen3-32B\", \"tools\": []}'"],
    ["docker build -t registry/disagg .", ],
    ["kubectl get dinf qwen3-32b && kubectl get pods"],
])
def test_a_command_the_demo_does_not_run_is_caught(checker, commands):
    assert [p for p in map(checker.problem, commands) if p], f"{commands} passed"


def test_inline_commands_are_checked_too():
    text = "Run `make test-engines` or `kubectl get pods`; the `cpu` profile and `dinf` are not commands.\n" \
           "```yaml\n`make ignored`\n```\n"
    assert inline_commands(text) == ["make test-engines", "kubectl get pods"]


# -- links -------------------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


OWN_DOCS = [README, *sorted((REPO / "docs").glob("*/*.md")), REPO / "docs" / "results.md",
            REPO / "docs" / "benchmarks.md"]


@pytest.mark.parametrize("page", OWN_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == []
