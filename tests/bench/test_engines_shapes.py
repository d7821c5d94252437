"""bench/engines_shapes.py's table: each cell's ratio, its verdict and the bound that binds there."""

from bench.engines_shapes import table


def _row(engine, dtype, seqs, tps, of_peak, of_read):
    return {"engine": engine, "dtype": dtype, "seqs": seqs, "tps": tps, "of_peak": of_peak, "of_read": of_read}


def test_each_cell_has_its_ratio_verdict_and_binding_bound():
    rows = [_row("a", "bfloat16", 32, 100.0, 0.1, 0.5), _row("d", "bfloat16", 32, 160.0, 0.2, 0.8),
            _row("a", "bfloat16", 256, 200.0, 0.3, 0.2), _row("d", "bfloat16", 256, 280.0, 0.42, 0.3),
            _row("d", "float32", 32, 50.0, 0.1, 0.5)]  # no vLLM row: no cell
    lines = table({"qwen3-1.7b": {"rows": rows}}).splitlines()
    assert len(lines) == 3
    assert lines[1].split()[:6] == ["qwen3-1.7b", "bfloat16", "32", "100.0", "160.0", "1.60"]
    assert "0.80 of read bound" in lines[1] and lines[1].endswith("ok")
    assert lines[2].split()[5] == "1.40" and "0.42 of matmul probe" in lines[2] and lines[2].endswith("MISSED")
