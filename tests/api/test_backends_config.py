"""The backend list (``--backend``, ``--backends FILE``) and the per-backend window, without servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.backends import BackendConfigError, BackendSpec, load_pool_config
from api.pool_window import Window


def test_backend_urls_name_their_kind() -> None:
    assert BackendSpec.parse("http://10.0.0.5:9000/") == BackendSpec("http://10.0.0.5:9000")
    assert BackendSpec.parse("unix:/run/weir.sock") == BackendSpec("unix:/run/weir.sock")
    openai = BackendSpec.parse("openai:http://gpu-1:8000/v1#org/model")
    assert (openai.kind, openai.url, openai.model) == ("openai", "http://gpu-1:8000/v1", "org/model")
    assert BackendSpec.parse("openai:http://gpu-1:8000/v1").model is None


def test_a_toml_file_lists_backends_and_the_pool_settings(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(
        '[pool]\ninitial_window = 500\nmax_window = 1000\n\n[[backends]]\nurl = "http://a:1"\n\n'
        '[[backends]]\nkind = "openai"\nurl = "http://b:2/v1"\nmodel = "m"\nmax_model_len = 4096\n'
    )
    config = load_pool_config(str(path), ["unix:/tmp/e.sock"])
    assert [b.name for b in config.backends] == [
        "weir:http://a:1",
        "openai:http://b:2/v1#m",
        "weir:unix:/tmp/e.sock",
    ]
    assert (config.initial_window, config.max_window, config.backends[1].max_model_len) == (500, 1000, 4096)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[backends]]\nurl = "http://a:1"\nwieght = 2\n', "unknown keys: wieght"),
        ('[[backends]]\nkind = "weir"\n', "every [[backends]] entry needs a url"),
        ('[[backends]]\nkind = "grpc"\nurl = "http://a:1"\n', "backend kind must be one of weir, openai"),
        (
            '[[backends]]\nkind = "openai"\nurl = "unix:/x"\n',
            "backend URL must start with http:// or https://",
        ),
        ('[pool]\ninitial_window = 9\nmax_window = 5\n[[backends]]\nurl = "http://a:1"\n', "initial_window"),
        ("[pool]\n", "the backend list is empty"),
        ("[[backends]\n", "--backends"),
        ('[[backends]]\nurl = "http://a:1"\nmax_model_len = "long"\n', "wrong type"),
    ],
)
def test_a_bad_backend_file_is_refused_with_its_reason(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(text)
    with pytest.raises(BackendConfigError, match=message.replace("[", r"\[")):
        load_pool_config(str(path), [])


def test_the_window_grows_within_targets_and_shrinks_beyond_them() -> None:
    window = Window(size=1000.0, maximum=1500.0)
    assert window.has_room(0.0, 5000.0)  # an idle backend always takes one request
    assert window.has_room(800.0, 200.0) and not window.has_room(801.0, 200.0)
    window.observe_first_token(0.1, target_s=1.0, cost=500.0)
    assert window.size == 1250.0  # within half the target: one request's cost, scaled by its share
    window.observe_first_token(0.9, target_s=1.0, cost=500.0)
    assert window.size == 1250.0 * 0.75
    window.observe_tpot(0.5, target_s=0.1)  # a second cut within the same round is not taken
    assert window.size == 1250.0 * 0.75
    for _ in range(20):
        window.observe_first_token(0.1, target_s=None, cost=500.0)
    assert window.size == 1500.0
