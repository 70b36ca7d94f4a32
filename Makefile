# Caches live outside the clone so repeated runs (and CI's fresh clones) reuse them:
#   $(DISAGG_CACHE)/venv   the Python environment
#   $(DISAGG_CACHE)/bin    control-plane binaries built from Go modules
#   $(DISAGG_CACHE)/vllm-venv  real vLLM (CPU) for the engine tests, apart from the operator's environment
#   Go's own module and build caches (go env GOMODCACHE GOCACHE)
DISAGG_CACHE ?= $(HOME)/.cache/disagg
export DISAGG_CACHE
VENV := $(DISAGG_CACHE)/venv
BIN := $(VENV)/bin

.PHONY: demo test test-engines venv binaries vllm

demo: venv binaries
	$(BIN)/disagg demo

test: venv binaries
	$(BIN)/pytest -m "not engines"

# Real vLLM engines (push and pull P/D through the router). Not yet part of `make test`: on vLLM 0.32 the
# first push request of a fresh prefill/decode pair can wait for KV until the timeout when the lazy NIXL
# handshake loses the race against prefill (see the README's router section); pre-warming the handshake is
# the connector plugin's job.
test-engines: venv binaries vllm
	$(BIN)/pytest -m engines tests/engines

# The editable install is redone every time because the venv is shared between clones.
venv:
	@test -x $(BIN)/python || python3 -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'

binaries: venv
	$(BIN)/disagg cluster build

vllm: venv
	$(BIN)/python -m disagg.devcluster.vllm_env
