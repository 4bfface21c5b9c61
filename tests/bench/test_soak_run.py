"""`weir bench soak` end to end, briefly: its own server on the tiny model, the mix, samples and checks."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from api.cli import main
from bench.soak_ledger import spilled_request_ids
from tenants.usage import ShedEvent, UsageEvent, UsageWriter
from tests.fixtures.database import copy_of_template


def test_short_soak_serves_the_mix_and_passes_its_checks(
    tiny_model_dir, pg_server_url, migrated_template, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "soak.json"
    # one dtype, so that start-up measures no other: oneDNN keeps memory per row count it meets, bounded
    # by rounding rows (engine/models/dense.py), and a 12-second run should meet the same few shapes
    options = ["--minutes", "0.2", "--sample-s", "2", "--capacity-s", "2", "--capacity-clients", "4"]
    options += ["--dtype", "float32"]
    with copy_of_template(pg_server_url, migrated_template, prefix="weir_soak") as url:
        monkeypatch.setenv("DATABASE_URL", url)
        status = main(["bench", "soak", *options, "--model", str(tiny_model_dir), "--out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert status == 0, f"{printed}\nserver log:\n{result['server']['log_tail']}"
    assert result["passed"] and all(check["ok"] for check in result["checks"].values())
    ledger = result["ledger"]
    assert ledger["admitted"] == ledger["rows"] > 0
    assert (ledger["missing"], ledger["doubled"], ledger["extra"]) == (0, 0, 0)
    assert result["kv"]["free"] == result["kv"]["total"] > 0

    load = result["load"]
    assert load["failed"] == load["skipped"] == load["cancelled"] == 0
    assert load["left"] > 0 and load["done"] > 0
    assert set(load["by_kind"]["invalid"]) == {"400"}
    assert load["by_kind"]["over_quota"].get("429", 0) > 0
    assert load["refused"] >= load["by_kind"]["over_quota"]["429"] + load["by_kind"]["invalid"]["400"]

    phases = [s["phase"] for s in result["samples"]]
    assert phases[0] == "capacity" and phases[-1] == "end" and {"load", "warm-up"} <= set(phases)
    assert result["rss"]["warm_mib"] > 0 and result["rss"]["max_mib"] >= result["rss"]["end_mib"]

    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("time s"))
    for column in ("RSS MiB", "free blocks", "running", "waiting", "done", "refused", "left"):
        assert column in header
    checks = ("rss_", "kv_", "ledger_", "requests_failed")
    verdict = {line.split()[0]: line.split()[-1] for line in lines if line.startswith(checks)}
    assert verdict == {
        "rss_drift_pct": "pass",
        "kv_blocks_free_at_end": "pass",
        "ledger_missing_doubled_extra": "pass",
        "requests_failed": "pass",
    }


async def test_usage_events_left_in_spill_files_are_found_by_request_id(tmp_path):
    spill_dir = tmp_path / "spill"
    assert spilled_request_ids(spill_dir) == []
    writer = UsageWriter(None, spill_dir=spill_dir)  # never reaches a database: closed before any event
    await writer.close()
    now = datetime.now(UTC)
    request_id = "cmpl-" + "0" * 32
    writer.submit(UsageEvent(request_id, 1, None, "m", 3, 0, 2, 7.0, "ok", "stop", 0, 0, 0, 0, now, now))
    writer.submit(ShedEvent(tenant_id=1, reason="rate"))  # a refusal: not a request of the ledger
    assert spilled_request_ids(spill_dir) == [request_id]
