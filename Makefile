# Caches live outside the clone so repeated runs (and CI's fresh clones) reuse them:
#   $(DISAGG_CACHE)/venv   the Python environment
#   $(DISAGG_CACHE)/bin    control-plane binaries built from Go modules
#   $(DISAGG_CACHE)/vllm-venv  real vLLM (CPU) for the demo and engine tests, apart from the operator's environment
#   Go's own module and build caches (go env GOMODCACHE GOCACHE)
DISAGG_CACHE ?= $(HOME)/.cache/disagg
export DISAGG_CACHE
VENV := $(DISAGG_CACHE)/venv
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

# The editable install is redone every time because the venv is shared between clones.
venv:
	@test -x $(BIN)/python || python3 -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'

binaries: venv
	$(BIN)/disagg cluster build

vllm: venv
	$(BIN)/python -m disagg.devcluster.vllm_env
