# `make test`: the main suite (simulated engines, no GPU, no vLLM). `make e2e`: the same Coordinator against
# real vLLM engines (tests/e2e; docs/e2e.md says what it proves and how long it takes).
PYTHON ?= python

.PHONY: test e2e

test:
	$(PYTHON) -m pytest -q

e2e:
	bash tests/e2e/vllm_up.sh $(PYTHON) -m pytest -q -m vllm -p no:cacheprovider tests/e2e
