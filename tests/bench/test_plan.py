"""`weir bench profile` on the tiny model, and `weir plan` from its profile, end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from api.cli import main
from engine.capacity_plan import StepProfile
from engine.models.extension import kernel_dir
from tests.fixtures.database import copy_of_template

GRID = ["--prefill-tokens", "0", "16", "64", "--decodes", "0", "1", "4", "--contexts", "16", "64"]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plan-state")


@pytest.fixture(scope="module")
def profile(tiny_model_dir, state_dir, pg_server_url, migrated_template) -> Path:
    """The tiny model's profile, measured once for the module (cached in ``state_dir`` too); its host work
    on a `weir serve` over a database of its own."""
    out = state_dir / "profile.json"
    with (
        pytest.MonkeyPatch.context() as patch,
        copy_of_template(pg_server_url, migrated_template, prefix="weir_profile") as url,
    ):
        patch.setenv("WEIR_KERNEL_DIR", str(kernel_dir()))  # the attention kernel the other tests built
        patch.setenv("WEIR_STATE_DIR", str(state_dir))
        patch.setenv("DATABASE_URL", url)
        options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--repeats", "1", "--out", str(out)]
        assert main(["bench", "profile", *options, *GRID]) == 0
    return out


def test_the_profile_holds_the_grid_the_context_sweep_and_the_load_time(profile, state_dir, tiny_model_dir):
    data = json.loads(profile.read_text())
    assert data["kind"] == "weir.step_profile" and data["version"] == 1
    assert data["model"] == tiny_model_dir.name and data["dtype"] == "float32" and data["device"] == "cpu"
    steps = data["steps"]
    assert steps["prefill_tokens"] == [0, 16, 64] and steps["decodes"] == [0, 1, 4] and steps["context"] == 16
    assert steps["seconds"][0][0] is None  # the empty step is not a step
    assert all(s > 0 for row in steps["seconds"] for s in row if s is not None)
    assert data["context"]["contexts"] == [16, 64] and data["context"]["decodes"] == 4
    assert len(data["context"]["seconds"]) == 2
    assert data["load_s"] > 0 and "fresh Python process" in data["load_measured"]
    assert set(data["engine"]) >= {"max_batched_tokens", "max_num_seqs", "prefill_chunk_size", "kv_tokens"}
    cached = state_dir / "profiles" / f"{tiny_model_dir.name}-float32.json"
    assert json.loads(cached.read_text()) == data
    assert StepProfile.from_json(data).step_seconds(16, 1) > 0
    host = data["host"]
    assert host["requests"] > 0
    for part in ("server", "client"):  # every streamed request costs its server and its client some CPU
        assert host[part]["cores"] == len(os.sched_getaffinity(0))
        assert host[part]["request_s"] > 0 or host[part]["token_s"] > 0
        assert host[part]["request_s"] >= 0 and host[part]["token_s"] >= 0
    assert StepProfile.from_json(data).host.request_s == host["server"]["request_s"]


def test_plan_prints_the_replicas_for_the_rate_and_one_more_to_survive_a_failure(profile, tmp_path, capsys):
    out = tmp_path / "plan.json"
    # targets loose enough for the step times of a busy machine
    mix = ["--prompt-tokens", "16-48", "--output-tokens", "4,8", "--ttft-ms", "5000", "--tpot-ms", "2000"]
    options = ["--profile", str(profile), "--rate", "50", "--failures", "1", "--requests", "100"]
    compare = ["--compare-prompt-tokens", "16", "64"]
    assert main(["plan", *options, *mix, *compare, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    plan = result["plan"]
    # one row per prompt length (their order is the math's tests' business: a busy machine's grid is noise)
    assert [row["prompt_tokens"] for row in result["by_prompt"]] == ["16", "64"]
    assert all(row["replica_capacity_rps"] > 0 for row in result["by_prompt"])
    assert plan["replica_capacity_rps"] > 0
    assert plan["replica_ttft_p99_ms"] <= 5000 and plan["replica_tpot_p99_ms"] <= 2000
    assert plan["replicas"] * plan["replica_capacity_rps"] >= 50 * 0.99  # the capacity is rounded in the JSON
    assert plan["replicas_with_spares"] == plan["replicas"] + 1
    assert plan["spare_rps"] == pytest.approx(plan["replica_capacity_rps"], rel=1e-3)
    for text in (
        "host work on",
        "N+1 (survives 1 failure)",
        "warm spare req/s",
        "prompts 16-48 tokens",
        "outputs 4,8 tokens",
    ):
        assert text in printed


def test_plan_without_a_profile_uses_the_one_cached_for_the_model(
    profile, state_dir, tiny_model_dir, monkeypatch, capsys
):
    monkeypatch.setenv("WEIR_STATE_DIR", str(state_dir))
    options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--rate", "1", "--requests", "50"]
    assert main(["plan", *options]) == 0
    captured = capsys.readouterr()
    assert "using the profile measured at" in captured.err and "one replica:" in captured.out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompt-tokens", "64-16"], "LOW <= HIGH"),
        (["--rate", "0"], "must be positive"),
        (["--ttft-ms", "0.001"], "no number of replicas"),  # 1 µs: shorter than any step
    ],
)
def test_plan_refuses_bad_input_with_one_line(profile, options, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--profile", str(profile), "--requests", "50", *options])
    assert message in str(exc.value) and str(exc.value).startswith("weir plan: error:")


def test_validate_measures_one_replica_on_a_weir_serve_and_compares(
    profile, tiny_model_dir, pg_server_url, migrated_template, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "plan.json"
    options = [
        "--profile",
        str(profile),
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--requests",
        "100",
    ]
    with copy_of_template(pg_server_url, migrated_template, prefix="weir_plan") as url:
        monkeypatch.setenv("DATABASE_URL", url)
        assert main(["plan", *options, "--validate", "--validate-seconds", "2", "--out", str(out)]) == 0
    validation = json.loads(out.read_text())["validation"]
    assert validation["predicted_rps"] > 0 and validation["measured_rps"] > 0
    assert validation["ratio"] == pytest.approx(
        validation["predicted_rps"] / validation["measured_rps"], rel=1e-2
    )
    assert validation["measurement"]["trials"]
    # each part of the host work counted takes capacity away
    assert validation["engine_alone_rps"] >= validation["server_host_rps"] >= validation["predicted_rps"]
    assert "predicted / measured" in capsys.readouterr().out
