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

.PHONY: demo test test-engines test-fast venv binaries vllm

demo: venv binaries vllm
	$(BIN)/disagg demo

# Everything: unit, real-apiserver integration, wheel/image, and the real-engine data-plane suite.
test: venv binaries vllm
	$(BIN)/pytest

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

binaries: venv
	$(BIN)/disagg cluster build

vllm: venv
	$(BIN)/python -m disagg.devcluster.vllm_env
