# jax_moe developer entry points. `make demo` and `make test` work on a fresh Debian/Ubuntu machine
# (as root or through sudo): they run `install` first, which only installs what is missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PKGS := build-essential cmake pkg-config ninja-build libfabric-dev libfabric-bin libibverbs-dev
PY_DEPS := "jax>=0.10.2" "jaxlib>=0.10.2" numpy flax optax absl-py tqdm matplotlib nanobind scikit-build-core pytest
PYTEST_ARGS ?=

.PHONY: install system-deps venv build demo train decode test test-gpu bench clean

install: system-deps venv build

system-deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	$(PYTHON) -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
	  || missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "make install: apt-get install$$missing"; \
	  { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; } || \
	  echo "make install: could not install$$missing (offline?); building without what is missing (libfabric and libibverbs are optional)"; \
	fi

# --system-site-packages: on machines that ship jax (the GPU machine) the preinstalled build is used.
venv:
	@[ -x $(VPY) ] || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(VPY) -c 'import jax, flax, optax, absl, tqdm, matplotlib, nanobind, scikit_build_core, pytest' 2>/dev/null \
	  || $(VPY) -m pip install -q --upgrade pip $(PY_DEPS)

build:
	@$(VPY) -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
	@$(VPY) -c 'import jax_moe._core as c; print("jax_moe._core:", c.build_info())'

demo: install
	$(VPY) examples/train_moe.py --steps 150 --out runs/demo
	$(VPY) examples/decode_moe.py --checkpoint runs/demo --max_new_tokens 120

test: install
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests

test-gpu: install
	$(VPY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

bench: install
	$(VPY) -m jax_moe.bench moe

clean:
	rm -rf build runs bench_out
