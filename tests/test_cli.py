"""``rayinfer serve`` / ``rayinfer generate``: vLLM's flags onto Hydra overrides, the composed configs, model
names, exit codes, and one generate run through the console script's ``main``."""

import importlib
import json
import tomllib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rayinfer.cli import build_parser, compose, hydra_value, main, model_override, normalize_overrides, to_overrides

ROOT = Path(__file__).resolve().parents[1]


def overrides(command: str, *argv: str) -> list[str]:
    return to_overrides(command, build_parser(command).parse_intermixed_args(list(argv)))


def test_generate_flags_map_onto_overrides():
    got = overrides("generate", "--model", "Llama3-8B", "--dtype", "float32", "--max-model-len", "2048",
                    "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--parallel", "ep2", "-i", "in.jsonl",
                    "--output", "out dir/o.jsonl", "engine.num_kv_blocks=64", "--input-format", "openai")
    assert got == ["model=llama-3-8b", "parallel=ep2", "model.dtype='float32'", "model.max_model_len=2048",
                   "engine.max_num_seqs=8", "engine.gpu_memory_utilization=0.5", "input='in.jsonl'",
                   "output='out dir/o.jsonl'", "input_format='openai'", "engine.num_kv_blocks=64"]


def test_abbreviated_flags_are_refused(capsys):
    """A prefix of a flag is not taken for the flag (argparse's default would read --max-num-seq as
    --max-num-seqs): it is an unrecognized argument."""
    with pytest.raises(SystemExit):
        build_parser("generate").parse_intermixed_args(["--max-num-seq", "8"])
    assert "unrecognized arguments: --max-num-seq" in capsys.readouterr().err


def test_a_mistyped_flag_names_the_closest_one(capsys):
    """An unknown flag's error suggests the closest known flag (as an unknown Hydra key's does), and says
    nothing more where no flag is close."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--temprature", "0.7"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --temprature (did you mean --temperature?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-num-seq=8", "--prot", "80"])
    assert "(did you mean --max-num-seqs for --max-num-seq, --port for --prot?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--temp", "0.7"])  # a shortened flag: the flag it begins
    assert "unrecognized arguments: --temp (did you mean --temperature?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err


def test_generate_sampling_flags_set_the_line_defaults():
    from rayinfer.jobs import generate

    generate.register_configs()
    argv = ["--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9"]
    assert overrides("generate", *argv) == ["sampling.max_tokens=7", "sampling.temperature=0.5",
                                            "++sampling.top_p=0.9"]
    cfg = compose("generate", overrides("generate", *argv))
    assert (cfg.sampling.max_tokens, cfg.sampling.temperature, cfg.sampling.top_p) == (7, 0.5, 0.9)
    # an override of the same key wins over the flag
    assert overrides("generate", "--top-p", "0.9", "+sampling.top_p=0.5") == ["+sampling.top_p=0.5"]
    assert main(["generate", "--temperature", "-1"]) == 2


def test_serve_flags_map_onto_overrides_and_an_override_wins():
    got = overrides("serve", "--model", "/models/my-llama", "--host", "0.0.0.0", "--port", "8011",
                    "--api-key", "true", "--max-num-seqs", "16", "--data-parallel-size", "2", "port=9000")
    assert got == ["model.model='/models/my-llama'", "engine.max_num_seqs=16", "parallel.dp=2", "host='0.0.0.0'",
                   "api_key='true'", "port=9000"]


def test_composed_configs_carry_the_flags():
    from rayinfer.jobs import generate
    from rayinfer.serve.config import compose_config

    generate.register_configs()
    cfg = OmegaConf.to_object(compose("generate", overrides(
        "generate", "--model", "qwen3-moe-tiny", "--parallel", "ep2", "--max-model-len", "512", "--max-num-seqs", "4",
        "--gpu-memory-utilization", "0.4", "--dtype", "float32", "-i", "p.jsonl", "-o", "o.jsonl")))
    assert isinstance(cfg, generate.GenerateConfig)
    assert (cfg.model.model, cfg.model.load_format, cfg.model.dtype, cfg.model.max_model_len) == (
        "qwen3-moe-tiny", "dummy", "float32", 512)
    assert (cfg.engine.max_num_seqs, cfg.engine.gpu_memory_utilization) == (4, 0.4)
    assert cfg.parallel.topology == "ep" and cfg.parallel.ep == 2
    assert (cfg.input, cfg.output) == ("p.jsonl", "o.jsonl")

    serve = compose_config(overrides("serve", "--model", "smollm2", "--port", "8011", "--host", "0.0.0.0",
                                     "--api-key", "12345", "--served-model-name", "gpt-4o-mini"))
    assert (serve.port, serve.host, serve.api_key, serve.model_name) == (8011, "0.0.0.0", "12345", "gpt-4o-mini")
    assert serve.model.model == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("value, expected", [
    ("llama3-8b", "model=llama-3-8b"),  # the config's name, however it is spelled
    ("LLaMA-3-8B", "model=llama-3-8b"),
    ("qwen3_moe_tiny", "model=qwen3-moe-tiny"),
    ("smollm2", "model=smollm2"),
    ("/models/x", "model.model='/models/x'"),  # a directory or any other name: the job checks it
    ("nope", "model.model='nope'"),
])
def test_model_names(value, expected):
    assert model_override(value) == expected


def test_normalize_overrides_touches_only_plain_model_choices():
    assert normalize_overrides(["model=nope", "model.model=x", "model=smollm2,llama3-8b", "engine.device=cpu"]) == [
        "model.model='nope'", "model.model=x", "model=smollm2,llama3-8b", "engine.device=cpu"]


def test_hydra_value_keeps_the_string():
    from rayinfer.jobs import generate

    generate.register_configs()
    for value in ["true", "123", "a b", "it's", "x\\", "${oc.env:HOME}", "null"]:
        assert compose("generate", [f"input={hydra_value(value)}"]).input == value


def test_console_script_is_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["rayinfer"].partition(":")
    assert getattr(importlib.import_module(module), attr) is main


@pytest.mark.parametrize("argv, code, message", [
    (["generate", "--model", "nope"], 2, "unknown model 'nope'"),
    (["generate", "model=nope"], 2, "unknown model 'nope'"),
    (["generate", "engine.no_such_key=1"], 2, "bad generate config: Could not override 'engine.no_such_key'"),
    (["serve", "--model", "nope"], 2, "unknown model 'nope'"),
    (["frobnicate"], 2, "usage: rayinfer {serve,generate}"),
])
def test_errors_exit_2_with_one_line(argv, code, message, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {command} " in out for command in ("generate", "serve")) and "key=value" in out


def test_rayinfer_generate_runs(tmp_path, ray_cluster):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "Hello"}\n{"id": "b", "messages": [{"role": "user", "content": "Hi"}]}\n')
    code = main(["generate", "--model", "llama-tiny", "--load-format", "dummy", "--dtype", "float32", "--device", "cpu",
                 "--max-num-seqs", "4", "--max-model-len", "256", "-i", str(inp), "-o", str(out),
                 "sampling.max_tokens=3", "+sampling.ignore_eos=true", "engine.num_kv_blocks=32",
                 "parallel.num_cpus_per_replica=1"])
    assert code == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b"]
    assert all(r["error"] is None and len(r["output_token_ids"]) == 3 for r in recs)


def test_a_misspelt_key_names_the_closest_declared_one():
    from rayinfer.cli import did_you_mean
    from rayinfer.jobs import generate

    generate.register_configs()
    cfg = compose("generate", [])
    assert did_you_mean(cfg, "engine.max_num_seq") == " (did you mean engine.max_num_seqs?)"
    assert did_you_mean(cfg, "+sampling.temprature") == " (did you mean sampling.temperature?)"
    assert did_you_mean(cfg, "engine.zzzz") == ""  # nothing close
    assert did_you_mean(cfg, "no_such_group.key") == ""  # no such parent node
    with pytest.raises(ValueError, match=r"'model\.dtpe': the config has no such key \(did you mean model\.dtype\?\)"):
        compose("generate", ["model.dtpe=float32"])
    with pytest.raises(ValueError, match=r"unknown key\(s\) engine\.max_num_seq \(did you mean engine\.max_num_seqs\?\)"):
        compose("generate", ["+engine.max_num_seq=4"])
    # a value of the wrong type: Hydra's own message says only "Error merging override"; its cause says why
    with pytest.raises(ValueError, match=r"engine\.max_num_seqs=abc: Value 'abc' of type 'str' could not be converted"):
        compose("generate", ["engine.max_num_seqs=abc"])
