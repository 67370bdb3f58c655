"""The W8A16 config names and the shipped per-GPU tables (kernels/tuning.py), on the CPU: every
table entry must name a variant the GPU tests cover and be able to run the launch it is for."""

from __future__ import annotations

import json

import pytest
import torch

from mpinfer.model.kernels import tuning


def test_every_sweep_config_name_round_trips():
    all_names = tuning.names(tuning.SWEEP_FAMILIES, tuning.SWEEP_SPLITS, "float16")
    assert len(set(all_names)) == len(all_names)
    for n in all_names:
        kw, warps, stages = tuning.parse(n)
        assert tuning.name(kw, warps, stages) == n
    bf16 = tuning.names(tuning.SWEEP_FAMILIES, (1,), "bfloat16")
    assert {n.split()[5] for n in bf16} == {"magic0", "magic2"}  # the Triton-op trick is fp16 only
    assert {n.split()[5] for n in all_names} == {"magic0", "magic1", "magic2"}


def test_the_autotuner_tries_only_conversions_its_dtype_can_use():
    for dtype in ("float16", "bfloat16"):
        assert set(tuning.AUTOTUNE_MAGIC[dtype]) <= set(tuning.magics(dtype)), dtype
        assert 2 in tuning.AUTOTUNE_MAGIC[dtype]  # packed PTX won launches of both dtypes
    assert tuning.dtype_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("bad", ["", "dot n64 k128", "mma n64 k128 split1 pf0 magic0 w4 s3",
                                 "dot n64 k128 split1 pf0 magic0 w4 s3 extra"])  # fmt: skip
def test_a_bad_config_name_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="not a W8A16 config name"):
        tuning.parse(bad)


@pytest.mark.parametrize(
    "config, rows, N, K, dtype, why",
    [("fma n8 k512 split1 pf1 magic0 w4 s1", 2, 4096, 4096, "float16", "one row"),
     ("swap n64 k128 split1 pf0 magic0 w4 s4", 1, 4096, 4096, "float16", "several rows"),
     ("dot n64 k128 split1 pf0 magic1 w4 s3", 1, 4096, 4096, "bfloat16", "fp16 only"),
     ("dot n64 k128 split2 pf0 magic0 w4 s3", 64, 250880, 4096, "float16", "workspace"),
     # 2 rows share the 16-row bucket's config: its partials must fit at 16 rows (176B, tp 1)
     ("dot n64 k128 split8 pf0 magic0 w4 s3", 2, 57344, 14336, "float16", "workspace"),
     ("dot n64 k256 split8 pf0 magic0 w4 s3", 1, 4096, 1792, "float16", "shorter than one"),
     ("dot n64 k256 split4 pf0 magic0 w4 s3", 1, 4096, 1792, "float16", None),
     ("fma n8 k512 split1 pf1 magic1 w4 s1", 1, 250880, 4096, "float16", None),
     ("dot n64 k128 split1 pf0 magic2 w4 s3", 1, 4096, 4096, "bfloat16", None)],
)  # fmt: skip
def test_illegal_names_what_stops_a_config(config, rows, N, K, dtype, why):
    got = tuning.illegal(config, rows, N, K, dtype)
    assert (got is None) if why is None else (why in got)


def test_keys_follow_the_row_buckets():
    assert [tuning.row_bucket(r) for r in (1, 2, 16, 17, 32, 33, 64)] == [
        1, 16, 16, 32, 32, 64, 64]  # fmt: skip
    assert tuning.key("bfloat16", 8, 12288, 4096) == "bfloat16 m16 12288x4096"
    with pytest.raises(AssertionError, match="65 rows"):
        tuning.row_bucket(65)  # more rows than a decode launch has


def test_every_shipped_table_is_runnable_and_covered_by_the_gpu_tests():
    tables = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert tables, f"no tuned table under {tuning.TABLE_DIR}"
    families = {tuning.parse(n)[1:] + tuple(sorted(tuning.parse(n)[0].items()))
                for n in tuning.names(tuning.SWEEP_FAMILIES, (1,), "float16")}  # fmt: skip
    for path in tables:
        data = json.loads(path.read_text())
        assert path.stem == tuning.slug(data["gpu"]), path
        assert data["configs"], path
        for key, config in data["configs"].items():
            m = tuning._KEY.fullmatch(key)
            assert m, (path, key)
            dtype, bucket, N, K = m[1], int(m[2]), int(m[3]), int(m[4])
            assert bucket in tuning.ROW_BUCKETS, (path, key)
            # legal at the bucket's largest row count is legal at every smaller one
            assert tuning.illegal(config, bucket, N, K, dtype) is None, (path, key, config)
            kw, warps, stages = tuning.parse(config)
            family = (warps, stages) + tuple(sorted(dict(kw, split_k=1).items()))
            assert family in families, (path, key, config)


def test_lookup_uses_the_table_of_the_gpu_it_runs_on(tmp_path, monkeypatch):
    table = {"gpu": "Some GPU 80GB", "configs": {
        "float16 m1 4096x4096": "fma n8 k512 split1 pf1 magic1 w4 s1",
        "float16 m16 4096x4096": "dot n64 k128 split4 pf0 magic1 w4 s3",
        "bfloat16 m16 4096x4096": "dot n64 k128 split4 pf0 magic1 w4 s3",  # illegal: bf16 magic
    }}  # fmt: skip
    (tmp_path / "some-gpu-80gb.json").write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning.table.cache_clear()
    try:
        assert tuning.lookup("Some GPU 80GB", "float16", 1, 4096, 4096) == table["configs"][
            "float16 m1 4096x4096"]  # fmt: skip
        assert tuning.lookup("Some GPU 80GB", "float16", 9, 4096, 4096).startswith("dot n64")
        assert tuning.lookup("Some GPU 80GB", "float16", 17, 4096, 4096) is None  # not tuned
        assert tuning.lookup("Some GPU 80GB", "bfloat16", 9, 4096, 4096) is None  # cannot run
        assert tuning.lookup("Some GPU", "float16", 1, 4096, 4096) is None  # another GPU
        # the same file name, but the table was measured on a GPU of another name
        assert tuning.lookup("Some GPU-80GB", "float16", 1, 4096, 4096) is None
        monkeypatch.setenv("MPINFER_TUNED", "0")
        tuning.table.cache_clear()
        assert tuning.lookup("Some GPU 80GB", "float16", 1, 4096, 4096) is None
    finally:
        tuning.table.cache_clear()


@pytest.mark.parametrize("text, what", [
    ("{", "not a W8A16 config table"),
    ('{"gpu": "Some GPU", "configs": {"float16 m8 4096x4096": "dot n64 k128 split1 pf0 magic0 '
     'w4 s3"}}', "bad key 'float16 m8 4096x4096'"),
    ('{"gpu": "Some GPU", "configs": {"float16 m1 4096x4096": "dot n64"}}',
     "not a W8A16 config name: 'dot n64'"),
    ('{"gpu": "Some GPU"}', "configs"),
])  # fmt: skip
def test_a_broken_table_is_an_error_naming_the_file(tmp_path, monkeypatch, text, what):
    (tmp_path / "some-gpu.json").write_text(text)
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning.table.cache_clear()
    try:
        with pytest.raises(ValueError, match="some-gpu.json: not a W8A16 config table") as e:
            tuning.lookup("Some GPU", "float16", 1, 4096, 4096)
        assert what in str(e.value)
    finally:
        tuning.table.cache_clear()


def test_the_benchmarked_matmuls_are_the_loaders_shards_and_the_h200_table_covers_them():
    """`bench kernels` derives each rank's matmul shapes from the load plan; the shipped H200
    table has every one of the default models' launches at every row bucket, in both dtypes."""
    from mpinfer.tools.kernelbench import DEFAULT_MODELS, models_shapes

    shapes = models_shapes(DEFAULT_MODELS)
    assert shapes["7b1 qkv"] == (3 * 4096, 4096, "")
    assert shapes["176b/8 dense"] == (14336, 14336 // 8, "residual")
    assert shapes["176b/8 fc1"] == (4 * 14336 // 8, 14336, "gelu")
    assert shapes["176b/8 lm_head"] == (250880 // 8, 14336, "")
    configs = json.loads((tuning.TABLE_DIR / "nvidia-h200.json").read_text())["configs"]
    for N, K, _ in shapes.values():
        for dtype in ("float16", "bfloat16"):
            for bucket in tuning.ROW_BUCKETS:
                assert tuning.key(dtype, bucket, N, K) in configs, (dtype, bucket, N, K)


def test_matmul_shapes_from_a_config_json_and_bad_models(tmp_path):
    from mpinfer.tools.kernelbench import models_shapes

    cfg = {"model_type": "bloom", "vocab_size": 1001, "hidden_size": 64, "n_layer": 2,
           "n_head": 4}  # fmt: skip
    (tmp_path / "my-bloom").mkdir()
    (tmp_path / "my-bloom" / "config.json").write_text(json.dumps(cfg))
    assert models_shapes(f"{tmp_path / 'my-bloom'}:2") == {
        "my-bloom/2 qkv": (96, 64, ""), "my-bloom/2 dense": (64, 32, "residual"),
        "my-bloom/2 fc1": (128, 64, "gelu"), "my-bloom/2 fc2": (64, 128, "residual"),
        "my-bloom/2 lm_head": (501, 64, ""),  # the vocab padded to a multiple of tp
    }  # fmt: skip
    for bad, what in [(f"{tmp_path / 'my-bloom'}:3", "not divisible by tp_size=3"),
                      ("bloom-7b1:x", "must be a positive integer"),
                      ("bloom-7b1:0", "must be a positive integer"),
                      (str(tmp_path / "nothing"), "neither a known shape")]:  # fmt: skip
        with pytest.raises(ValueError, match=what):
            models_shapes(bad)
