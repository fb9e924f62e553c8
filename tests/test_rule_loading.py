"""The shipped rules are parsed with libyaml (fast); user rule files with the bounded
pure-Python loader. Both must read the shipped files the same way (lines included)."""

from __future__ import annotations

from fusecli.engine import rules
from fusecli.io import rulefiles


def test_shipped_rules_parse_the_same_with_both_loaders():
    fast = rulefiles.load_rules(None)
    bounded = rulefiles.load_rules([rulefiles.DEFAULT_RULES_DIR])  # a path: the user-file loader
    assert fast == bounded and len(fast) > 10
    for f in rulefiles._rule_files(rulefiles.DEFAULT_RULES_DIR):
        text = f.read_text()
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
