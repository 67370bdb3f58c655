"""Config parsing: TOML + --set overrides, and errors that name the key."""

import pytest

from mpinfer.config import load_config

from .conftest import ROOT


def test_shipped_configs_parse():
    paths = sorted((ROOT / "configs").glob("*.toml"))
    assert len(paths) >= 5, paths  # the glob found the configs (it passed on none, once)
    for path in paths:
        cfg = load_config(str(path))
        assert cfg.model.arch and (ROOT / cfg.model.arch).is_file(), path  # plan works offline


def test_overrides_apply_with_types(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\npath = "/m"\n[generation]\ntemperature = 0.5\n')
    cfg = load_config(str(f), ["generation.top_k=40", "quant.method=none", "server.port=9000"])
    assert cfg.model.path == "/m" and cfg.generation.temperature == 0.5
    assert cfg.generation.top_k == 40 and cfg.quant.method == "none" and cfg.server.port == 9000
    # An int is accepted where a float is expected.
    assert load_config(None, ["generation.temperature=1"]).generation.temperature == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.colour=1", "unknown config key model.colour"),
        ("modle.path=x", "unknown config section [modle]: did you mean model?"),
        ("server.prot=1", "unknown config key server.prot: did you mean server.port?"),
        ("generation.top_k=1.5", "generation.top_k: expected int"),
        ("generation.do_sample=1", "generation.do_sample: expected bool"),
        ('server.port="80"', "server.port: expected int"),
        ("quant.method=int3", "quant.method='int3'"),
        ("generation.top_p=0", "generation.top_p=0.0 must be in (0, 1]"),
        ("model.dtype=float64", "model.dtype='float64'"),
        ("nodot=3", "the key must be section.key"),
        ('server.step_buckets="pow2"', "server.step_buckets='pow2': expected 'auto' or token"),
        ('server.step_buckets="8,0,64"', "server.step_buckets='8,0,64'"),
        ("server.kv_block_size=0", "server.kv_block_size=0 must be > 0"),
        ("server.max_step_tokens=-1", "server.max_step_tokens=-1 must be >= 0"),
        ("server.prefill_hold_steps=-2", "server.prefill_hold_steps=-2 must be >= 0"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_unknown_key_in_file_is_named(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[parallel]\ntp = 2\n")
    with pytest.raises(ValueError, match="unknown config key parallel.tp"):
        load_config(str(f))


def test_step_buckets_take_a_list_of_token_counts():
    assert load_config(None, ['server.step_buckets="1, 8,64"']).server.step_buckets == "1, 8,64"
