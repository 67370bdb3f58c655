"""The matmul kernels' config names, the default rule and the shipped per-GPU tables
(kernels/tuning.py), on the CPU: every table entry must name a variant the GPU tests cover and be
able to run the launch it is for."""

from __future__ import annotations

import json

import pytest

from mpinfer.model.kernels import tuning


def _name_sets():
    return [
        tuning.names(tuning.SWEEP_FAMILIES, tuning.SWEEP_SPLITS, "float16"),
        tuning.names(tuning.TILED_FAMILIES, tuning.TILED_SPLITS, "float16"),
        tuning.names(tuning.FEW_ROW_TMA, tuning.TILED_SPLITS, "float16"),
        tuning.names(tuning.INT4_FAMILIES, tuning.SWEEP_SPLITS, "float16", bits=4),
    ]


def _all_names():
    return [n for names in _name_sets() for n in names]


def test_every_sweep_config_name_round_trips():
    for names in _name_sets():
        assert len(set(names)) == len(names)
    all_names = _all_names()
    for n in all_names:
        kw, warps, stages = tuning.parse(n)
        assert tuning.name(kw, warps, stages) == n
    bf16 = tuning.names(tuning.SWEEP_FAMILIES, (1,), "bfloat16")
    assert {n.split()[5] for n in bf16} == {"magic0", "magic2"}  # the Triton-op trick is fp16 only
    assert {n.split()[5] for n in all_names} == {f"magic{m}" for m in range(10)}
    # int4's pairs (magic7): fp16, the swap loop only, and the one loop that runs one row by
    # tensor cores
    int4_fp16 = tuning.names(tuning.INT4_FAMILIES, (1,), "float16", bits=4)
    magic7 = [n for n in int4_fp16 if n.split()[5] == "magic7"]
    assert magic7 and all(n.startswith("swap") for n in magic7)
    assert not tuning.illegal(magic7[0], 1, 4096, 4096, "float16", bits=4, group=128)
    assert tuning.illegal(magic7[0], 1, 4096, 4096, "bfloat16", bits=4, group=128)
    # int4's packed fp16 products (magic8): fp16, the one-row loop only
    magic8 = [n for n in int4_fp16 if n.split()[5] in ("magic8", "magic9")]
    assert magic8 and all(n.startswith("fma") for n in magic8)
    assert not tuning.illegal(magic8[0], 1, 4096, 4096, "float16", bits=4, group=128)
    assert tuning.illegal(magic8[0], 1, 4096, 4096, "bfloat16", bits=4, group=128)
    assert tuning.illegal(magic8[0].replace("fma", "dot"), 1, 4096, 4096, "float16", bits=4,
                          group=128)  # fmt: skip
    int4 = tuning.names(tuning.INT4_FAMILIES, (1,), "bfloat16", bits=4, group=64)
    assert {n.split()[5] for n in int4} == {"magic0", "magic2", "magic3", "magic4", "magic5"}
    # the fp32 mantissa trick is the one-row int4 loop's alone, and int8 never sweeps it
    assert all(n.startswith("fma") for n in int4 if n.split()[5] in ("magic3", "magic4", "magic5"))
    int8 = tuning.names(tuning.SWEEP_FAMILIES + tuning.TILED_FAMILIES, (1,), "float16")
    assert {n.split()[5] for n in int8} == {"magic0", "magic1", "magic2", "magic6"}
    # int8's pair conversion is the swap loops' alone (pointer-loaded and warp-specialized),
    # and fp16's
    assert all(n.startswith(("swap", "tma")) for n in int8 if n.split()[5] == "magic6")
    # the warp-specialized loop: int8's tiles of rows, 4 warps, rows of 16 bytes
    tma = [n for n in int8 if n.startswith("tma")]
    assert tma and all(tuning.parse(n)[0]["SWAP"] for n in tma)
    assert not tuning.illegal(tma[0], 200, 4096, 4096, "float16")
    for bad in (dict(rows=32), dict(K=4104), dict(bits=4, group=128)):
        args = dict(rows=200, N=4096, K=4096, dtype="float16") | bad
        assert tuning.illegal(tma[0], **args), bad
    # the few-row tma loop: one tile of the bucket's rows (no BLOCK_M), 17-64 rows
    few = [n for n in tuning.candidates(64, "float16") if n.startswith("tma")]
    assert few and few == [n for n in tuning.candidates(32, "float16") if n.startswith("tma")]
    assert not any(n.startswith("tma") for n in tuning.candidates(16, "float16"))
    assert all(tuning.parse(n)[0]["BLOCK_M"] == 0 for n in few)
    assert not tuning.illegal(few[0], 20, 4096, 4096, "float16")
    assert not tuning.illegal(few[0], 64, 4096, 4096, "float16")
    for rows in (16, 1, 200):  # too few rows for it, or a tiled bucket (which names its tile)
        assert tuning.illegal(few[0], rows, 4096, 4096, "float16"), rows
    # a split: legal while the partials fit the workspace and each split has a K tile
    assert not tuning.illegal(tma[0].replace("split1", "split2"), 200, 4096, 4096, "float16")
    assert tuning.illegal(tma[0].replace("split1", "split4"), 200, 16384, 4096, "float16")
    assert tuning.illegal(tma[0].replace("split1", "split4"), 200, 4096, 128, "float16")
    assert tuning.illegal(tma[0].replace(" w4 ", " w8 "), 200, 4096, 4096, "float16")
    # int4 has no tma configs (they lost every launch, round 15; `illegal` refuses one above)
    assert not any(n.startswith("tma") for n in tuning.candidates(256, "float16", bits=4))
    assert "magic6" not in {n.split()[5] for n in bf16}
    assert {n.split()[2] for n in int4} == {"k64"}
    assert tuning.parse("swap n128 k64 split1 pf0 magic2 w8 s3 m128")[0]["BLOCK_M"] == 128
    capped = tuning.parse("fma n64 k128 split8 pf1 magic5 w4 s3 r80")[0]
    assert capped["MAXNREG"] == 80 and capped["PREFETCH"] == 1
    assert any(n.endswith(" r80") for n in tuning.names(tuning.INT4_FAMILIES, (1,), "float16",
                                                          bits=4))  # fmt: skip


@pytest.mark.parametrize("bad", ["", "dot n64 k128", "mma n64 k128 split1 pf0 magic0 w4 s3",
                                 "dot n64 k128 split1 pf0 magic0 w4 s3 extra"])  # fmt: skip
def test_a_bad_config_name_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="not a kernel config name"):
        tuning.parse(bad)


@pytest.mark.parametrize(
    "config, rows, N, K, dtype, bits, why",
    [("fma n8 k512 split1 pf1 magic0 w4 s1", 2, 4096, 4096, "float16", 8, "one row"),
     ("swap n64 k128 split1 pf0 magic0 w4 s4", 1, 4096, 4096, "float16", 8, "several rows"),
     ("dot n64 k128 split1 pf0 magic1 w4 s3", 1, 4096, 4096, "bfloat16", 8, "fp16 only"),
     ("dot n64 k128 split1 pf0 magic2 w4 s3", 16, 4096, 4096, "bfloat16", 4, "fp16 weights"),
     ("dot n64 k128 split2 pf0 magic0 w4 s3", 64, 250880, 4096, "float16", 8, "workspace"),
     # 17 rows share the 32-row bucket's config: its partials must fit at 32 rows (176B, tp 1)
     ("dot n64 k128 split8 pf0 magic0 w4 s3", 17, 57344, 14336, "float16", 8, "workspace"),
     ("dot n64 k256 split8 pf0 magic0 w4 s3", 1, 4096, 1792, "float16", 8, "shorter than one"),
     ("dot n64 k128 split1 pf0 magic0 w4 s3", 100, 4096, 4096, "float16", 8, "need a BLOCK_M"),
     ("dot n64 k128 split1 pf0 magic0 w4 s3 m64", 64, 4096, 4096, "float16", 8, "for more"),
     ("dot n64 k64 split1 pf0 magic0 w4 s3", 16, 4096, 4096, "float16", 4, "group size (128)"),
     # more rows than the largest bucket: the partials must fit at the launch's own rows
     ("swap n128 k64 split2 pf0 magic0 w8 s3 m128", 2048, 4096, 4096, "float16", 8, "workspace"),
     ("dot n64 k256 split4 pf0 magic0 w4 s3", 1, 4096, 1792, "float16", 8, None),
     ("fma n8 k512 split1 pf1 magic1 w4 s1", 1, 250880, 4096, "float16", 8, None),
     ("dot n64 k128 split1 pf0 magic2 w4 s3", 1, 4096, 4096, "bfloat16", 8, None),
     ("fma n16 k128 split1 pf0 magic2 w4 s3", 1, 4096, 4096, "bfloat16", 4, None),
     ("fma n64 k128 split4 pf0 magic4 w4 s3", 1, 4096, 4096, "bfloat16", 4, None),
     ("fma n64 k128 split4 pf0 magic3 w4 s3", 1, 4096, 4096, "float16", 8, "are int4's"),
     ("dot n64 k128 split1 pf0 magic6 w4 s3", 16, 4096, 4096, "float16", 8, "swap loop"),
     ("swap n64 k128 split1 pf0 magic6 w4 s4", 16, 4096, 4096, "bfloat16", 8, "from int8 only"),
     ("swap n64 k128 split1 pf0 magic6 w4 s4", 16, 4096, 4096, "float16", 4, "from int8 only"),
     ("swap n128 k64 split1 pf0 magic6 w8 s3 m256", 512, 4096, 4096, "float16", 8, None),
     ("dot n64 k128 split4 pf0 magic4 w4 s3", 16, 4096, 4096, "float16", 4, "one-row loop"),
     ("swap n64 k128 split1 pf0 magic2 w4 s4", 16, 4096, 4096, "float16", 4, "not repeatable"),
     ("dot n64 k128 split4 pf0 magic2 w4 s3", 1, 4096, 4096, "float16", 4, None),
     ("swap n128 k128 split3 pf0 magic1 w8 s3 m64", 576, 5376, 14336, "float16", 4, "workspace"),
     ("swap n128 k128 split2 pf0 magic1 w8 s3 m64", 300, 5376, 14336, "float16", 4, None),
     ("swap n128 k64 split1 pf0 magic0 w8 s3 m128", 5000, 4096, 4096, "bfloat16", 8, None)],
)  # fmt: skip
def test_illegal_names_what_stops_a_config(config, rows, N, K, dtype, bits, why):
    got = tuning.illegal(config, rows, N, K, dtype, bits=bits, group=128 if bits == 4 else 0)
    assert (got is None) if why is None else (why in got)


def test_keys_follow_the_row_buckets():
    rows = (1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 576, 1024, 5000)
    assert [tuning.row_bucket(r) for r in rows] == [
        1, 16, 16, 32, 32, 64, 64, 128, 128, 256, 1024, 1024, 1024]  # fmt: skip
    assert tuning.key("bfloat16", 8, 12288, 4096) == "bfloat16 m16 12288x4096"
    assert tuning.key("float16", 300, 12288, 4096, bits=4, group=128) == (
        "int4g128 float16 m512 12288x4096"
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_the_default_rule_is_legal_and_fills_the_gpu_for_every_bucket(bits):
    """A launch no table has gets `default_config`: a function of the shape and the GPU's
    size only (no timing at start-up), legal at its whole bucket, with enough programs for
    every SM where a legal split allows it."""
    from mpinfer.tools.kernelbench import DEFAULT_MODELS, models_shapes

    shapes = list(models_shapes(DEFAULT_MODELS).values()) + [(1000, 2048, ""), (96, 256, "")]
    for N, K, _ in shapes:
        for rows in (1, 2, 16, 33, 64, 65, 200, 576, 3000):
            for dtype in ("float16", "bfloat16"):
                group = 128 if bits == 4 else 0
                config = tuning.default_config(rows, N, K, dtype, 132, bits=bits, group=group)
                assert config == tuning.default_config(rows, N, K, dtype, 132, bits=bits,
                                                       group=group)  # fmt: skip
                why = tuning.illegal(config, rows, N, K, dtype, bits=bits, group=group)
                assert why is None, (N, K, rows, dtype, config, why)
                kw, _, _ = tuning.parse(config)
                tiles = -(-N // kw["BLOCK_N"]) * (-(-rows // tuning.block_m(kw, rows))
                                                  if kw["USE_DOT"] else 1)  # fmt: skip
                more = kw["split_k"] * 2 if kw["split_k"] > 1 else 2
                bigger = config.replace(f"split{kw['split_k']} ", f"split{more} ")
                assert tiles * kw["split_k"] >= 132 or tuning.illegal(
                    bigger, rows, N, K, dtype, bits=bits, group=group) or kw["split_k"] == 8, (
                    N, K, rows, config)  # fmt: skip


def test_the_one_row_int4_rule_keeps_three_groups_a_split_and_widens_big_weights():
    """Round 6's rule for one-row int4 launches no table has: as many splits as leave at least
    three groups each (never fewer than fill the GPU), and two groups an iteration from 64 MiB
    of weight (BLOOM-176B's tp-1 matrices)."""
    from mpinfer.tools.kernelbench import models_shapes

    shapes = list(models_shapes("bloom-7b1,bloom-176b:8,bloom-176b").values())
    assert any(N * K // 2 >= 64 << 20 for N, K, _ in shapes)  # both sides of the threshold
    for N, K, _ in shapes:
        kw, _, _ = tuning.parse(tuning.default_config(1, N, K, "float16", 132, bits=4, group=128))
        groups, split = K // 128, kw["split_k"]
        assert kw["PREFETCH"] == int(N * K // 2 >= 64 << 20), (N, K)
        assert groups >= 3 * split, (N, K, split)
        more = next((s for s in (1, 2, 3, 4, 6, 8) if s > split), None)
        assert more is None or groups < 3 * more, (N, K, split)  # no larger split keeps three


def test_every_shipped_table_is_runnable_and_covered_by_the_gpu_tests():
    tables = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert tables, f"no tuned table under {tuning.TABLE_DIR}"
    families = {tuning.parse(n)[1:] + tuple(sorted(dict(tuning.parse(n)[0], split_k=1).items()))
                for n in _all_names() + tuning.names(tuning.SWEEP_FAMILIES + tuning.TILED_FAMILIES,
                                                     (1,), "bfloat16")}  # fmt: skip
    for path in tables:
        data = json.loads(path.read_text())
        assert path.stem == tuning.slug(data["gpu"]), path
        assert data["configs"], path
        for key, config in data["configs"].items():
            m = tuning._KEY.fullmatch(key)
            assert m, (path, key)
            group, dtype, bucket, N, K = int(m[1] or 0), m[2], int(m[3]), int(m[4]), int(m[5])
            bits = 4 if group else 8
            assert bucket in tuning.ROW_BUCKETS, (path, key)
            # legal at the bucket's largest row count is legal at every smaller one
            why = tuning.illegal(config, bucket, N, K, dtype, bits=bits, group=group)
            assert why is None, (path, key, config, why)
            kw, warps, stages = tuning.parse(config)
            family = (warps, stages) + tuple(
                sorted(dict(kw, split_k=1, BLOCK_K=kw["BLOCK_K"] if bits == 8 else 128).items())
            )
            assert family in families, (path, key, config)


def test_lookup_uses_the_table_of_the_gpu_it_runs_on(tmp_path, monkeypatch):
    table = {"gpu": "Some GPU 80GB", "dequant_rows": 512, "int4_dequant_rows": 1024, "configs": {
        "float16 m1 4096x4096": "fma n8 k512 split1 pf1 magic1 w4 s1",
        "float16 m16 4096x4096": "dot n64 k128 split4 pf0 magic1 w4 s3",
        "bfloat16 m16 4096x4096": "dot n64 k128 split4 pf0 magic1 w4 s3",  # illegal: bf16 magic
    }}  # fmt: skip
    (tmp_path / "some-gpu-80gb.json").write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning._shipped.cache_clear()
    try:
        assert tuning.lookup("Some GPU 80GB", "float16", 1, 4096, 4096) == table["configs"][
            "float16 m1 4096x4096"]  # fmt: skip
        assert tuning.lookup("Some GPU 80GB", "float16", 9, 4096, 4096).startswith("dot n64")
        assert tuning.lookup("Some GPU 80GB", "float16", 17, 4096, 4096) is None  # not tuned
        assert tuning.lookup("Some GPU 80GB", "bfloat16", 9, 4096, 4096) is None  # cannot run
        assert tuning.dequant_rows("Some GPU 80GB") == 512
        assert tuning.dequant_rows("Some GPU 80GB", 4) == 1024  # int4's, measured apart
        assert tuning.lookup("Some GPU", "float16", 1, 4096, 4096) is None  # another GPU
        assert tuning.dequant_rows("Some GPU") is None
        # the same file name, but the table was measured on a GPU of another name
        assert tuning.lookup("Some GPU-80GB", "float16", 1, 4096, 4096) is None
        monkeypatch.setenv("MPINFER_TUNED", "0")
        tuning._shipped.cache_clear()
        assert tuning.lookup("Some GPU 80GB", "float16", 1, 4096, 4096) is None
    finally:
        tuning._shipped.cache_clear()


@pytest.mark.parametrize("text, what", [
    ("{", "not a kernel config table"),
    ('{"gpu": "Some GPU", "configs": {"float16 m8 4096x4096": "dot n64 k128 split1 pf0 magic0 '
     'w4 s3"}}', "bad key 'float16 m8 4096x4096'"),
    ('{"gpu": "Some GPU", "configs": {"float16 m1 4096x4096": "dot n64"}}',
     "not a kernel config name: 'dot n64'"),
    ('{"gpu": "Some GPU"}', "configs"),
    ('{"gpu": "Some GPU", "configs": {}, "dequant_rows": 16}', "dequant_rows=16"),
    ('{"gpu": "Some GPU", "configs": {}, "int4_dequant_rows": "512"}', "int4_dequant_rows='512'"),
])  # fmt: skip
def test_a_broken_table_is_an_error_naming_the_file(tmp_path, monkeypatch, text, what):
    (tmp_path / "some-gpu.json").write_text(text)
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning._shipped.cache_clear()
    try:
        with pytest.raises(ValueError, match="some-gpu.json: not a kernel config table") as e:
            tuning.lookup("Some GPU", "float16", 1, 4096, 4096)
        assert what in str(e.value)
    finally:
        tuning._shipped.cache_clear()


def test_the_benchmarked_matmuls_are_the_loaders_shards_and_the_h200_table_covers_them():
    """`bench kernels` derives each rank's matmul shapes from the load plan; the shipped H200
    table has every one of the default models' launches at every row bucket, in both dtypes."""
    from mpinfer.tools.kernelbench import DEFAULT_MODELS, models_shapes

    shapes = models_shapes(DEFAULT_MODELS)
    assert shapes["7b1 qkv"] == (3 * 4096, 4096, "")
    assert shapes["176b/8 dense"] == (14336, 14336 // 8, "residual")
    assert shapes["176b/8 fc1"] == (4 * 14336 // 8, 14336, "gelu")
    assert shapes["176b/8 lm_head"] == (250880 // 8, 14336, "")
    from mpinfer.tools.kernelbench import runs_as

    configs = json.loads((tuning.TABLE_DIR / "nvidia-h200.json").read_text())["configs"]
    for name, (N, K, _) in shapes.items():
        for dtype in ("float16", "bfloat16"):
            for bucket in tuning.ROW_BUCKETS:
                for bits in (8, 4):
                    if runs_as(name, bucket, bits):
                        key = tuning.key(dtype, bucket, N, K, bits=bits, group=128)
                        assert key in configs, key


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


def test_a_tables_crossover_moves_where_int8_launches_dequantize(monkeypatch):
    """kernels._many: launches of more than DEQUANT_ROWS rows dequantize their weight, unless
    the GPU's table names its measured crossover for that weight width (int8's and int4's
    apart), and the diagnostic override wins over both."""
    from types import SimpleNamespace

    from mpinfer.model import kernels

    def launch(rows):  # what _many reads of an activation tensor on GPU 0
        return SimpleNamespace(numel=lambda: rows * 64, shape=(rows, 64), is_cuda=True,
                               device=SimpleNamespace(index=0))  # fmt: skip

    crossovers = {8: 512, 4: None}  # what a table without int4's entry gives
    monkeypatch.setattr(kernels, "_table_rows",
                        lambda index, bits: crossovers[bits] or kernels.DEQUANT_ROWS)  # fmt: skip
    assert [kernels._many(launch(r), bits=8) for r in (256, 257, 512, 513)] == [
        False, False, False, True]  # fmt: skip
    assert [kernels._many(launch(r), bits=4) for r in (256, 257)] == [False, True]
    crossovers.update({8: None, 4: 1024})
    assert [kernels._many(launch(r), bits=8) for r in (256, 257)] == [False, True]
    assert [kernels._many(launch(r), bits=4) for r in (1024, 1025)] == [False, True]
    crossovers[4] = None
    monkeypatch.setattr(kernels, "FORCE_DEQUANT_ROWS", 1024)
    assert not kernels._many(launch(1000), bits=4)
