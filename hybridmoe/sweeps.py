"""Sweep points: parsing `--sweep` grids and `--point` specs, naming points, gin binding strings."""

from __future__ import annotations

import ast
import itertools
import json
import re
from typing import Any, Sequence


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    """'KDAConfig.g_min=[-3,-5]' -> ('KDAConfig.g_min', [-3, -5]); values are Python literals."""
    match = re.fullmatch(r"\s*([\w./]+)\s*=\s*(\[.*\])\s*", spec)
    if not match:
        raise ValueError(f"--sweep must look like 'Class.field=[v1,v2]', got {spec!r}")
    values = ast.literal_eval(match.group(2))
    if not values:
        raise ValueError(f"--sweep {spec!r} has no values")
    return match.group(1), list(values)


def grid(specs: Sequence[str]) -> list[dict[str, Any]]:
    axes = [parse_sweep(s) for s in specs]
    return [dict(zip([name for name, _ in axes], combo))
            for combo in itertools.product(*[values for _, values in axes])]


def parse_point(spec: str) -> dict[str, Any]:
    """'AttnResConfig.mode="block";AttnResConfig.block_size=4' -> {name: value}; values are literals."""
    point = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, value = part.partition("=")
        if not sep or not re.fullmatch(r"[\w./]+", name.strip()):
            raise ValueError(f"--point parts must look like 'Class.field=value', got {part!r}")
        point[name.strip()] = ast.literal_eval(value.strip())
    if not point:
        raise ValueError(f"--point {spec!r} names no binding")
    return point


def point_name(point: dict[str, Any]) -> str:
    parts = [f"{name.split('.')[-1]}={value}" for name, value in point.items()]
    return re.sub(r"[^\w=.,-]", "", ",".join(parts)) or "default"


def binding_string(name: str, value: Any) -> str:
    literal = json.dumps(value) if isinstance(value, str) else repr(value)
    return f"{name} = {literal}"
