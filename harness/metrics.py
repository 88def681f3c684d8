"""Reading a Coordinator's Prometheus page in tests: one labelled counter's values."""

from __future__ import annotations

from harness.loopback import CLIENT


def by_label(coord, metric: str, label: str) -> dict[str, float]:
    """{value of `label`: sample} for every sample of `metric` on the observability port's /metrics."""
    out = {}
    for line in CLIENT.get(coord.obs + "/metrics").text.splitlines():
        if line.startswith(metric + "{"):
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[value] = float(line.rsplit(" ", 1)[1])
    return out
