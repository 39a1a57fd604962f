# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv here, install torch==2.13.0 exactly (an unpinned torch pulls
# gigabytes of CUDA packages), then this package with its test extra.

PY      := .venv/bin/python
STAMP   := .venv/.nbrpc-installed
# .venv's own torch, exactly: the CPU build on this machine's disk
VENV_TORCH := 2.13.0
# The torch releases nbrpc supports (nbrpc/_torch/versions.py says the same, and
# pyproject.toml admits exactly these; tests/unit/test_torch_range.py checks all three).
# make test also runs the newest in a second virtualenv; moving it is a commit.
TORCH_OLDEST := 2.11.0
TORCH_NEWEST := 2.14.1
# make test-torch TORCH=2.11.0: another release of the range (the newest unless given)
TORCH   ?= $(TORCH_NEWEST)
# The browser test drives Debian's Chromium; Playwright never downloads a browser here.
CHROMIUM := /usr/bin/chromium
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv demo docs test test-torch lint notebooks package-check bench bench-sizes compat clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(VENV_TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/run_notebook.py notebooks/01_quickstart.ipynb

lint: $(STAMP)
	$(PY) -m ruff check nbrpc tests tools benchmarks notebooks docs/conf.py
	$(PY) -m ruff format --check nbrpc tests tools benchmarks notebooks docs/conf.py
	$(PY) tools/check_notebooks.py
	$(PY) -m mypy nbrpc

# The documentation site (docs/site.md says how and why): build/docs, from docs/*.md, the
# docstrings of nbrpc.__all__ and its sub-packages, each magic's argument parser, and the
# tutorials with the outputs of their nbval run. make test's pytest run keeps those in
# build/executed-notebooks (tests/notebook_outputs.py) and builds the site after it. Run
# alone, `make docs` first runs the tutorials whose executed copy is missing or holds other
# code than notebooks/, the same way (pytest --nbval-lax, tests/conftest.py as a plugin; all
# ten: about 3.5 minutes here); then Sphinx, warnings as errors (tools/docs_site.py).
docs: $(STAMP)
	$(PY) tools/docs_site.py

# The tutorials' source is notebooks/*.py (jupytext percent format); sync each .ipynb with
# it after editing either one (the newer file wins).
notebooks: $(STAMP)
	$(PY) -m jupytext --sync notebooks/*.py

$(CHROMIUM):
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium

# The multi-host tests build fake hosts (network namespaces, each with its own sshd): that
# needs root, so only root installs openssh-server here (elsewhere those tests skip and say
# so). No service is started: a policy-rc.d stops the package's sshd on every interface.
SSHD    := /usr/sbin/sshd
SLURMD  := /usr/sbin/slurmd
FAKEHOSTS := $(shell [ "$$(id -u)" = 0 ] && echo $(SSHD) $(SLURMD))

$(SSHD):
	apt-get update -q
	if [ -e /usr/sbin/policy-rc.d ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server; \
	else \
	  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server; \
	  status=$$?; rm -f /usr/sbin/policy-rc.d; exit $$status; \
	fi

# The Slurm tests run a real Slurm on the fake hosts (tools/fakeslurm.py): Debian's daemons,
# client and munge, installed as root without starting any service (as for openssh-server).
$(SLURMD):
	apt-get update -q
	if [ -e /usr/sbin/policy-rc.d ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    slurmctld slurmd slurm-client munge; \
	else \
	  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    slurmctld slurmd slurm-client munge; \
	  status=$$?; rm -f /usr/sbin/policy-rc.d; exit $$status; \
	fi

# The wheel, installed as a user would (a fresh virtualenv: torch, then the wheel, no test
# extra): a call and %load_ext nbrpc must work there, and print no warning.
PKG := build/package-check
package-check: $(STAMP)
	rm -rf $(PKG)
	$(PY) -m pip wheel -q --no-deps -w $(PKG) .
	python3 -m venv $(PKG)/venv
	$(PY) tools/package_check.py --link-torch $(PKG)/venv  # = pip install torch==$(VENV_TORCH) there, faster
	$(PKG)/venv/bin/python -m pip install -q --no-compile $(PKG)/nbrpc-*.whl
	cd $(PKG) && venv/bin/python $(CURDIR)/tools/package_check.py

# The site is built after the suite, whose nbval run writes the tutorials' outputs, and its
# browser test runs after the build (so it is left out of the first run). Each pytest run
# fails if it left a process or a file behind (tests/leftovers.py; alone, pytest only warns).
# The suite runs on TEST_WORKERS pytest-xdist workers, 2 by default: its tests wait on
# processes more than they compute (one run used 37 % of this machine's two cores), and
# pytest takes 13-14 minutes instead of 22-25. Three workers take 11-12 minutes on two
# cores, but with a busy core beside them a stop button's bound broke (5.7 s of 5, one
# run, 2026-11-30): tests/README.md. Each module stays on one worker, in its
# order, and the fake hosts' modules share one (tests/conftest.py: _group_of); the seconds
# of each group are printed at the end. TEST_WORKERS=0 runs the suite in this process, one
# test at a time (tests/README.md: the failures two workers found, and their causes).
# A worker that crashes (a test past its timeout ends its process) ends the run: xdist's
# replacement of it got no work and the run waited for good.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --max-worker-restart 0
test: $(STAMP) $(CHROMIUM) $(FAKEHOSTS) lint package-check
	rm -f build/test-seconds.jsonl  # each pytest run's seconds by test, a line each
	$(PY) -m pytest tests --nbval-lax notebooks --ignore=tests/test_docs_site.py -v -rs --durations=20 \
	  $(XDIST) --leftovers=fail
	$(MAKE) --no-print-directory docs
	$(PY) -m pytest tests/test_docs_site.py -v -rs --leftovers=fail
	$(MAKE) --no-print-directory test-torch TORCH=$(TORCH_NEWEST)

# Another torch of the supported range, as a user who has it installs nbrpc beside it: a
# second virtualenv (.venv-torch-VERSION, reused while VERSION stays; what it shares with
# .venv is hard-linked, torch and its CUDA libraries come from the package index), then the
# seam's pins, the unit tests, the compatibility tier's make test part, a cluster smoke
# test, a script's quiet shutdown and a tutorial there. docs/compatibility.md has the
# results per release.
TORCH_VENV  = .venv-torch-$(TORCH)
TORCH_TESTS := tests/unit tests/test_torch_seam.py tests/test_smoke.py tests/test_torch_compat.py \
	tests/test_output.py::test_a_scripts_shutdown_and_restart_are_quiet_and_its_stderr_stays_its_own
TORCH_NOTEBOOK := notebooks/02_distributed_autograd.ipynb
test-torch: $(STAMP)
	$(PY) tools/torch_venv.py $(TORCH_VENV) $(TORCH)
	$(TORCH_VENV)/bin/python -m pytest $(TORCH_TESTS) --nbval-lax $(TORCH_NOTEBOOK) -q -rs --leftovers=fail \
	  $(XDIST) \
	  -p no:nbrpc-notebook-outputs  # the site shows .venv's run of the tutorials

bench: $(STAMP)
	$(PY) benchmarks/run.py

# every tensor size from 1 KB to 256 MB against the plain torch script (make bench runs it too)
bench-sizes: $(STAMP)
	$(PY) benchmarks/sizes.py

# torch's own RPC test classes on nbrpc clusters (docs/compatibility.md): the whole tier,
# about 12 min on 2 cores (expecttest, which torch's test classes import, is in the extra)
compat: $(STAMP)
	$(PY) tools/compat.py --out docs/compatibility-results.md

# One Jupyter kernel, a seeded random mix of what a person does, for MINUTES; figures every
# minute in build/soak (figures.jsonl, soak.png, report.json), the bounds of docs/soak.md
# checked at the end (non-zero: a check failed, a finding, or a bound broken).
# SEED=N repeats a run's choices.
MINUTES ?= 20
SEED    ?=
soak: $(STAMP)
	$(PY) tools/soak.py --minutes $(MINUTES) $(if $(SEED),--seed $(SEED)) --out build/soak

clean:
	rm -rf .venv .venv-torch-* build *.egg-info test-artifacts
