# Two commands do all the set-up from a fresh clone (see README):
#   make swarm   a 3-node local swarm on the built-in model and data
#   make test    the test suite
# Both create .venv on first use. TORCH_SPEC pins torch: on a CPU host with a local
# wheel (find-links) pip takes the CPU build; on a GPU host PyPI's Linux wheel is the
# CUDA build. Set TORCH_INDEX to pick another build, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
NODES ?= 3
ROUNDS ?= 8
BIN := $(VENV)/bin

.PHONY: setup swarm test lint monitoring docs bench proto clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

swarm: setup
	$(BIN)/dtnode local --nodes $(NODES) --max-rounds $(ROUNDS)

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy -p dtnode.daemon -p dtnode.peers -p dtnode.ops
	$(BIN)/lint-imports

# the Prometheus files, with promtool (Debian's `prometheus` package): the scrape config and the
# rules it loads check, and every alert's unit tests (deploy/prometheus/alerts_test.yml) pass
monitoring:
	promtool check config deploy/prometheus/prometheus.yml
	promtool check rules deploy/prometheus/alerts.yml
	promtool test rules deploy/prometheus/alerts_test.yml

# the documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or a page left out
# of the navigation fails it
docs: setup
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	$(BIN)/python -m tests.bench.allreduce

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) *.egg-info
