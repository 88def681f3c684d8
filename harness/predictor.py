"""Teaching the learned model (scheduling/predict.py) an engine's speed without serving anything: timed
prefills and decodes, replayed as if observed long ago, so no virtual queue is left now."""

from __future__ import annotations

import time

from scheduling.predict import Predictor


def teach_prefill(pred: Predictor, slot: int, tokens_per_s: float, base_s: float = 0.01, samples: int = 12) -> None:
    """Observed prefills on `slot`, one after another, long ago: `base_s` plus a token every 1/tokens_per_s."""
    t = time.monotonic() - 200
    for k in range(samples):
        tokens = 200 + 400 * (k % 5)
        predicted, shift = pred.start_prefill(slot, tokens, t)
        done = t + base_s + tokens / tokens_per_s
        pred.learn_prefill(slot, t, done, tokens, predicted, shift)
        t = done + 1.0


def teach_decode(
    pred: Predictor, slot: int, step_s: float, per_seq_s: float, batches: tuple[int, ...] = tuple(range(1, 9))
) -> None:
    """Observed decodes on `slot`, twice at every batch size of `batches`, long ago: a step lasts `step_s`
    plus `per_seq_s` per running sequence."""
    t = time.monotonic() - 200
    for b in list(batches) * 2:
        first = t + 0.02 + step_s + per_seq_s * b
        done = first + (step_s + per_seq_s * b) * 40
        pred.learn_decode(slot, t, first, done, 43, float(b))
        t = done + 1.0
