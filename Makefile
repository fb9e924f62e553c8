# fusecli: everything a fresh Debian 12 machine needs is set up from here.
#   make demo   - venv + install + custom-op library + optimize a shipped sample
#   make test   - the same set-up, then the linters and the whole test suite
# The library is built by the package's build hook (setup.py -> scripts/build_lib.sh) when the
# venv installs fusecli (editable); `make lib` reruns the same script after C++ edits.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
ORTT_VENV := .venv-ortt
LIB := fusecli/lib/libfusecli_ops.so

.PHONY: demo test lint venv lib ortt-env samples bench clean

$(VENV)/.installed: pyproject.toml setup.py scripts/constraints.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c scripts/constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

lib: venv
	bash scripts/build_lib.sh

ortt-env: $(ORTT_VENV)/.installed

$(ORTT_VENV)/.installed: scripts/ortt-requirements.txt
	$(PY) -m venv $(ORTT_VENV)
	$(ORTT_VENV)/bin/python -m pip install -q -r scripts/ortt-requirements.txt
	touch $@

demo: venv lib
	@mkdir -p out
	$(VENV)/bin/fusecli optimize samples/torch_block.onnx -o out/torch_block.fused.onnx --verify

lint: venv
	$(VENV)/bin/ruff check .

test: venv lib ortt-env lint
	$(VPY) -m pytest -q tests fusecli/ops

samples:
	bash scripts/make_samples.sh

bench: venv lib ortt-env
	$(VPY) -m fusecli.bench.suite --out BENCHMARKS.md

clean:
	rm -rf build dist out fusecli/lib/*.so
