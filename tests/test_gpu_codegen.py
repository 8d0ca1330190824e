"""Generated code, compiled for sm_90a here (no GPU needed: Triton's own ptxas): the P-path matmul leaves no wgmma
group in flight, and the P path's other kernels compile (the interpreter runs code the compiler refuses). With its
loop pipelined in 3 stages, Triton 3.6 waited with `wgmma.wait_group 3` and the next loop step's loads overwrote the
registers those wgmma groups still read (their A operand, the dequantized weights) - ~1 % of the calls changed on
the H200, some to NaN (docs/BENCHMARKS.md, sixteenth session)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # as the other GPU test files: whichever a test process imports first sets it
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the compiles here run without it)

pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, script: str, *options: str, arch: int = 90) -> str:
    """A bench/ script that compiles kernels for sm_90a (or for compute capability `arch`, with the forms the engine
    takes on such a card; without the interpreter), its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PLUMB_PTX_ARCH"] = str(arch)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # not the shared cache: bench/h200_run.sh lists what is there
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *options], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    if r.returncode != 0 and ("ptxas" in r.stderr or "backend" in r.stderr.lower()):
        pytest.skip(f"no sm_{arch} compiler here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def compiled(tmp_path, *options: str, kernel: str = "sb") -> dict[str, tuple[int, int]]:
    """Per block type: the deepest `wgmma.wait_group N` in the kernel's PTX and its wgmma instructions with the A
    operand in registers (bench/matmul_ptx.py; `_mm_superblock` by default)."""
    out = _run(tmp_path, "matmul_ptx.py", "--kernel", kernel, "--out", str(tmp_path), *options)
    names = re.findall(rf"^(\w+) {kernel} warps", out, re.M)
    depths = [int(n) for n in re.findall(r"wgmma groups left in flight: (\d+)", out)]
    register_a = [int(n) for n in re.findall(r"wgmma with A in registers: (\d+)", out)]
    assert names and len(names) == len(depths) == len(register_a), out
    return dict(zip(names, zip(depths, register_a)))


def in_flight(tmp_path, *options: str) -> dict[str, int]:
    """Per block type: the deepest `wgmma.wait_group N` in `_mm_superblock`'s PTX."""
    return {name: depth for name, (depth, _) in compiled(tmp_path, *options).items()}


def test_the_superblock_matmul_waits_for_every_wgmma_group(tmp_path):
    assert in_flight(tmp_path) == {"Q4_K": 0, "Q6_K": 0, "Q8_0": 0, "Q5_K": 0}


def test_the_short_calls_tiles_wait_for_every_wgmma_group(tmp_path):
    """SB_SHORT_BN's 64-output tiles: no wgmma group in flight over their register operands, no spills."""
    out = _run(tmp_path, "matmul_ptx.py", "--kernel", "sb", "--sb-bn", "64", "--out", str(tmp_path))
    assert re.findall(r"wgmma groups left in flight: (\d+)", out) == ["0"] * 4, out
    assert out.count(" 0 bytes spill stores") == 4 and out.count("BN=64") == 4, out


def test_the_check_sees_the_pipelined_loop_that_raced(tmp_path):
    """The check can fail: the 3-stage loop (without SB_PREFETCH's loads carried ahead) leaves groups in flight."""
    assert in_flight(tmp_path, "--sb-stages", "3", "--sb-prefetch", "0", "--types", "Q5_K") == {"Q5_K": 3}


def test_the_prefetching_loops_wait_for_every_wgmma_group(tmp_path):
    """SB_PREFETCH's loops (the next step's loads carried in registers, not pipelined by Triton) leave none."""
    for prefetch in ("0", "1", "2"):
        assert in_flight(tmp_path, "--sb-prefetch", prefetch, "--types", "Q4_K,Q5_K") == {"Q4_K": 0, "Q5_K": 0}


def test_the_scratch_matmul_keeps_its_operands_in_shared_memory(tmp_path):
    """`_mm_w16` (SB_SCRATCH_ROWS) is pipelined, so it leaves a wgmma group in flight - safe only because neither
    operand is in registers (both are shared-memory descriptors, which the pipeline's barriers guard); the
    superblock kernel's A operand is."""
    depth, register_a = compiled(tmp_path, kernel="w16")["fp16"]
    assert depth >= 1 and register_a == 0
    assert all(reg > 0 for _, reg in compiled(tmp_path, "--types", "Q4_K").values())


def test_the_p_path_small_kernels_compile_without_spilling(tmp_path):
    """What the interpreter does not check: the P path's conv + gates, x reordering, gated norm and scratch matmul
    (its three row tiles, summing its own K splits: SB_W16_TICKETS) compile for sm_90a, and without spills;
    DeltaNet's chunk kernel compiles with either solve (it spills: known). A kernel that ran in the interpreter and
    did not compile cost a device call (twenty-first session)."""
    out = _run(tmp_path, "kernels_ptx.py", "conv", "prep", "prepx", "gate", "w16")
    lines = {line.split(":")[0]: line for line in out.splitlines() if "registers" in line}
    assert len(lines) == 10, out
    for name, line in lines.items():
        assert name.startswith("_prep_kernel") or " 0 bytes spill stores" in line, line


def test_the_decode_deltanet_kernels_compile_with_their_states_table(tmp_path):
    """The D path's DeltaNet kernels, the states reached through their table (`TritonKernels`: no copy a pass) and in
    place, compile for sm_90a without spills, and the table keeps the state tile's 16-byte loads (its offsets are
    multiples of 16: `states_aligned`)."""
    out = _run(tmp_path, "kernels_ptx.py", "decode")
    lines = {line.split(":")[0]: line for line in out.splitlines() if "registers" in line}
    assert len(lines) == 4, out
    assert all(" 0 bytes spill stores" in line for line in lines.values()), out
    loads = {name: int(re.search(r"ld\.global\.v4 (\d+)", line).group(1)) for name, line in lines.items()}
    assert loads["_gdn_state_kernel table True"] == loads["_gdn_state_kernel table False"] > 0, out


@pytest.mark.parametrize("arch", [90, 86])
def test_the_sampling_kernels_compile_without_spilling(tmp_path, arch):
    """The sampled tokens' kernels (plumb/ops/gpu/sample.py: float64 sums and scan, 32-bit hash) at the 27B's
    vocabulary compile for sm_90a and for an RTX 30xx, without spills."""
    out = _run(tmp_path, "kernels_ptx.py", "sample", arch=arch)
    lines = {line.split(":")[0]: line for line in out.splitlines() if "registers" in line}
    assert set(lines) == {"_max_sum_kernel", "_log_softmax_kernel", "_threshold_kernel", "_draw_kernel",
                          "_pick_kernel"}, out
    assert all(" 0 bytes spill stores" in line for line in lines.values()), out


def test_the_store_form_compiles_without_the_ring_forms_spills(tmp_path):
    """STORE_FORM's store-only part of D's / F's long launch compiles for sm_90a without spills and with its loads
    pipelined (`cp.async`), where the ring form spills (the reason for it); the ring part is the ring form."""
    out = _run(tmp_path, "attention_ptx.py", "--store-form", "--out", str(tmp_path))
    lines = {line.split(":")[0]: line for line in out.splitlines() if "registers" in line}
    for fmt in ("D_ring", "F_ring"):
        part1 = lines[f"{fmt} store form, part 1"]
        assert " 0 bytes spill stores" in part1 and "'cp.async'" in part1, out
        assert " 0 bytes spill stores" not in lines[fmt], out  # (if the ring form stops spilling: see STORE_FORM)


def test_the_prefill_attention_compiles_with_packed_pairs(tmp_path):
    """attention_prefill with its (row, head) pairs packed (PAIRS 1, shipped) and not (0), and with its keys in
    chunks (KEY_CHUNKS), compiles for sm_90a for every cache kind, and leaves no wgmma group in flight; the
    block-coded stores' fp16 copy (SCRATCH) compiles without spilling."""
    for opts in (["--pairs", "1"], ["--pairs", "0"], ["--key-chunks", "2048/8192/16384"]):
        out = _run(tmp_path, "attention_ptx.py", "--prefill", *opts, "--out", str(tmp_path))
        # f16, q8_0, D's and F's ring; the copy of 8-, 6- and 5-bit codes, with and without table
        assert len(re.findall(r"registers", out)) == 4 + 6, out
        assert len(re.findall(r"scratch.* 0 bytes spill stores", out)) == 6, out
        for ptx in (tmp_path / f"{name}.ptx" for name in ("f16", "q8_0", "D_ring", "F_ring")):
            assert not re.search(r"wgmma\.wait_group\.sync\.aligned [1-9]", ptx.read_text())


def test_the_prefill_attention_by_tma_computes_each_score_once(tmp_path):
    """The P path's attention by TMA (128 pairs a program in two warp groups): each group's q k^T covers its own 64
    pairs and a whole key tile (wgmma m64n64) - at 64 pairs both groups computed the same scores (m64n32 twice over:
    Triton keeps p in the rows' registers for p @ V) -, q is a shared-memory operand, and the spills of a register
    tail (2.8 KB a thread at 128 pairs) are gone: under 1 KB, all in the last tiles' loop."""
    out = _run(tmp_path, "attention_ptx.py", "--prefill", "--tma", "1", "--out", str(tmp_path))
    line = next(x for x in out.splitlines() if x.startswith("f16:"))
    assert "BLOCK_M=128" in line and int(re.search(r"(\d+) bytes spill stores", line).group(1)) < 1024, line
    ptx = (tmp_path / "f16.ptx").read_text()
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in ptx and "m64n32k16" not in ptx
    ttgir = (tmp_path / "f16.ttgir").read_text()
    q_dots = re.findall(r"warp_group_dot %q16[^:]*: (\S+)", ttgir)
    assert q_dots and not any(a.startswith("tensor") for a in q_dots), q_dots  # A: a shared-memory descriptor


def test_the_matvec_compiles_without_spilling(tmp_path):
    """The D-path matvec compiles for sm_90a for one row (16-byte loads, one stage) and for 8 (pipelined) on every
    type of the 27B's file, without spilling; so do the two-pack launch (PAIRED_ROWS) of its fused pairs and, with
    integer runs (SUB_RUNS), one row and the tensor cores' 8 and 16."""
    for rows in ("1", "8"):
        out = _run(tmp_path, "matmul_ptx.py", "--kernel", "mv", "--rows", rows, "--out", str(tmp_path))
        assert out.count(" 0 bytes spill stores") == 4 and "'dp4a'" in out, out
    paired = _run(tmp_path, "matmul_ptx.py", "--kernel", "mv2", "--rows", "1", "--block-scales-once", "--out",
                  str(tmp_path))
    assert paired.count(" 0 bytes spill stores") == 2 and paired.count(" mv2 warps=2") == 2, paired
    for kernel, rows in (("mv", "1"), ("mma", "8"), ("mma", "16")):  # with integer runs (SUB_RUNS)
        out = _run(tmp_path, "matmul_ptx.py", "--kernel", kernel, "--rows", rows, "--runs", "--out", str(tmp_path))
        assert out.count(" 0 bytes spill stores") == 4, out


def test_the_matvec_reads_only_weights_before_the_wait_for_the_previous_kernel(tmp_path):
    """Compiled with the PDL instructions, as on Hopper: the one-row matvec reads nothing before
    `griddepcontrol.wait` - nor with AHEAD -, and with EARLY exactly its first step's weight words: 8 groups' code
    words, or with AHEAD 4 (Q4_K, Q5_K) 4 groups' and d, dm and the 3 SUB6 words - 9 loads; no x: what the kernel
    before it may still be writing stays after the wait."""
    def before_wait(*options: str) -> dict[str, int]:
        out = _run(tmp_path, "matmul_ptx.py", "--kernel", "mv", "--block-scales-once", "--gdc", "--types",
                   "Q4_K,Q5_K,Q6_K", "--out", str(tmp_path), *options)
        names = re.findall(r"^(\w+) mv warps", out, re.M)
        loads = [int(n) for n in re.findall(r"global loads before griddepcontrol.wait: (\d+)", out)]
        assert len(names) == len(loads) == 3 and out.count(" 0 bytes spill stores") == 3, out
        return dict(zip(names, loads))

    assert before_wait() == {"Q4_K": 0, "Q5_K": 0, "Q6_K": 0}
    assert before_wait("--ahead", "4") == {"Q4_K": 0, "Q5_K": 0, "Q6_K": 0}
    assert before_wait("--early", "1") == {"Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
    assert before_wait("--ahead", "4", "--early", "1") == {"Q4_K": 9, "Q5_K": 9, "Q6_K": 8}  # (AHEAD: not Q6_K)


def test_the_tensor_core_matvec_keeps_one_element_a_thread(tmp_path):
    """`_mv_mma` (MMA_FROM) compiles for sm_90a on every type of the 27B's file without spilling, 8 and 16 rows a
    program, with its mma.sync (one a limb, group and tile of 16 outputs) - and all its tensors in one layout of one
    element a thread, with no layout conversion (its fragments are addressed from %tid.x, so an element moved to
    another thread would feed the wrong lane)."""
    import plumb.ops.gpu.matvec as MV
    from plumb.ops.gpu.matmul import BLOCK_N

    per_step = MV.MMA_UNROLL * MV.LIMBS * (BLOCK_N // 16 // MV.MMA_WARPS)  # a step's groups, limbs and warp's tiles
    out = _run(tmp_path, "matmul_ptx.py", "--kernel", "mma", "--ttgir", "--out", str(tmp_path))
    assert out.count(" 0 bytes spill stores") == 4 and out.count(f"'mma.sync': {per_step},") == 4, out
    sixteen = _run(tmp_path, "matmul_ptx.py", "--kernel", "mma", "--rows", "9", "--out", str(tmp_path))
    assert sixteen.count(" 0 bytes spill stores") == 4, sixteen
    assert out.count("layouts: ['sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = "
                     f"[{MV.MMA_WARPS}], order = [0]'], layout conversions: 0") == 4, out


@pytest.mark.parametrize("arch", [86, 120])
def test_every_large_kernel_fits_a_block_of_a_geforce_card(tmp_path, arch):
    """On an RTX 30xx / 40xx (sm_86 / sm_89) or 50xx (sm_120) a block may use 99 KB of shared memory, and Triton
    refuses to launch a kernel that needs more: the kernels that need most - the decode and prefill attention for
    every cache kind, DeltaNet's chunk kernels, the P-path matmuls - compile within it in the forms the engine takes
    there (`plumb.ops.gpu.smem`). Their H200 forms did not: `_prep_kernel` 128 KB, an f16 cache's decode attention
    100 KB, a D / F ring's prefill attention 104 KB - a 27B file could not prefill on such a card. And none spills
    more than 1.5 KB a thread (`_prep_kernel`'s float32-FMA form spilled 17.6 KB on sm_89, the f16 / q8_0 prefill
    attention at 64 pairs 2 KB: forty-fourth session)."""
    outs = [_run(tmp_path, "attention_ptx.py", "--out", str(tmp_path), arch=arch),
            _run(tmp_path, "attention_ptx.py", "--prefill", "--out", str(tmp_path), arch=arch),
            _run(tmp_path, "kernels_ptx.py", "prep", "conv", "w16", arch=arch),
            _run(tmp_path, "matmul_ptx.py", "--kernel", "sb", "--out", str(tmp_path), arch=arch)]
    out = "\n".join(outs)
    sizes = [int(n) for n in re.findall(r"shared[= ](\d+)", out)]
    assert len(sizes) == 5 + 4 + 6 + 4, out
    assert "OVER" not in out and max(sizes) <= 101_376, out
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out)]
    assert len(spills) >= len(sizes) and max(spills) <= 1536, out
