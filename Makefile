# make run   - the main job: the end-to-end demo (a tiny MoE preset, 4 x 16K context, every policy)
# make bench - the CPU attention benchmark (JSON + table)
# make test  - lint and the test suite
# Both create .venv when missing and install torch==2.13.0 (the local CPU build) before the project.

VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
SOURCES := pyproject.toml setup.py $(wildcard cpp/src/* cpp/include/writescope/*)

.PHONY: run test bench lint clean

run: $(INSTALLED)
	$(PYTHON) tools/demo.py --out bench_results/demo.json

bench: $(INSTALLED)
	$(PYTHON) tools/bench_cpu_attention.py --out bench_results/cpu_attention.json

test: $(INSTALLED) lint
	$(PYTHON) -m pytest -q

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

$(PYTHON):
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip

# Rebuilt whenever the build files or the C++ sources change.
$(INSTALLED): $(PYTHON) $(SOURCES)
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	touch $(INSTALLED)

clean:
	rm -rf build *.egg-info core/_cpu*.so
