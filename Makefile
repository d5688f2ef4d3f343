# The two commands a new machine needs: `make run` and `make test`.
# Both create .venv and install what is needed on first use.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# vLLM for the CPU needs torch==2.13.0+cpu: found locally on these machines; elsewhere set
# TORCH_INDEX to PyTorch's CPU wheel index (see README).
TORCH_INDEX ?=
PIP_EXTRA   := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: run test lint typecheck docs unit browser bench audit model clean vendor

# The console's browser tests (tests/console, marker `browser`) drive Debian's chromium with Playwright's
# Python package (in the dev extra); Playwright's own browser download is never used.
CHROMIUM_STAMP := $(VENV)/.chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The example plugin is installed as a package (not editable): a change to it must reinstall it.
$(STAMP): pyproject.toml tests/example_plugin/pyproject.toml $(wildcard tests/example_plugin/gateway_example_plugin/*.py)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip wheel
	$(PY) -m pip install $(PIP_EXTRA) -e '.[engine,dev]'
	# PyPI's torchvision (and torchaudio, torchcodec) break transformers imports beside the CPU torch;
	# text models need none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	# A third-party plugin package, for the test that plugins are found through entry points.
	$(PY) -m pip install ./tests/example_plugin
	touch $(STAMP)

$(CHROMIUM_STAMP): $(STAMP)
	command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)
	touch $(CHROMIUM_STAMP)

# The console's charting library, uPlot (MIT), fetched from the npm registry at build time and copied
# into the console's static folder (gitignored): served from this origin, so the strict CSP holds and
# nothing is downloaded at run time. The tarball is checked against its pinned SHA-256.
UPLOT_VERSION := 1.6.32
UPLOT_SHA256  := 4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d
VENDOR_DIR    := gateway/server/console/static/vendor
UPLOT_STAMP   := $(VENDOR_DIR)/.uplot-$(UPLOT_VERSION)

$(UPLOT_STAMP):
	command -v npm >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y npm)
	rm -rf $(VENDOR_DIR) .cache/uplot && mkdir -p $(VENDOR_DIR) .cache/uplot
	cd .cache/uplot && npm pack --silent uplot@$(UPLOT_VERSION)
	echo "$(UPLOT_SHA256)  .cache/uplot/uplot-$(UPLOT_VERSION).tgz" | sha256sum -c -
	tar -xzf .cache/uplot/uplot-$(UPLOT_VERSION).tgz -C .cache/uplot
	cp .cache/uplot/package/dist/uPlot.iife.min.js .cache/uplot/package/dist/uPlot.min.css \
		.cache/uplot/package/LICENSE $(VENDOR_DIR)/
	touch $(UPLOT_STAMP)

vendor: $(UPLOT_STAMP)

model: $(STAMP)
	$(VENV)/bin/gateway model prepare smollm2

run: $(STAMP) $(UPLOT_STAMP) model
	$(VENV)/bin/gateway serve

lint: $(STAMP)
	$(VENV)/bin/ruff check gateway plugins tests bench docs/hooks
	$(VENV)/bin/ruff format --check gateway plugins tests bench docs/hooks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site, built strictly: a broken link or anchor, a missing included file or any other
# warning fails the build (and so `make test`). Output in .site/ (gitignored).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .site

test: $(STAMP) $(CHROMIUM_STAMP) $(UPLOT_STAMP) model lint typecheck docs
	$(PY) -m pytest -q -rfEsxX

# The operator console in a real headless browser only; screenshots in .artifacts/console/.
browser: $(STAMP) $(CHROMIUM_STAMP) $(UPLOT_STAMP)
	$(PY) -m pytest -q -m browser tests/console

unit: $(STAMP)
	$(PY) -m pytest -q -m "not engine and not slow"

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/run.py

# Known vulnerabilities in every installed distribution, from PyPI's advisory data (needs pypi.org).
# --strict fails when a package cannot be looked up, instead of printing "No known vulnerabilities
# found" over skipped packages. Not looked up: this project (editable), the test-only example plugin,
# and local version labels (torch 2.13.0+cpu is audited as torch 2.13.0).
audit: $(STAMP)
	$(PY) -m pip freeze --all --exclude-editable --exclude gateway-example-plugin \
		| sed 's/+[A-Za-z0-9.]*$$//' > $(VENV)/audit-requirements.txt
	$(VENV)/bin/pip-audit --strict --disable-pip --no-deps -r $(VENV)/audit-requirements.txt

clean:
	rm -rf $(VENV) $(VENDOR_DIR) models .site .mypy_cache .ruff_cache .pytest_cache .artifacts
