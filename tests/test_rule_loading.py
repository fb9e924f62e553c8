"""The shipped rules are parsed with libyaml (fast); user rule files with the bounded
pure-Python loader. Both must read the shipped files the same way (lines included)."""

from __future__ import annotations

from fusecli import rules


def test_shipped_rules_parse_the_same_with_both_loaders():
    fast = rules.load_rules(None)
    bounded = rules.load_rules([rules.DEFAULT_RULES_DIR])  # a path: the user-file loader
    assert fast == bounded and len(fast) > 10
    for f in rules._rule_files(rules.DEFAULT_RULES_DIR):
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
        rules.load_rules([f])
