"""CPU tests of the decode GEMM (loraserve.kernels.dense_gemm) under TRITON_INTERPRET=1.
GPU tests: test_dense_gemm_gpu.py."""

import json

import pytest
import torch

# On a CPU box conftest.py has put Triton in interpreter mode before any import.
pytest.importorskip("triton")

from loraserve.kernels import dense_gemm  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter tests; the GPU has test_dense_gemm_gpu.py"
)


def make(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def config(block_n, block_k, split):
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 2}


@pytest.mark.parametrize(
    "m,n,k,block_n,block_k,split,bias",
    [
        (1, 64, 256, 32, 64, 1, False),  # even N and K, one split
        (5, 100, 200, 32, 64, 4, True),  # ragged N and K, split-K, bias
        (16, 128, 512, 64, 128, 2, False),  # split-K, even
        (20, 96, 384, 32, 64, 8, True),  # more splits than the heuristic would pick
        (33, 48, 64, 32, 64, 4, False),  # K shorter than the splits: empty splits
    ],
)
def test_matches_torch_fp32(m, n, k, block_n, block_k, split, bias):
    x, w, b = make(m, n, k, bias)
    y = dense_gemm.dense_linear(x, w, b, config=config(block_n, block_k, split))
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "m,inter,k,block_n,split,bias",
    [
        (3, 100, 200, 32, 1, True),  # ragged: 16 gate rows and 16 up rows a program
        (17, 64, 512, 64, 4, False),  # split-K: both halves' partials summed
        (8, 48, 384, 32, 8, True),  # more splits, bias on both halves
    ],
)
def test_gate_up_with_silu_and_mul_in_the_epilogue(m, inter, k, block_n, split, bias):
    x, w, b = make(m, 2 * inter, k, bias)
    y = dense_gemm.dense_linear(x, w, b, config=config(block_n, 64, split), silu_mul=True)
    gate_up = torch.nn.functional.linear(x.double(), w.double(),
                                         None if b is None else b.double())
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert int(dense_gemm._lock_buffer(x.device).abs().sum()) == 0


def test_split_k_is_deterministic_and_puts_its_counters_back():
    x, w, b = make(7, 96, 512, bias=True, seed=1)
    cfg = config(32, 64, 4)
    first = dense_gemm.dense_linear(x, w, b, config=cfg)
    second = dense_gemm.dense_linear(x, w, b, config=cfg)
    assert torch.equal(first, second)
    assert int(dense_gemm._lock_buffer(x.device).abs().sum()) == 0


def test_default_config_with_strided_rows():
    # Rows of x further apart than K (a view of a wider tensor).
    wide = torch.randn(6, 300)
    x = wide[:, :256]
    w = torch.randn(80, 256) / 16
    y = dense_gemm.dense_linear(x, w)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


def test_more_tokens_than_the_kernel_is_for_are_refused():
    x, w, _ = make(dense_gemm.MAX_TOKENS + 1, 32, 64, bias=False)
    with pytest.raises(AssertionError, match="tokens"):
        dense_gemm.dense_linear(x, w)


@pytest.fixture
def dense_table(tmp_path, monkeypatch):
    """A tuned table with one config entry and one cuBLAS entry, read in place of
    the GPU's own; the lookups are reloaded on the way in and out."""
    from loraserve.kernels import lora_config

    table = {"dense": {
        "T32_N384_K512": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4,
                          "num_stages": 2},
        "T32_N256_K512": {"CUBLAS": 1},
    }}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("LORASERVE_LORA_CONFIG", str(path))
    lora_config.reload_tuned_table()
    yield
    monkeypatch.undo()
    lora_config.reload_tuned_table()


def test_the_table_decides_between_the_kernel_and_cublas(dense_table):
    use = dense_gemm.use_kernel
    assert use(21, 384, 512)  # tuned: T32 bucket
    assert use(1, 384, 512)  # T16 bucket: the nearest tuned one, within a factor of 4
    assert not use(21, 256, 512)  # cuBLAS won there
    assert use(21, 128, 512)  # sizes the table lacks: the default config
    assert not use(dense_gemm.MAX_TOKENS + 1, 384, 512)  # a prefill-sized batch
    assert dense_gemm.dense_config(21, 384, 512)["BLOCK_N"] == 32


def test_a_gpu_without_a_tuned_decode_gemm_keeps_cublas(tmp_path, monkeypatch):
    from loraserve.kernels import lora_config

    path = tmp_path / "table.json"
    path.write_text(json.dumps({"shrink": {}}))
    monkeypatch.setenv("LORASERVE_LORA_CONFIG", str(path))
    lora_config.reload_tuned_table()
    try:
        assert not dense_gemm.use_kernel(21, 384, 512)
    finally:
        monkeypatch.undo()
        lora_config.reload_tuned_table()


def test_a_kernel_table_named_in_the_environment_must_exist(tmp_path, monkeypatch):
    # LORASERVE_LORA_CONFIG is the user's choice: a wrong path is an error, not a
    # silent fall-back to the heuristics.
    from loraserve.kernels import lora_config

    missing = tmp_path / "no_such_table.json"
    monkeypatch.setenv("LORASERVE_LORA_CONFIG", str(missing))
    lora_config.reload_tuned_table()
    try:
        with pytest.raises(FileNotFoundError, match="LORASERVE_LORA_CONFIG.*no_such_table"):
            dense_gemm.use_kernel(21, 384, 512)
    finally:
        monkeypatch.undo()
        lora_config.reload_tuned_table()


def test_a_gpu_without_its_own_table_reads_a_siblings(tmp_path, monkeypatch):
    # An H100 SXM has no table of its own; the H200's records the same capability and
    # SM count, so its tuned tiles are taken over the heuristics. Another SM count
    # (an H100 PCIe: 114) finds no sibling and stays on the heuristics.
    from loraserve.kernels import lora_config

    h200 = json.loads((lora_config.CONFIG_DIR / "NVIDIA_H200.json").read_text())
    assert (h200["capability"], h200["num_sms"]) == ("9.0", 132)
    (tmp_path / "A.json").write_text(json.dumps({"capability": "8.0", "num_sms": 132}))
    (tmp_path / "B.json").write_text(json.dumps(h200))
    assert lora_config.sibling_table("9.0", 132, tmp_path) == tmp_path / "B.json"
    assert lora_config.sibling_table("9.0", 114, tmp_path) is None

    monkeypatch.delenv("LORASERVE_LORA_CONFIG", raising=False)
    for device, tuned in ((("NVIDIA H100 80GB HBM3", "9.0", 132), True),
                          (("NVIDIA H100 PCIe", "9.0", 114), False)):
        monkeypatch.setattr(lora_config, "_device", lambda device=device: device)
        lora_config.reload_tuned_table()
        try:
            assert lora_config.has_dense_table() is tuned
            key = next(iter(h200["shrink"]))
            assert (lora_config._tuned_table().get("shrink", {}).get(key) is not None) is tuned
        finally:
            lora_config.reload_tuned_table()
