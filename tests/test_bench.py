"""The benchmark command line runs, prints the table, and rejects unknown benchmarks."""

from __future__ import annotations

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
