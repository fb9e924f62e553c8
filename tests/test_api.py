"""The Python API an export pipeline calls (fusecli.optimize / verify / save), without the CLI.

Expected counts come from samples/manifest.yaml (read off the model code when the samples were
exported), never from fusecli's own output."""

from __future__ import annotations

import hashlib
import json
import shutil

import onnx
import pytest

import fusecli
from conftest import SAMPLES, run_cli


@pytest.fixture(scope="module")
def exported(tmp_path_factory, manifest):
    """Stands for the export step: a real torch-joint training graph the pipeline wrote."""
    folder = tmp_path_factory.mktemp("export")
    path = folder / "training_model.onnx"
    shutil.copy(SAMPLES / "torch_block.onnx", path)
    return path, manifest["torch_block"]


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pipeline_optimize_verify_save(exported, tmp_path):
    path, entry = exported
    before = _digest(path)
    result = fusecli.optimize(path)
    expected = {k: v for k, v in entry["patterns"].items()}
    assert {k: result.fused.get(k, 0) for k in expected} == expected
    assert result.total_fused == sum(expected.values()) > 0
    assert result.skipped == []
    assert result.bytes_removed and result.bytes_removed > 0
    assert len(result.model.graph.node) == result.stats.nodes_after < entry["nodes"]
    out = fusecli.save(result, tmp_path / "fused.onnx")
    assert out == tmp_path / "fused.onnx" and result.saved_to == out
    assert _digest(path) == before                  # the input is never written
    fused = onnx.load(out)
    # a flash_attention fusion writes two nodes (FlashAttention, FlashAttentionGrad)
    nodes = sum(n.domain == "com.fusecli" for n in fused.graph.node)
    assert nodes == result.total_fused + result.fused.get("flash_attention", 0)
    report = fusecli.verify(path, out)
    assert report.verdict == "PASS" and not report.mismatched and not report.inconclusive
    assert sum(report.fused_kernel_runs.values()) == nodes


def test_one_call_writes_and_verifies(exported, tmp_path):
    path, entry = exported
    out = tmp_path / "fused.onnx"
    result = fusecli.optimize(path, output=out, verify=True,
                              only=["flash_attention", "layernorm"])
    assert result.fused["flash_attention"] == entry["patterns"]["flash_attention"]
    assert result.fused["layernorm"] == entry["patterns"]["layernorm"]
    assert result.fused["linear_gelu"] == 0                 # not selected
    assert out.is_file() and result.verify.verdict == "PASS"
    assert result.as_dict()["verify"]["verdict"] == "PASS"
    unsaved = fusecli.optimize(path, verify=True)           # verified from a temporary copy
    assert unsaved.verify.verdict == "PASS" and unsaved.saved_to is None


def test_a_modelproto_is_fused_in_place_and_stats_reset(exported):
    path, entry = exported
    model = onnx.load(path)
    first = fusecli.optimize(model)
    assert first.model is model and first.source is None
    assert first.total_fused == sum(entry["patterns"].values())
    again = fusecli.optimize(model)                   # already fused: nothing left, counters new
    assert again.total_fused == 0
    assert fusecli.stats(model)["already_fused"]["fused_ops"]


def test_the_cli_is_the_api(exported, tmp_path):
    """`fusecli optimize --json` reports what fusecli.optimize returns."""
    path, _ = exported
    out = tmp_path / "cli.onnx"
    cli = json.loads(run_cli("optimize", path, "-o", out, "--json", "-q").stdout)
    api = fusecli.optimize(path).as_dict()
    for key in ("nodes_before", "nodes_after", "total_fused", "patterns", "rules",
                "bytes_eliminated", "buffers_eliminated", "saved_activations"):
        assert cli[key] == api[key], key


def test_the_ci_gate(exported, tmp_path):
    """fusecli.regressions is `optimize --expect/--baseline`: a drop below either is a line."""
    path, entry = exported
    result = fusecli.optimize(path, only=["layernorm"])
    want = entry["patterns"]["layernorm"]
    assert fusecli.regressions(result, expect={"layernorm": want}) == []
    assert fusecli.regressions(result, expect={"flash_attention": 1}) == [
        "flash_attention: fused 0, expected at least 1"]
    base = tmp_path / "base.json"
    base.write_text(json.dumps(fusecli.optimize(path).as_dict()))
    lines = fusecli.regressions(result, baseline=base)
    assert (f"flash_attention: fused 0, baseline had {entry['patterns']['flash_attention']}"
            in lines)
    exp = tmp_path / "expect.yaml"
    exp.write_text(f"layernorm: {want + 1}\n")
    assert fusecli.regressions(result, expect=exp) == [
        f"layernorm: fused {want}, expected at least {want + 1}"]


def test_errors_are_the_cli_classes(tmp_path):
    with pytest.raises(fusecli.ModelError, match="no such file") as exc:
        fusecli.optimize(tmp_path / "missing.onnx")
    assert exc.value.exit_code == 2
    proc = run_cli("optimize", tmp_path / "missing.onnx", "-o", tmp_path / "o.onnx", check_rc=2)
    assert str(exc.value) in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(fusecli.RuleError, match="bad.yaml"):
        fusecli.optimize(SAMPLES / "torch_mlp.onnx", rules=[bad])
    with pytest.raises(fusecli.FuseError, match="no rule or pattern named 'nope'"):
        fusecli.optimize(SAMPLES / "torch_mlp.onnx", only=["nope"])


def test_save_refuses_the_input_without_in_place(exported, tmp_path):
    path, _ = exported
    copy = tmp_path / "m.onnx"
    shutil.copy(path, copy)
    result = fusecli.optimize(copy)
    with pytest.raises(fusecli.ModelError):
        fusecli.save(result, copy)
    assert fusecli.save(result, copy, in_place=True) == copy
