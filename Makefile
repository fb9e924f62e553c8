# fusecli: everything a fresh Debian 12 machine needs is set up from here.
#   make demo   - venv + install + custom-op library + optimize a shipped sample
#   make test   - the same set-up, then the linters and the whole test suite (parallel)
#   make test-fast - engine, rules and API tests without onnxruntime sessions (the edit loop)
#   make docs   - regenerate docs/ops.md from the op contracts
#   make lib-arm64 - cross-build the ARM64 library (build/aarch64/libfusecli_ops.so; docs/arm64.md)
#   make test-arm64 - the kernel tests and fused torch-joint graphs on ARM64 under qemu (docs/arm64.md)
#   make lint   - ruff (Python) and clang-format --dry-run (C++/CUDA); make format fixes the C++
# The library is built by the package's build hook (setup.py -> scripts/build_lib.sh) when the
# venv installs fusecli (editable); `make lib` reruns the same script after C++ edits.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
ORTT_VENV := .venv-ortt
LIB := fusecli/lib/libfusecli_ops.so
# the C++/CUDA sources clang-format checks (.clang-format): shared code and every op folder
CXX_SOURCES = $(shell find fusecli/csrc fusecli/ops -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort)

.PHONY: demo test test-fast fuzz lint format venv lib lib-arm64 test-arm64 arm64-deps ortt-env system-deps samples corpus bench docs clean

$(VENV)/.installed: pyproject.toml setup.py scripts/constraints.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c scripts/constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

lib: venv
	bash scripts/build_lib.sh

# ARM64: Debian's cross compiler and qemu-user-static (apt-get, as system-deps does), the cross
# build (same script, same sources), and the tests under emulation (scripts/test_arm64.sh)
arm64-deps:
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64-static >/dev/null || \
		{ echo "installing g++-aarch64-linux-gnu qemu-user-static (apt-get)"; apt-get update -q && \
		apt-get install -y -q --no-install-recommends g++-aarch64-linux-gnu qemu-user-static; }

lib-arm64: venv arm64-deps
	FUSECLI_ARCH=aarch64 bash scripts/build_lib.sh

test-arm64: venv arm64-deps
	bash scripts/test_arm64.sh

ortt-env: $(ORTT_VENV)/.installed

# programs the tests need from Debian (docs/install.md "Dependencies, and why"): Graphviz's `dot` lays out
# `fusecli report`'s drawings; headless `chromium` opens the report in the browser test. Installed
# with apt-get when missing (CI runs as root on Debian 12); as a user, sudo apt-get install them.
SYSTEM_PROGRAMS := dot:graphviz chromium:chromium
system-deps:
	@missing=""; for pp in $(SYSTEM_PROGRAMS); do command -v $${pp%%:*} >/dev/null || \
		missing="$$missing $${pp#*:}"; done; \
	if [ -n "$$missing" ]; then echo "installing$$missing (apt-get)"; \
		apt-get update -q && apt-get install -y -q --no-install-recommends$$missing; fi

$(ORTT_VENV)/.installed: scripts/ortt-requirements.txt
	$(PY) -m venv $(ORTT_VENV)
	$(ORTT_VENV)/bin/python -m pip install -q -r scripts/ortt-requirements.txt
	touch $@

demo: venv lib
	@mkdir -p out
	$(VENV)/bin/fusecli optimize samples/torch_block.onnx -o out/torch_block.fused.onnx --verify

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: venv
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# pytest-xdist spreads the suite over the cores (-n auto; PYTEST_WORKERS=1 for one); the 25
# slowest tests are listed at the end. No test asserts a time (`timing` tests run under `make
# bench`): the same commit gives the same result on a loaded machine. pytest's exit code (5: no
# test ran) is make's.
PYTEST_WORKERS ?= auto
test: venv lib ortt-env system-deps lint
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 -m "not timing" \
		tests fusecli/ops

# under a minute: the engine (graph index, matcher, rules language, rewrite, shape guard), the
# rule files, rule drafting, the op folders' facts and the package's layering; no kernel is
# built and no model is run in onnxruntime
FAST_TESTS = tests/test_layers.py tests/test_rule_loading.py tests/test_rulegen.py tests/test_search.py \
	tests/test_op_folders.py tests/test_docs.py
test-fast: venv
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS) $(FAST_TESTS)

# the property tests exploring: a random seed and FUZZ_EXAMPLES examples per property (`make test`
# runs them derandomized, a fixed set; docs/testing.md). Run before each closing note.
FUZZ_EXAMPLES ?= 2000
fuzz: venv
	FUSECLI_HYPOTHESIS_PROFILE=fuzz FUSECLI_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
		$(VPY) -m pytest -q -n $(PYTEST_WORKERS) tests/test_property.py

samples:
	bash scripts/make_samples.sh

# corpus of real third-party architectures (not part of `make test`; see docs/corpus.md)
corpus: venv
	bash scripts/corpus/make_corpus.sh

# the generated documentation: docs/ops.md from the op contracts (tests/test_docs.py checks it)
docs: venv
	$(VPY) -m fusecli.ops.docs

# first the harness check (a graph against itself comes out at ~1.0x: tests marked timing), alone
bench: venv lib ortt-env
	$(VPY) -m pytest -q -m timing tests
	$(VPY) -m fusecli.bench.suite --out BENCHMARKS.md

clean:
	rm -rf build dist out fusecli/lib/*.so
