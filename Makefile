# The Python environment is per checkout (.venv): an editable install shared between clones would silently
# point every clone at whichever one installed last. pip's own cache keeps a fresh clone's install short.
# Caches live outside the clone so repeated runs (and CI's fresh clones) reuse them:
#   $(DISAGG_CACHE)/bin    control-plane binaries built from Go modules
#   $(DISAGG_CACHE)/vllm-venv  real vLLM (CPU) for the demo and engine tests, apart from the operator's environment
#   Go's own module and build caches (go env GOMODCACHE GOCACHE)
DISAGG_CACHE ?= $(HOME)/.cache/disagg
export DISAGG_CACHE
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin

.PHONY: host-packages demo test test-engines test-fast test-unit check lint typecheck imports tree generate venv binaries vllm images

demo: venv binaries vllm
	$(BIN)/disagg demo

# Everything: the static checks, then unit, real-apiserver integration, wheel/image and the real-engine suite.
test: check binaries vllm
	$(BIN)/pytest

# Only the pure tests: no cluster, no engines, no wheel.
test-unit: venv
	$(BIN)/pytest -m "not engines and not cluster and not image" tests/unit

# Lint, types and the import contracts (pyproject.toml), as CI runs them.
check: lint typecheck imports

lint: venv
	$(BIN)/ruff check .

# mypy and import-linter cannot follow the editable install's folder mapping (operator/ is disagg.operator),
# so they read the package through a tree of links with the installed layout.
TREE := $(CURDIR)/build/typecheck
typecheck: venv tree
	MYPYPATH=$(TREE) $(BIN)/mypy -p disagg

imports: venv tree
	PYTHONPATH=$(TREE) $(BIN)/lint-imports

tree:
	@rm -rf $(TREE) && mkdir -p $(TREE)/disagg
	@for d in operator connector devcluster compare; do ln -s $(CURDIR)/$$d $(TREE)/disagg/$$d; done
	@ln -s $(CURDIR)/cli/cli.py $(TREE)/disagg/cli.py

# Everything generated from the typed models: the CRDs (and the chart's copy) and the kustomize install.
generate: venv binaries
	$(BIN)/python -m disagg.operator.crdgen
	$(BIN)/python manifests/install/generate.py

# Only the real-engine data-plane suite (push and pull P/D through the router, the connector plugin).
test-engines: venv binaries vllm
	$(BIN)/pytest -m engines tests/engines

# Everything but the engines (no vLLM environment needed).
test-fast: venv binaries
	$(BIN)/pytest -m "not engines"

# The editable install is redone every time: cheap when nothing changed, and it picks up new dependencies.
venv:
	@test -x $(BIN)/python || python3 -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'

# Debian packages the real node needs: libseccomp-dev and pkg-config (runc's seccomp support is cgo), debootstrap
# (the images' base filesystem), iptables (kube-proxy and the CNI bridge's masquerading). Installed once, as root.
HOST_PACKAGES := libseccomp-dev pkg-config debootstrap iptables
host-packages:
	@missing=$$(for p in $(HOST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "installing $$missing"; \
	  apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; fi

binaries: venv host-packages
	$(BIN)/disagg cluster build

vllm: venv
	$(BIN)/python -m disagg.devcluster.vllm_env

# The real node's container images (devcluster/images), cached by their inputs. Needs root and debootstrap
# (apt-get install debootstrap).
images: venv binaries
	$(BIN)/python -m disagg.devcluster.images build
