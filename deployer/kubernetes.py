"""What the Kubernetes API server accepts in the objects the deployer renders: names, labels, quantities,
node selectors, tolerations. The deployer refuses in advance what `kubectl apply` would refuse.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from config import adapter, refusal
from config.sections import Int, Str

from .sections import ResourceSpec, quoted

# Every pattern is applied with fullmatch: `$` would also match before a final newline.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_SUBDOMAIN_MAX = 253  # Kubernetes' limit on object names (Secrets, service accounts) and on DNS names
DNS_SUBDOMAIN_RULE = f"a DNS subdomain: lowercase letters, digits, '-' and '.', at most {DNS_SUBDOMAIN_MAX} characters"
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # fullmatch, at most 63 characters
QUOTA_PREFIX = "requests."  # ResourceQuota's name for a resource's requests
LABEL_VALUE_RULE = "at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
_QUANTITY = re.compile(r"(?P<num>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suf>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
_SUFFIX = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}

NODE_PORT_MIN, NODE_PORT_MAX = 30000, 32767
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


# A Kubernetes Toleration: its fields and their types, and the values the API server accepts.
@dataclass
class Toleration:
    key: Str = ""
    operator: Str = ""
    value: Str = ""
    effect: Str = ""
    tolerationSeconds: Int = 0


TOLERATION_FIELDS = tuple(f.name for f in dataclasses.fields(Toleration))
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= DNS_SUBDOMAIN_MAX and _DNS_SUBDOMAIN.fullmatch(name) is not None


def is_label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and _LABEL_NAME.fullmatch(value) is not None)


def is_label_key(key: str) -> bool:
    """A Kubernetes label key (qualified name): an optional DNS subdomain prefix and '/', then a name."""
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return False
    return name != "" and is_label_value(name)


def is_extended_resource_name(name: str) -> bool:
    """What the API server takes as an extended resource (its IsExtendedResourceName): a label key with a
    prefix, outside the kubernetes.io namespace, that is still one with "requests." in front (the quota name).
    A name without a prefix is a native resource: cpu, memory, ephemeral-storage, hugepages-*."""
    return (
        "/" in name
        and "kubernetes.io/" not in name
        and not name.startswith(QUOTA_PREFIX)
        and is_label_key(QUOTA_PREFIX + name)
    )


def check_node_selector(selector: dict[str, str], path: str, errors: list[str]) -> None:
    """What the API server refuses in a nodeSelector: keys and values are label keys and values."""
    for key, value in selector.items():
        if not is_label_key(key):
            errors.append(
                f"{path}.{key}: not a label key (an optional DNS subdomain prefix and '/', then {LABEL_VALUE_RULE})"
            )
        elif not is_label_value(value):
            errors.append(f"{path}.{key}: not a label value: empty or {LABEL_VALUE_RULE} (got {value!r})")


def check_tolerations(tolerations: list[dict[str, Any]], path: str, errors: list[str]) -> None:
    """What the API server refuses in a pod's tolerations (its validateTolerations)."""
    for i, tol in enumerate(tolerations):
        at = f"{path}[{i}]"
        bad = [
            f"{at}.{name}: unknown key (known: {', '.join(TOLERATION_FIELDS)})"
            for name in tol
            if name not in TOLERATION_FIELDS
        ]
        try:
            adapter(Toleration).validate_python(tol)
        except ValidationError as e:
            bad += [quoted(refusal(error, at)) for error in e.errors(include_url=False)]
        if bad:
            errors.extend(bad)
            continue
        key, value, effect = tol.get("key", ""), tol.get("value", ""), tol.get("effect", "")
        operator = tol.get("operator") or "Equal"  # Kubernetes' default
        if key and not is_label_key(key):
            errors.append(f"{at}.key: not a label key (got {key!r})")
        if operator not in TOLERATION_OPERATORS:
            errors.append(f"{at}.operator: must be one of {', '.join(TOLERATION_OPERATORS)} (got {operator!r})")
        elif not key and operator != "Exists":
            errors.append(f"{at}.operator: must be Exists when key is empty (it then tolerates every taint)")
        elif operator == "Exists" and value:
            errors.append(f"{at}.value: must be empty when operator is Exists (got {value!r})")
        elif not is_label_value(value):
            errors.append(f"{at}.value: not a label value: empty or {LABEL_VALUE_RULE} (got {value!r})")
        if effect and effect not in TAINT_EFFECTS:
            errors.append(
                f"{at}.effect: must be empty (every effect) or one of {', '.join(TAINT_EFFECTS)} (got {effect!r})"
            )
        elif "tolerationSeconds" in tol and effect != "NoExecute":
            errors.append(f"{at}.tolerationSeconds: only with effect NoExecute")


def parse_quantity(text: str) -> float | None:
    m = _QUANTITY.fullmatch(text) if isinstance(text, str) else None
    if not m:
        return None
    return float(m.group("num")) * _SUFFIX[m.group("suf")]


def check_resources(res: ResourceSpec, path: str, errors: list[str]) -> None:
    for part in ("requests", "limits"):
        for name, qty in getattr(res, part).items():
            if name not in ("cpu", "memory", "ephemeral-storage"):
                errors.append(f"{path}.{part}.{name}: only cpu, memory, ephemeral-storage here")
            elif parse_quantity(qty) is None:
                errors.append(f"{path}.{part}.{name}: not a Kubernetes quantity (got {qty!r})")
    for name, req in res.requests.items():
        lim = res.limits.get(name)
        rq, lq = parse_quantity(req), parse_quantity(lim) if lim is not None else None
        if rq is not None and lq is not None and rq > lq:
            errors.append(f"{path}.requests.{name}: {req} exceeds limits.{name} {lim}")
