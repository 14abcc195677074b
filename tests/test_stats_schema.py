"""The stub's description of `Engine.stats()` (`EngineStatsDict` and the TypedDicts under it in
`_core.pyi`) against a live snapshot: the schema is defined once in Rust (`rust/engine/stats.rs`,
serialized into the dict), and the stub, which type checkers read, must say the same keys and
value types. The stub is read as source (it is not importable), so every TypedDict, alias and
annotation form it uses is interpreted here.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from strata_rs import Engine

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]

STUB = Path(strata_rs.__file__).parent / "_core.pyi"


class Stub:
    """The stub's TypedDicts (fields by name, base classes' included) and its module-level type
    aliases."""

    def __init__(self, source: str) -> None:
        self.typed_dicts: dict[str, dict[str, ast.expr]] = {}
        self.aliases: dict[str, ast.expr] = {}
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                if "TypedDict" not in bases and not any(b in self.typed_dicts for b in bases):
                    continue
                fields: dict[str, ast.expr] = {}
                for base in bases:
                    fields.update(self.typed_dicts.get(base, {}))
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and isinstance(
                        statement.target, ast.Name
                    ):
                        fields[statement.target.id] = statement.annotation
                self.typed_dicts[node.name] = fields
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
                value = node.value
                if (
                    isinstance(value, ast.Call)
                    and isinstance(value.func, ast.Name)
                    and value.func.id == "TypedDict"
                ):
                    # Functional form: TypedDict("Name", {"key": annotation, ...}).
                    entries = value.args[1]
                    assert isinstance(entries, ast.Dict)
                    self.typed_dicts[name] = {
                        k.value: v
                        for k, v in zip(entries.keys, entries.values, strict=True)
                        if isinstance(k, ast.Constant)
                    }
                else:
                    self.aliases[name] = value

    def check(self, value: Any, annotation: ast.expr, where: str) -> None:
        """Asserts that `value` is of the type `annotation` says; names the path on failure."""
        if isinstance(annotation, ast.Constant) and annotation.value is None:
            assert value is None, f"{where}: {value!r} is not None"
        elif isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            options = _union(annotation)
            if value is None:
                assert any(isinstance(o, ast.Constant) and o.value is None for o in options), (
                    f"{where}: None where {ast.unparse(annotation)} allows none"
                )
                return
            non_none = [o for o in options if not (isinstance(o, ast.Constant) and o.value is None)]
            assert len(non_none) == 1, f"{where}: unions of several types are not read here"
            self.check(value, non_none[0], where)
        elif isinstance(annotation, ast.Name):
            self._check_name(value, annotation.id, where)
        elif isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
            self._check_generic(value, annotation.value.id, annotation.slice, where)
        else:
            raise AssertionError(f"{where}: annotation {ast.unparse(annotation)} not read here")

    def _check_name(self, value: Any, name: str, where: str) -> None:
        if name in self.typed_dicts:
            fields = self.typed_dicts[name]
            assert isinstance(value, dict), f"{where}: {type(value).__name__}, not {name}"
            assert sorted(value) == sorted(fields), (
                f"{where} ({name}): the stub lacks {sorted(set(value) - set(fields))}, "
                f"stats() lacks {sorted(set(fields) - set(value))}"
            )
            for key, field_annotation in fields.items():
                self.check(value[key], field_annotation, f"{where}[{key!r}]")
        elif name in self.aliases:
            self.check(value, self.aliases[name], where)
        elif name == "int":
            assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}"
        elif name == "float":
            assert isinstance(value, float), f"{where}: {value!r} is not a float"
        elif name == "str":
            assert isinstance(value, str), f"{where}: {value!r}"
        elif name == "bool":
            assert isinstance(value, bool), f"{where}: {value!r}"
        else:
            raise AssertionError(f"{where}: type {name} not read here")

    def _check_generic(self, value: Any, name: str, args: ast.expr, where: str) -> None:
        if name == "Literal":
            allowed = [a.value for a in _tuple(args) if isinstance(a, ast.Constant)]
            assert value in allowed, f"{where}: {value!r} not in {allowed}"
        elif name == "list":
            assert isinstance(value, list), f"{where}: {value!r} is not a list"
            for i, item in enumerate(value):
                self.check(item, args, f"{where}[{i}]")
        elif name == "dict":
            key_type, value_type = _tuple(args)
            assert isinstance(value, dict), f"{where}: {value!r} is not a dict"
            for key, item in value.items():
                self.check(key, key_type, f"{where} key")
                self.check(item, value_type, f"{where}[{key!r}]")
        else:
            raise AssertionError(f"{where}: generic {name} not read here")


def _union(annotation: ast.expr) -> list[ast.expr]:
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _union(annotation.left) + _union(annotation.right)
    return [annotation]


def _tuple(args: ast.expr) -> list[ast.expr]:
    return list(args.elts) if isinstance(args, ast.Tuple) else [args]


def test_the_checker_fails_on_a_missing_key_and_a_wrong_type() -> None:
    stub = Stub(
        "class T(TypedDict):\n    a: int\n    b: float | None\n"
        "class U(T):\n    c: list[Literal['x', 'y']]\n"
    )
    stub.check({"a": 1, "b": None, "c": ["x"]}, ast.Name("U"), "u")
    with pytest.raises(AssertionError, match=r"stats\(\) lacks \['c'\]"):
        stub.check({"a": 1, "b": 0.5}, ast.Name("U"), "u")
    with pytest.raises(AssertionError, match=r"u\['a'\]: 1.5"):
        stub.check({"a": 1.5, "b": 0.5, "c": []}, ast.Name("U"), "u")
    with pytest.raises(AssertionError, match=r"not in \['x', 'y'\]"):
        stub.check({"a": 1, "b": 0.5, "c": ["z"]}, ast.Name("U"), "u")


async def test_stats_match_the_stubs_typed_dicts(model_dir: MakeModel) -> None:
    """A snapshot with every optional part filled: a sequence's TTFT and steps, host-tier moves
    (one of them failed by an injected fault) and a restore, so `moves`, `faults_injected` and
    `last_restore` hold records to check."""
    stub = Stub(STUB.read_text())
    model = model_dir("llama", max_position_embeddings=8192)
    engine = await Engine.load(
        model, kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0, cache_faults="copy_out:1"
    )
    try:
        step = int(engine.info["kv_blocks"] * engine.info["block_size"] * 0.16)
        rng = np.random.default_rng(0)
        histories: list[list[int]] = [[], []]
        for _ in range(5):
            for history in histories:
                history += [int(t) for t in rng.integers(3, 512, size=step)]
                r = await engine.complete(history, max_tokens=4, temperature=0, ignore_eos=True)
                history += r.token_ids
        stats = engine.stats()
    finally:
        await engine.close()
    cache = stats["cache"]
    assert cache["last_restore"] is not None, "the test must exercise a restore"
    assert cache["faults_injected"] == {"copy_out": 1}
    assert any(m["result"] == "failed" for m in cache["moves"])
    # Every gate is listed, refused or not; the tiers in the order /v1/cache shows them.
    assert list(cache["refusals"]) == ["ram", "host_budget", "disk_budget", "device"]
    assert list(cache["tiers"]) == ["device", "host", "disk"]
    stub.check(stats, ast.Name("EngineStatsDict"), "stats()")
