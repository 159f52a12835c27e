"""Configuration: defaults, TOML loading, CLI overrides, byte sizes, and errors that name the key."""

import json
import sys

import pytest
from click.testing import CliRunner

from mlx_kvserve.cli import cli
from mlx_kvserve.config import Config, as_dict, load_config, parse_bytes
from mlx_kvserve.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "kvserve.toml"
    path.write_text(text)
    return path


def test_defaults():
    config = load_config()
    assert config == Config()
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8000
    assert config.server.max_queue == 16
    assert config.server.max_body_bytes == 4 * 1024 * 1024
    assert config.model.path == "default"
    # Linux CPU: MLX's float32 path is the fast one; elsewhere GGUF weights stay quantized.
    assert config.model.dtype == ("float32" if sys.platform.startswith("linux") else "keep")
    assert config.generation.max_tokens == 512
    assert config.cache.block_size == 64


def test_toml_file_sets_values(tmp_path):
    path = write(
        tmp_path,
        """
[server]
host = "0.0.0.0"
port = 9000
shutdown_timeout_s = 5      # an integer where a float is expected is fine

[model]
path = "/models/x.gguf"
dtype = "float16"

[generation]
temperature = 0.2
max_tokens = 64

[cache]
enabled = false
""",
    )
    config = load_config(path)
    assert config.server.host == "0.0.0.0"
    assert config.server.port == 9000
    assert config.server.shutdown_timeout_s == 5.0
    assert isinstance(config.server.shutdown_timeout_s, float)
    assert config.model.path == "/models/x.gguf"
    assert config.model.dtype == "float16"
    assert config.generation.temperature == 0.2
    assert config.generation.max_tokens == 64
    assert config.cache.enabled is False
    # Keys the file does not name keep their defaults.
    assert config.server.max_queue == 16
    assert config.generation.top_p == 1.0


def test_overrides_win_over_the_file_and_none_is_ignored(tmp_path):
    path = write(tmp_path, '[server]\nport = 9000\nhost = "0.0.0.0"\n[model]\npath = "a"\n')
    config = load_config(path, {"server": {"port": 9001, "host": None}, "model": {"dtype": "keep"}})
    assert config.server.port == 9001
    assert config.server.host == "0.0.0.0"
    assert config.model.path == "a"
    assert config.model.dtype == "keep"


def test_overrides_without_a_file():
    config = load_config(None, {"generation": {"max_tokens": 7}})
    assert config.generation.max_tokens == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("10 KiB", 10 * 1024),
        ("4096", 4096),
        ("64B", 64),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["lots", "-5MiB", "2XB", "", True, 1.5, -1])
def test_parse_bytes_rejects(value):
    with pytest.raises(ConfigError, match="my.key"):
        parse_bytes(value, "my.key")


def test_byte_sizes_in_the_file(tmp_path):
    path = write(tmp_path, '[server]\nmax_body_bytes = "512KiB"\n[cache]\nram_max_bytes = "2GiB"\n')
    config = load_config(path)
    assert config.server.max_body_bytes == 512 * 1024
    assert config.cache.ram_max_bytes == 2 * 1024**3
    assert load_config(None, {"cache": {"ram_max_bytes": 123456}}).cache.ram_max_bytes == 123456


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nprot = 1\n", "server.prot"),
        ("[sever]\nport = 1\n", "sever"),
        ('[server]\nport = "8000"\n', "server.port"),
        ("[server]\nport = true\n", "server.port"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nport = -1\n", "server.port"),
        ("[server]\nhost = 5\n", "server.host"),
        ("[server]\nmax_queue = 0\n", "server.max_queue"),
        ('[server]\nmax_body_bytes = "huge"\n', "server.max_body_bytes"),
        ("[server]\nmax_body_bytes = 10\n", "server.max_body_bytes"),
        ('[server]\nlog_level = "loud"\n', "server.log_level"),
        ('[model]\ndtype = "int8"\n', "model.dtype"),
        ('[model]\npath = ""\n', "model.path"),
        ('[generation]\ntemperature = "hot"\n', "generation.temperature"),
        ("[generation]\ntop_p = 0\n", "generation.top_p"),
        ("[generation]\nmax_tokens = 0\n", "generation.max_tokens"),
        ('[cache]\nenabled = "yes"\n', "cache.enabled"),
        ("[cache]\nblock_size = 0\n", "cache.block_size"),
        ("server = 5\n", "server"),
    ],
)
def test_errors_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert key in info.value.message
    assert info.value.param == key
    assert info.value.status_code == 400


def test_bad_override_names_the_key():
    with pytest.raises(ConfigError, match="server.port"):
        load_config(None, {"server": {"port": 99999}})


def test_section_that_is_not_a_table_with_overrides(tmp_path):
    # The CLI always passes [server] overrides; merging them must not crash on `server = 5`.
    with pytest.raises(ConfigError, match=r"\[server\]: expected a table"):
        load_config(write(tmp_path, "server = 5\n"), {"server": {"port": 9001}})


def test_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\nport = 1\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml")


def test_config_show_prints_merged_json(tmp_path):
    path = write(tmp_path, '[server]\nport = 9000\nmax_body_bytes = "1MiB"\n[generation]\nmax_tokens = 32\n')
    result = CliRunner().invoke(cli, ["config", "show", "--config", str(path), "--port", "9001"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["server"]["port"] == 9001
    assert shown["server"]["max_body_bytes"] == 1024 * 1024
    assert shown["generation"]["max_tokens"] == 32
    assert shown["model"]["path"] == "default"
    assert shown == as_dict(load_config(path, {"server": {"port": 9001}})) | {"models": []}  # no [[models]]


def test_config_show_includes_the_models_tables(tmp_path):
    text = '[[models]]\nname = "small"\nsource = "default"\naliases = ["gpt-4o-mini"]\n'
    path = write(tmp_path, text + '[[models]]\nname = "coder"\nsource = "org/coder-4bit"\nkeep_alive_s = 600\n')
    result = CliRunner().invoke(cli, ["config", "show", "--config", str(path)])
    assert result.exit_code == 0, result.output
    models = json.loads(result.output)["models"]
    assert [(m["name"], m["source"], m["aliases"]) for m in models] == [
        ("small", "default", ["gpt-4o-mini"]),
        ("coder", "org/coder-4bit", []),
    ]
    assert models[1]["keep_alive_s"] == 600


def test_config_show_reports_bad_values_without_a_traceback(tmp_path):
    path = write(tmp_path, '[model]\ndtype = "int8"\n')
    result = CliRunner().invoke(cli, ["config", "show", "--config", str(path), "--port", "70000"])
    assert result.exit_code == 1
    assert "server.port" in result.output
    assert "Traceback" not in result.output
