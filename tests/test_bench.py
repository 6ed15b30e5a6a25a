"""The benchmark command line runs, prints the table, and rejects unknown benchmarks."""

from __future__ import annotations

import math

import pytest
import torch

from companion.bench import main

COLUMNS = [
    "naive ms",
    "tiled ms",
    "sdpa ms",
    "naive MiB",
    "tiled MiB",
    "sdpa MiB",
    "naive/sdpa time",
    "tiled/sdpa time",
    "naive/tiled mem",
]


def test_attention_prints_one_row_per_length(capsys):
    main(["attention", "--device", "cpu", "--lengths", "64", "128", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = next(line for line in lines if line.strip().startswith("T "))
    for column in COLUMNS:
        assert column in header
    rows = [line.split() for line in lines if line.split()[0] in {"64", "128"}]
    assert [r[0] for r in rows] == ["64", "128"]
    assert all(r[-1].endswith("x") for r in rows)


@pytest.mark.parametrize("argv", [["decodee"], []], ids=["unknown", "missing"])
def test_unknown_or_missing_benchmark_is_a_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "benchmark" in err
    if argv:
        assert "invalid choice: 'decodee'" in err


def test_bad_length_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["attention", "--lengths", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_decode_bench_on_a_tiny_llama():
    transformers = pytest.importorskip("transformers")
    from companion.bench.decode import bench_decode, format_decode
    from companion.checkpoints.transformers import from_hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=1,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(2, 64, (1, 5))
    r = bench_decode(from_hf(hf), hf, ids, new_tokens=6, repeats=1)
    assert r["agreeing_tokens"] == 6 and r["companion_tps"] > 0 and r["bound_tps"] > 0
    table = format_decode(r)
    assert (
        "ratio companion/transformers" in table
        and "identical for the first 6 of 6" in table
    )


def test_sparse_prints_decode_and_prefill_with_crossovers(capsys):
    argv = ["sparse", "--device", "cpu", "--lengths", "32", "64", "--repeats", "1"]
    main([*argv, "--prefill-lengths", "32", "--topk", "8", "64"])
    out = capsys.readouterr().out
    assert "H=16 query heads of width C+R = 256+32" in out  # the shape is said
    for title in ("decode: T = 1 query", "prefill: T = S queries"):
        assert title in out
    for column in ("dense ms", "gather/dense", "(indexer+gather)/dense"):
        assert out.count(column) == 2
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        ("32", "8"),
        ("32", "64"),
        ("64", "8"),
        ("64", "64"),
        ("32", "8"),
        ("32", "64"),
    ]
    assert all(r[-1].endswith("x") for r in rows)
    assert out.count("top-k 8: gather alone ") == 2 and "skipped" not in out


def test_sparse_skips_cells_over_the_memory_cap():
    from companion.bench.sparse import bench_sparse, format_sparse

    cpu = torch.device("cpu")
    results = bench_sparse([64], [64], [8], cpu, repeats=1, max_gib=0.0)
    assert all(
        math.isnan(r[f"{f}_ms"]) and r[f"{f}_gib"] > 0
        for rows in results.values()
        for r in rows
        for f in ("dense", "masked", "gather", "indexer")
    )
    table = format_sparse(results, 0.0)
    assert "skipped (estimate over --max-gib 0" in table
    assert "masked at S=64 top-k=8 (~0.0 GiB)" in table
    assert "gather alone not measured (over the memory cap)" in table


@pytest.mark.parametrize("t", [1, 48], ids=["decode", "prefill"])
def test_sparse_dense_peer_is_sparse_attention_over_every_visible_key(t):
    from companion.bench.sparse import dense_attention, spread_selection
    from companion.ops.sparse_attention import masked_sparse_attention

    s, c, gen = 48, 16, torch.Generator().manual_seed(0)
    q, latent = torch.randn(1, 4, t, c + 8, generator=gen), torch.randn(1, 1, s, c + 8)
    every = spread_selection(s - t, t, s, torch.device("cpu"))  # (1, T, S)
    expected = masked_sparse_attention(q, latent, latent[..., :c], every)
    torch.testing.assert_close(dense_attention(q, latent, c), expected)


def test_sparse_spread_selection_reads_distinct_visible_keys():
    from companion.bench.sparse import spread_selection

    sel = spread_selection(3, 20, 8, torch.device("cpu"))[0]  # positions 3 .. 22
    for p, row in zip(range(3, 23), sel.tolist(), strict=True):
        keys = [j for j in row if j >= 0]
        assert len(keys) == len(set(keys)) == min(8, p + 1)
        assert all(0 <= j <= p for j in keys) and row.count(-1) == 8 - len(keys)


def test_sparse_crossover_needs_the_longest_lengths_to_win():
    from companion.bench.sparse import crossover

    def row(s, dense, gather, indexer=0.0):
        return {
            "S": s,
            "K": 8,
            "dense_ms": dense,
            "gather_ms": gather,
            "indexer_ms": indexer,
        }

    rows = [row(512, 1, 2), row(1024, 1, 0.5), row(2048, 1, 2, 0), row(4096, 2, 1, 1.5)]
    assert crossover(rows, 8, ["gather"]) == (
        "beats dense from S = 4096 (measured S = 512 .. 4096)"
    )
    assert crossover(rows, 8, ["indexer", "gather"]) == (
        "does not beat dense within S = 512 .. 4096"
    )
    rows[-2]["gather_ms"] = math.nan  # a skipped cell is left out
    assert crossover(rows, 8, ["gather"]).startswith("beats dense from S = 1024")


def test_kda_prints_one_row_per_length(capsys):
    argv = ["kda", "--device", "cpu", "--lengths", "32", "48", "--heads", "2"]
    main([*argv, "--dim", "8", "--chunk-size", "16", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    header = next(line for line in lines if line.strip().startswith("T "))
    for column in ("chunk ms", "HF chunk/chunk", "recurrent/chunk", "HF recurrent ms"):
        assert column in header
    rows = [line.split() for line in lines if line.split()[0] in {"32", "48"}]
    assert [r[0] for r in rows] == ["32", "48"]
    # our recurrent/chunk ratio always; transformers' columns a ratio or "—" without it
    assert all(r[-2].endswith("x") for r in rows)
    assert all(r[-1].endswith("x") or r[-1] == "—" for r in rows)


def test_kda_hf_columns_are_transformers_torch_code_or_a_note(monkeypatch):
    from companion.bench import kda

    hf = kda._hf_kda()
    if hf is not None:  # taken from under the kernel-hub dispatch
        for fn in hf:
            assert fn.__module__.endswith("modeling_kimi_linear")
            assert not hasattr(fn, "__wrapped__")
    monkeypatch.setattr(kda, "_hf_kda", lambda: None)
    rows = kda.bench_kda([16], 1, 4, torch.device("cpu"), repeats=1, chunk_size=8)
    assert math.isnan(rows[0]["hf_chunk_ms"]) and rows[0]["recurrent_ms"] > 0
    assert "transformers is not installed, skipped" in kda.format_kda(rows)


def test_bandwidth_prints_one_row_per_length_and_layout(capsys):
    argv = ["bandwidth", "--device", "cpu", "--cache-mib", "1", "2", "--head-dim", "8"]
    main([*argv, "--copy-mib", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "copy bandwidth (read + write):" in out and "GB/s" in out
    header = next(
        line for line in out.splitlines() if line.split()[:2] == ["cache", "layout"]
    )
    for column in ("S", "MiB moved", "ms", "GB/s", "of copy", "GFLOP/s"):
        assert column in header
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    layouts = ["MHA 32:32", "GQA 32:8", "MQA 32:1", "GQA 32:8 repeated"]
    assert [(r[0], " ".join(r[1:-6])) for r in rows] == [
        (mib, name) for mib in ("1", "2") for name in layouts
    ]
    # equal caches: S = 1 MiB / (2 · H_kv · D · 4 bytes); the repeated GQA keeps GQA's
    assert [int(r[-6]) for r in rows[:4]] == [512, 2048, 16384, 2048]
    assert all(r[-2].endswith("%") for r in rows)


def test_bandwidth_counts_the_cache_and_the_repeated_copy():
    from companion.analysis.decode_cost import decode_attention_bytes
    from companion.bench.bandwidth import moved_bytes
    from companion.ops.grouped import expand_kv

    k = torch.zeros(1, 8, 64, 16)  # (B, H_kv, S, D): K, and V of the same size
    grouped = moved_bytes(32, 8, 64, 16, 4)
    assert grouped == 2 * k.nbytes == decode_attention_bytes(2 * 8 * 16, 64, 1, 4)
    copy = 2 * expand_kv(k, 32).nbytes  # the repeated K and V, written then read
    assert moved_bytes(32, 8, 64, 16, 4, repeated=True) == grouped + 2 * copy


def test_kernels_bench_prints_and_writes_every_row(tmp_path, capsys):
    pytest.importorskip("triton")
    import json

    path = tmp_path / "kernels.json"
    main(["kernels", "--tiny", "--repeats", "1", "--out-json", str(path)])
    out = capsys.readouterr().out
    assert "Triton kernels vs PyTorch on" in out and "bf16, torch" in out
    for title in ("attention (base: sdpa)", "gated_delta (base: chunk (torch))"):
        assert title in out
    assert out.count("time/base") == 3 and "add_rms_norm (base: eager)" in out
    report = json.loads(path.read_text())
    assert {"device", "dtype", "torch", "triton", "rows"} <= report.keys()
    rows = report["rows"]
    keys = {"group", "case", "impl", "pass", "ms", "tflops", "gbps", "ratio"}
    assert all(keys | {"baseline", "note"} == r.keys() for r in rows)
    for r in rows:  # measured, or a note saying why not (torch.compile is skipped)
        skipped = r["impl"] == "torch.compile" and r["note"] == "skipped"
        assert skipped or (r["ms"] > 0 and r["note"] is None), r
        if r["impl"] == r["baseline"]:
            assert r["ratio"] == 1.0
    flash = [r for r in rows if r["impl"] == "flash (triton)"]
    assert {r["pass"] for r in flash} == {"fwd", "fwd+bwd"} and len(flash) == 6
    assert all(r["tflops"] > 0 for r in flash)
    fused = [r for r in rows if r["impl"] == "fused (triton)"]
    assert [r["pass"] for r in fused] == ["fwd", "fwd+bwd"]
    assert all(r["gbps"] > 0 and r["ratio"] > 0 for r in fused)
    assert any(r["group"] == "gated_delta" and r["impl"] == "triton" for r in rows)


def test_kernels_bench_without_cuda_says_so(monkeypatch, capsys):
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main(["kernels"])
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_kernels_bench_counts_the_pairs_a_window_lets_through():
    from companion.bench.kernels import visible_pairs

    t, w = 12, 5
    i = torch.arange(t)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    assert visible_pairs(t, w) == band.sum().item()
    assert visible_pairs(t, None) == visible_pairs(t, t) == t * t / 2


def test_weights_bench_reports_forms_and_peers():
    """Each form gets bytes, bound, floor, agreement and loss; a peer gets tokens/s,
    its ratio and its agreement with the fp32 form (here the eager loop of the same
    weights, whose greedy tokens the compiled fp32 form must reproduce)."""
    import copy

    from companion.bench.weights import HF, bench_weights, format_weights
    from companion.layers.weight_quant import quantize_linears
    from companion.models.decoder import DecoderLM
    from companion.models.presets import tiny

    torch.manual_seed(0)
    fp32 = DecoderLM(tiny()).eval()
    models = {"fp32": fp32, "int8": quantize_linears(copy.deepcopy(fp32))}
    peers = {HF: lambda ids: fp32.generate(ids, 4)[:, ids.shape[1] :]}
    prompts = torch.randint(0, fp32.cfg.vocab_size, (2, 5))
    windows = torch.randint(0, fp32.cfg.vocab_size, (2, 40))
    r = bench_weights(models, peers, prompts, windows, new_tokens=4, repeats=1)
    assert r[HF]["agree"] == [4, 4]
    assert r["int8"]["mb"] < r["fp32"]["mb"] and r["int8"]["floor_tps"] > 0
    table = format_weights(r)
    assert table.splitlines()[3].startswith(HF) and "1.00x" in table.splitlines()[3]
