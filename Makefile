# Two commands do all the setup on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Explain in two sentences what a paged KV cache is.

.PHONY: run chat test lint bench-cpu clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: on this CPU machine 2.13.0 is the local CPU wheel; an unpinned torch
	# would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "numpy<2.3" triton==3.6.0 -e ".[worker,gateway,test,bench]"
	touch $(STAMP)

# The main job: a broker, a worker on the embedded SmolLM2-135M-Instruct and the OpenAI-compatible HTTP
# gateway on http://127.0.0.1:8000/v1 (Ctrl-C stops them all).
run: $(STAMP)
	$(VENV)/bin/tokenmill serve --workers 1

# One answer from the embedded model, in-process.
chat: $(STAMP)
	$(VENV)/bin/tokenmill chat "$(PROMPT)"

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy protocol broker worker kernels client gateway cli benchmarks

# -P: the working directory stays off sys.path, where kernels/ would shadow Hugging Face's `kernels` package that
# transformers imports (tests/conftest.py says more)
bench-cpu: $(STAMP)
	$(PY) -P -m tokenmill.benchmarks.engine_cpu --out benchmarks/results/cpu
	$(PY) -P -m tokenmill.benchmarks.suite --device cpu --out benchmarks/results/cpu

clean:
	rm -rf $(VENV) build *.egg-info
