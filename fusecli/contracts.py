"""The fused-op contracts (``ops/contracts.yaml``) as Python objects."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

CONTRACTS_FILE = Path(__file__).parent / "ops" / "contracts.yaml"


@dataclass(frozen=True)
class Port:
    name: str
    optional: bool
    doc: str


@dataclass(frozen=True)
class OpContract:
    name: str
    summary: str
    types: tuple[str, ...]
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: dict
    math: str


@dataclass(frozen=True)
class Contracts:
    domain: str
    version: int
    ops: dict[str, OpContract]


def _ports(items) -> tuple[Port, ...]:
    return tuple(Port(p["name"], bool(p.get("optional", False)), p.get("doc", "")) for p in items)


@functools.cache
def load_contracts() -> Contracts:
    data = yaml.safe_load(CONTRACTS_FILE.read_text())
    ops = {
        name: OpContract(name, spec["summary"], tuple(spec["types"]), _ports(spec["inputs"]),
                         _ports(spec["outputs"]), dict(spec.get("attributes") or {}), spec["math"])
        for name, spec in data["ops"].items()
    }
    return Contracts(data["domain"], int(data["version"]), ops)


FUSED_DOMAIN = "com.fusecli"
