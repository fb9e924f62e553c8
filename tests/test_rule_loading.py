"""The shipped rules are parsed with libyaml (fast); user rule files with the bounded
pure-Python loader. Both must read the shipped files the same way (lines included)."""

from __future__ import annotations

import os

from fusecli.engine import rules
from fusecli.io import rulefiles


def test_shipped_rules_parse_the_same_with_both_loaders():
    fast = rulefiles.load_rules(None)
    bounded = rulefiles.load_rules([rulefiles.DEFAULT_RULES_DIR])  # a path: the user-file loader
    assert fast == bounded and len(fast) > 10
    for f in rulefiles._rule_files(rulefiles.DEFAULT_RULES_DIR):
        text = f.read_text()
        if rulefiles._is_fragment(f):   # a list of variants
            a, b = rules._yaml(text, str(f), shipped=True), rules._yaml(text, str(f))
            assert a == b and [v.line for v in a] == [v.line for v in b], f
            continue
        a = rules._load_yaml(text, str(f), shipped=True)
        b = rules._load_yaml(text, str(f))
        assert a == b and a.key_lines == b.key_lines and a.line == b.line, f


def test_user_rule_files_keep_the_bounds(tmp_path):
    import pytest

    from fusecli.errors import RuleError

    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefg", "bcdefgh"))
    f = tmp_path / "bomb.yaml"
    f.write_text(bomb)
    with pytest.raises(RuleError, match="aliases"):
        rulefiles.load_rules([f])


def _unlined(obj):
    """Rule parts without the source line numbers they were parsed at."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return tuple((f.name, _unlined(getattr(obj, f.name))) for f in dataclasses.fields(obj)
                     if f.name != "line")
    if isinstance(obj, dict):
        return {k: _unlined(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return tuple(_unlined(v) for v in obj)
    return obj


def test_expanded_rules_are_the_rules_the_matcher_uses():
    """`fusecli rules show --expanded` prints each variant as a plain rule: parsed again as a
    rule file of its own, it is the same rule (nodes, tensors, replacement, order)."""
    from fusecli.engine.rules import expanded_text, parse_rule

    shipped = rulefiles.load_rules(None)
    assert any("variants" in r.text for r in shipped)
    for r in shipped:
        text = expanded_text(r)
        assert "$" not in text.replace("$$", ""), r.name     # every parameter substituted
        again = parse_rule(text, r.name)
        assert (again.name, again.pattern, again.order, again.family) == \
            (r.name, r.pattern, r.order, r.family)
        assert _unlined(again.nodes) == _unlined(r.nodes), r.name
        assert _unlined(again.tensors) == _unlined(r.tensors), r.name
        assert _unlined(again.replace) == _unlined(r.replace), r.name


def test_rules_show_expanded_prints_every_variant(tmp_path):
    from conftest import run_cli

    out = run_cli("rules", "show", "act_silu_grad_torch", "--expanded").stdout
    names = [line.split()[1] for line in out.splitlines() if line.startswith("# ")]
    assert names == ["act_silu_grad_torch", "act_silu_product_grad_torch",
                     "act_silu_scaled_grad_torch"]
    assert "${spelling}" not in out and "$chain" not in out
    plain = run_cli("rules", "show", "act_silu_scaled_grad_torch").stdout
    assert "variants:" in plain                     # without --expanded: the file as written


# --- the cache of parsed shipped rules (rulefiles: FUSECLI_CACHE_DIR) -------------------------

def _parses(monkeypatch) -> list[str]:
    """Counts the rule files parsed from here on (their sources)."""
    seen = []
    parse = rulefiles.parse_rules

    def counted(text, source, shipped=False, fragments=None):
        seen.append(source)
        return parse(text, source, shipped, fragments)

    monkeypatch.setattr(rulefiles, "parse_rules", counted)
    return seen


def test_shipped_rules_are_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSECLI_CACHE_DIR", str(tmp_path / "cache"))
    parsed = _parses(monkeypatch)
    first = rulefiles.load_rules()
    n_files = len([f for f in rulefiles._rule_files(rulefiles.DEFAULT_RULES_DIR)
                   if not rulefiles._is_fragment(f)])
    assert len(parsed) == n_files
    assert len(list((tmp_path / "cache").glob("rules-*.pickle"))) == 1
    again = rulefiles.load_rules()
    assert len(parsed) == n_files                   # nothing parsed the second time
    assert again == first and again is not first
    assert [r.body for r in again] == [r.body for r in first]
    assert again == rulefiles.load_rules([rulefiles.DEFAULT_RULES_DIR])  # a fresh parse


def test_the_cache_holds_each_equal_spec_once_and_keys_that_do_not_depend_on_the_process(
        tmp_path, monkeypatch):
    """Variants of one file repeat most node specs: the parse shares equal ones (a cache of 477
    rules then loads ~5x faster), in the cache too. The prefix keys FusionPass compares across
    rules are digests: a cache written by one process (one string-hash seed) and rules parsed in
    another compute the same keys for the same prefix."""
    import pickle
    import subprocess
    import sys

    monkeypatch.setenv("FUSECLI_CACHE_DIR", str(tmp_path / "cache"))
    fresh = {r.name: r for r in rulefiles.load_rules()}
    cached = {r.name: r for r in rulefiles.load_rules()}
    for by_name in (fresh, cached):
        dx, nodx = by_name["lora_identity_torch_dx"], by_name["lora_identity_torch_nodx"]
        assert dx.nodes[0] is nodx.nodes[0] and dx.nodes[0] == nodx.nodes[0]
        assert dx.nodes[-1] != nodx.nodes[-1]
    assert cached["lora_identity_torch_dx"] is not fresh["lora_identity_torch_dx"]
    keys = {n: r.prefix for n, r in fresh.items()}
    assert all(len(k) == len(fresh[n].nodes) for n, k in keys.items())
    child = ("import pickle, sys\nfrom fusecli.io.rulefiles import load_rules\n"
             "sys.stdout.buffer.write(pickle.dumps({r.name: r.prefix for r in load_rules()}))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed,
                                  "FUSECLI_CACHE_DIR": ""}).stdout
        assert pickle.loads(out) == keys


def test_a_changed_rule_file_is_parsed_again(tmp_path, monkeypatch):
    import shutil

    shipped = tmp_path / "rules"
    shutil.copytree(rulefiles.DEFAULT_RULES_DIR, shipped)
    monkeypatch.setattr(rulefiles, "DEFAULT_RULES_DIR", shipped)
    monkeypatch.setenv("FUSECLI_CACHE_DIR", str(tmp_path / "cache"))
    before = {r.name: r for r in rulefiles.load_rules()}
    f = shipped / "act_relu_grad_torch.yaml"
    f.write_text(f.read_text().replace("order: ", "order: 1", 1))
    parsed = _parses(monkeypatch)
    after = {r.name: r for r in rulefiles.load_rules()}
    assert parsed                                    # a new key: parsed, not read
    changed = [n for n in after if after[n].order != before[n].order]
    assert changed and all(after[n].source == str(f) for n in changed)
    assert len(list((tmp_path / "cache").glob("rules-*.pickle"))) == 2  # both kept
    for k in range(3, 7):                            # ... but only the newest four
        f.write_text(f.read_text().replace("order: ", f"order: {k}", 1))
        rulefiles.load_rules()
    assert len(list((tmp_path / "cache").glob("rules-*.pickle"))) == rulefiles._CACHE_KEEP


def test_a_corrupt_or_shared_cache_is_not_read(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FUSECLI_CACHE_DIR", str(cache))
    want = rulefiles.load_rules()
    (path,) = cache.glob("rules-*.pickle")
    path.write_bytes(b"not a pickle")
    parsed = _parses(monkeypatch)
    assert rulefiles.load_rules() == want and parsed  # parsed again (and stored again)
    parsed.clear()
    cache.chmod(0o777)                                # others could have written it
    assert rulefiles.load_rules() == want and parsed


def test_an_empty_cache_dir_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSECLI_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rulefiles.load_rules()
    assert not list(tmp_path.rglob("*.pickle"))


def test_an_unwritable_cache_dir_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FUSECLI_CACHE_DIR", str(blocker / "cache"))  # under a plain file
    assert rulefiles.load_rules() == rulefiles.load_rules([rulefiles.DEFAULT_RULES_DIR])


# --- fragments: variant lists several rule files include (rules/_NAME.yaml) ------------------

_RULE = """name: inc_relu${grad}
pattern: activation_grad
order: 900
family: torch-joint
params: {}
variants:
  cross:
    - [{grad: ""}]
    - include: %s
nodes:
  - {id: le, op: LessOrEqual, inputs: [X, zero], outputs: [M]}
  - {id: where, op: Where, inputs: [M, zero, dY], outputs: [$dx]}
tensors: {zero: {const: 0.0, tol: 0}}
replace: {op: ActivationGrad, inputs: [dY, X], outputs: [$dx], attrs: {activation: relu}}
"""
_FRAGMENT = """# the gradient's name
- {grad: _a, dx: dXa}
- {grad: _b, dx: dXb}
"""


def test_a_fragment_is_included_as_one_cross_list(tmp_path):
    """`- include: NAME` in a cross is the list of _NAME.yaml beside the rule file: the same
    rules as that list written inline, and the fragment itself is no rule."""
    (tmp_path / "_grads.yaml").write_text(_FRAGMENT)
    (tmp_path / "r.yaml").write_text(_RULE % "grads")
    inline = tmp_path / "inline"
    inline.mkdir()
    body = "\n".join("      " + line for line in _FRAGMENT.splitlines()[1:])
    (inline / "r.yaml").write_text(_RULE.replace("    - include: %s", "    -\n" + body))
    for paths in ([tmp_path], [tmp_path / "r.yaml"]):   # the folder, or the file alone
        got = rulefiles.load_rules(paths)
        assert [r.name for r in got] == ["inc_relu_a", "inc_relu_b"]
        assert [_unlined(r.nodes) for r in got] == [
            _unlined(r.nodes) for r in rulefiles.load_rules([inline])]
        assert [r.nodes[-1].outputs for r in got] == [("dXa",), ("dXb",)]


def test_shipped_fragments_are_included_by_the_rules_that_name_them():
    from pathlib import Path

    names: dict[str, list[str]] = {}
    for r in rulefiles.load_rules(None):
        names.setdefault(Path(r.source).stem, []).append(r.name)
    for family, files in (("torch", ("lce_torch", "lce_torch_loss", "lce_torch_shift",
                                     "lce_torch_rows")),
                          ("ortt", ("lce_ortt", "lce_ortt_shift", "lce_ortt_gemm"))):
        fragment = rulefiles.DEFAULT_RULES_DIR / f"_lce_logit_transforms_{family}.yaml"
        assert fragment.exists()
        for f in files:
            text = (rulefiles.DEFAULT_RULES_DIR / f"{f}.yaml").read_text()
            assert f"include: lce_logit_transforms_{family}" in text, f
            assert any("_scaled" in n for n in names[f]) and any(
                "_softcap" in n for n in names[f]), names[f]


def test_include_errors_are_one_line(tmp_path):
    """An include without its fragment file, or a fragment that is no list of variants: the
    rule file is refused in one line (exit 2), naming the problem."""
    from conftest import run_cli

    (tmp_path / "r.yaml").write_text(_RULE % "nope")
    res = run_cli("rules", "validate", tmp_path, check_rc=2)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "include: 'nope': no fragment file _nope.yaml beside this rule file" in res.stderr
    (tmp_path / "_nope.yaml").write_text("grad: _a\n")
    res = run_cli("rules", "validate", tmp_path, check_rc=2)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "_nope.yaml" in res.stderr and "a fragment file must be a non-empty YAML list" in \
        res.stderr
