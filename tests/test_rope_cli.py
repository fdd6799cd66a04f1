"""`posdiag rope`: static analysis from a config alone, the module probe, exit codes and bad input."""

import json
import sys
import types

from typer.testing import CliRunner

from posdiag.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["rope", *[str(a) for a in args]])


def test_config_json_alone(fixtures_dir):
    result = invoke(fixtures_dir / "llama-tiny" / "config.json", "--target-length", 1024)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "critical pair" in out and "3 of 8" in out and "before scaling" in out and "after scaling" in out
    assert "L=128" in out and "N=1024" in out  # the terminal plot marks both lengths
    assert "beyond the 128 tokens" in out  # evidence-backed warning; still exit 0


def test_config_only_never_loads_weights(fixtures_dir, monkeypatch):
    import posdiag.model.loading

    monkeypatch.setattr(posdiag.model.loading, "load_subject", lambda *a,
                        **k: (_ for _ in ()).throw(AssertionError("loaded")))
    result = invoke(fixtures_dir / "llama-tiny", "--config-only", "--json", "-", "-q")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["checks"] == [] and data["rope"][0]["after"]["critical_pair"] == 3
    assert len(data["rope"][0]["pairs"]) == 8


def test_model_probe_passes_and_warns_beyond_claims(fixtures_dir):
    result = invoke(fixtures_dir / "llama-tiny", "-q")
    assert result.exit_code == 0 and "PASS rope" in result.output
    result = invoke(fixtures_dir / "llama-tiny", "--target-length", 4096, "-q")
    assert result.exit_code == 0 and "WARN rope" in result.output


def test_planted_model_fails_with_location():
    result = invoke("tests.plants_rope:keys_not_rotated", "-q")
    assert result.exit_code == 1, result.output
    assert "FAIL rope" in result.output and "layer 0, k" in result.output


def test_bad_input_exits_2_with_one_line(fixtures_dir, tmp_path):
    for args, words in (
        ((tmp_path / "nope",), "does not exist"),
        ((fixtures_dir / "gpt2-tiny", "--config-only"), "no rotary position embedding"),
        ((fixtures_dir / "llama-tiny", "--probe", "sort"), "unknown probe"),
        ((fixtures_dir / "llama-tiny" / "config.json", "--probe", "copy"), "needs the model's weights"),
    ):
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output and "Traceback" not in result.output


def test_plot_without_matplotlib_is_a_clear_error(fixtures_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke(fixtures_dir / "llama-tiny" / "config.json", "--plot", "x.png")
    assert result.exit_code == 2 and "pip install matplotlib" in result.output


def test_copy_probe_missing_and_present(fixtures_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "posdiag.tools.copy_probe", None)
    result = invoke(fixtures_dir / "llama-tiny", "--probe", "copy")
    assert result.exit_code == 2 and "--probe copy is not available" in result.output

    from posdiag.results import CheckResult, Status

    seen = {}
    fake = types.ModuleType("posdiag.tools.copy_probe")

    def run(subject, lengths, seed):
        seen.update(lengths=lengths, seed=seed)
        return CheckResult("copy", Status.PASS, "copy accuracy 1.0 at every length")

    fake.run = run
    monkeypatch.setitem(sys.modules, "posdiag.tools.copy_probe", fake)
    result = invoke(fixtures_dir / "llama-tiny", "--probe", "copy", "--seed", 3, "-q")
    assert result.exit_code == 0, result.output
    assert "PASS copy" in result.output and "PASS rope" in result.output
    assert seen == {"lengths": [64, 128, 192, 256, 512], "seed": 3}
