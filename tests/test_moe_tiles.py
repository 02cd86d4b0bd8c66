"""Per-layer-shape tiles of the fused-MoE GEMMs (kernels/triton/moe_tiles.py): which row serves
which (experts, intermediate, rows per expert), the kernels exact under a listed row, and bad
vendor rows refused with the reason."""
import pytest
import torch

from graft.errors import GraftInputError
from graft.kernels.triton import moe_fused_experts as fused
from graft.kernels.triton import moe_fused_experts_fp8 as fused_fp8
from graft.kernels.triton import moe_tiles
from graft.ops import moe

pytestmark = pytest.mark.usefixtures("fresh_graft")


@pytest.fixture
def interpreter_rows(monkeypatch):
    """A listed shape for the interpreter (8 experts, intermediate 40): 1-2 rows per expert take a
    32-row M tile (not the interpreter's generic 16), more take 16 rows with a narrow N tile."""
    rows = {g: dict(shapes) for g, shapes in moe_tiles.SHAPES.items()}
    monkeypatch.setattr(moe_tiles, "SHAPES", rows)
    narrow = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    tall = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=1, num_stages=1)
    moe_tiles.add_shape_tiles("interpreter", 8, 40, ((2, tall), (None, narrow)))
    return tall, narrow


def test_rows_are_chosen_by_shape_and_rows_per_expert():
    hopper = moe_tiles.SHAPES["hopper"]
    # DeepSeek-V3 decode (8 tokens x top-8 over 256 experts: a quarter row each): the narrow N tile.
    assert moe_tiles.shape_tile("hopper", 256, 2048, 64) == dict(hopper[(256, 2048)][0][1])
    assert moe_tiles.shape_tile("hopper", 256, 2048, 64)["BLOCK_N"] == 64
    # Mixtral prefill (4096 tokens x top-2 over 8 experts: 1024 rows each): the 128-row tile, 8 warps.
    huge = moe_tiles.shape_tile("hopper", 8, 14336, 8192)
    assert huge["BLOCK_M"] == 128 and huge["num_warps"] == 8
    # Bounds are inclusive: 16 rows per expert is still decode, 17 is not.
    assert moe_tiles.shape_tile("hopper", 8, 14336, 128)["BLOCK_M"] == 16
    assert moe_tiles.shape_tile("hopper", 8, 14336, 136)["BLOCK_M"] == 32
    # Unlisted shape, unlisted generation: None (the generic rows serve).
    assert moe_tiles.shape_tile("hopper", 8, 1000, 64) is None
    assert moe_tiles.shape_tile("ampere", 8, 14336, 64) is None


def test_every_listed_tile_fits_the_dot_minimums_and_the_aot_check_compiles_each():
    for generation, shapes in moe_tiles.SHAPES.items():
        for (experts, inter), rows in shapes.items():
            assert rows[-1][0] is None, (generation, experts, inter)
            for _, tile in rows:
                assert tile["BLOCK_M"] >= 16 and tile["BLOCK_N"] % 32 == 0 and tile["BLOCK_K"] >= 16
    # Every distinct tile of each GPU generation is among the AOT variants (bf16 and fp8 GEMMs).
    for module, kernel in ((fused, fused._gate_up_kernel), (fused_fp8, fused_fp8._gate_up_fp8_kernel)):
        for target, generation in (("sm_90", "hopper"), ("gfx942", "cdna3")):
            compiled = {(v.constexprs["BLOCK_M"], v.constexprs["BLOCK_N"] * 2, v.options.get("num_warps"))
                        for v in module.aot_variants() if v.kernel is kernel and v.targets == (target,)}
            for tile in moe_tiles.distinct_tiles(generation):
                assert (tile["BLOCK_M"], tile["BLOCK_N"], tile["num_warps"]) in compiled, (module.__name__, tile)


def test_launch_config_takes_the_shape_row_then_the_generic_one(interpreter_rows):
    tall, narrow = interpreter_rows
    assert fused.launch_config(16, 8, 40, "cpu", torch.float32) == tall  # 2 rows per expert
    assert fused.launch_config(17, 8, 40, "cpu", torch.float32) == narrow
    assert fused.launch_config(16, 8, 48, "cpu", torch.float32) == fused.TILES["interpreter"]["small"]
    assert fused_fp8.launch_config(16, 8, 40, "cpu") == tall  # the interpreter keeps BLOCK_K
    gpu = fused_fp8.fp8_tile(moe_tiles.SHAPES["hopper"][(256, 2048)][0][1], "hopper")
    assert gpu["BLOCK_K"] == 128  # one scale block per K step on a GPU


@pytest.mark.parametrize("tokens", [2, 7], ids=lambda t: f"t{t}")  # tall rows (2 per expert), then narrow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernels_match_the_reference_under_a_listed_row(interpreter_rows, device, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    args, _ = moe.make_moe_inputs(tokens, 8, 2, 48, 40, device, dtype, gen, skip_expert=3)
    out = fused.fused_experts_triton(*args, "silu")
    ref = moe.fused_experts_reference(*args)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_fp8_kernels_match_the_reference_under_a_listed_row(interpreter_rows, device):
    gen = torch.Generator().manual_seed(5)
    (hidden, w13, w2, weights, ids), _ = moe.make_moe_inputs(7, 8, 2, 48, 40, "cpu", torch.float32, gen)
    w13_q, w2_q, w13_s, w2_s = moe.quantize_experts(w13, w2, torch.float8_e4m3fn)
    args = tuple(a.to(device) for a in (hidden, w13_q, w2_q, w13_s, w2_s, weights, ids))
    torch.testing.assert_close(fused_fp8.fused_experts_fp8_triton(*args, "silu").float(),
                               moe.fused_experts_fp8_reference(*args).float(), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("rows, message", [
    ((), "the last row must have no bound"),
    (((4, {}),), "the last row must have no bound"),
    (((8, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)),
      (4, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)),
      (None, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2))),
     r"bounds \[8, 4\] must be positive ints, strictly ascending"),
    (((None, dict(BLOCK_M=16, BLOCK_N=48, BLOCK_K=64, GROUP_M=1, num_warps=4)),),
     r"missing \['num_stages'\]; not powers of two: \['BLOCK_N=48'\]"),
    (((None, dict(BLOCK_M=8, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)),), "BLOCK_M below 16"),
])
def test_bad_vendor_rows_are_refused_with_the_reason(monkeypatch, rows, message):
    monkeypatch.setattr(moe_tiles, "SHAPES", {g: dict(s) for g, s in moe_tiles.SHAPES.items()})
    with pytest.raises(GraftInputError, match=r"MoE tiles for hopper \(8 experts, intermediate 512\): .*" + message):
        moe_tiles.add_shape_tiles("hopper", 8, 512, rows)
    assert (8, 512) not in moe_tiles.SHAPES.get("hopper", {})
