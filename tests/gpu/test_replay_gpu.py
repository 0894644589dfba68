"""Track B replayed from its launch plans (runtime/replay.py) against the IREE runtime, bit for bit,
and the whole inference as one CUDA graph with no host wait."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dualtrack.compiler.verify import random_input
from dualtrack.contract.launch_plan import Dispatch
from dualtrack.runtime.engine import Engine
from dualtrack.runtime.selfcheck import replay_check

ROOT = Path(__file__).resolve().parents[2]


def _device_name(e: Engine) -> str:
    dev = e.backend.device
    return f"{dev.name} cc{dev.cc[0]}.{dev.cc[1]} driver{dev.driver_version}"


@pytest.mark.parametrize("which", ["tiny", "tiny_full"])
def test_every_module_replays_bit_identical_to_iree(which: str, request, tmp_path: Path) -> None:
    """Each Track B module at each batch size, run both ways on the same random inputs."""
    bundle = request.getfixturevalue(f"{which}_bundle")
    with Engine.load(bundle, "cuda") as e:
        tb = e.backend.track_b
        replayed = [
            (s.name, b)
            for s in e.plan.segments
            if s.track == "B"
            for b in e.batch_sizes
            if tb.decide(s, b).path == "replay"
        ]
        assert len(replayed) == sum(s.track == "B" for s in e.plan.segments) * len(e.batch_sizes)
        record = replay_check(e, _device_name(e), tmp_path, seed=11)
    assert len(record["modules"]) == len(replayed)
    assert all(m["identical"] for m in record["modules"]), record["modules"]


def test_a_corrupted_launch_plan_is_caught_and_falls_back(tiny_bundle: Path, tmp_path: Path, monkeypatch) -> None:
    """A plan that launches the wrong grid is found by the both-ways check; that module goes back to
    the IREE runtime, and the engine's results stay right."""
    monkeypatch.setenv("DUALTRACK_GPU_SELF_CHECK", "0")
    with Engine.load(tiny_bundle, "cuda") as e:
        tb = e.backend.track_b
        seg = next(s for s in e.plan.segments if s.track == "B" and s.index > 0)
        rs = tb.replayer.segment(seg, 1)
        first = next(i for i, c in enumerate(rs.plan.commands) if isinstance(c, Dispatch) and c.grid[0] > 1)
        d = rs.plan.commands[first]
        assert isinstance(d, Dispatch)
        bad = dataclasses.replace(d, grid=(d.grid[0] // 2, d.grid[1], d.grid[2]))  # half the work
        rs.plan = dataclasses.replace(
            rs.plan, commands=(*rs.plan.commands[:first], bad, *rs.plan.commands[first + 1 :])
        )
        record = replay_check(e, _device_name(e), tmp_path, seed=5)
        flagged = [m for m in record["modules"] if not m["identical"]]
        assert [(m["segment"], m["batch"]) for m in flagged] == [(seg.name, 1)]
        assert tb.decide(seg, 1).path == "iree" and "differs from the IREE runtime" in tb.decide(seg, 1).reason
        # A second load applies the record without running the modules again.
        again = replay_check(e, _device_name(e), tmp_path, seed=5)
        assert again == record
        x = random_input(e.input_spec, 1, np.random.default_rng(3))
        got = e.run(x)
    monkeypatch.setenv("DUALTRACK_TRACK_B", "iree")
    with Engine.load(tiny_bundle, "cuda") as ref_engine:
        want = ref_engine.run(x)
    np.testing.assert_array_equal(got["mask"], want["mask"])
    np.testing.assert_array_equal(got["probs"], want["probs"])


@pytest.mark.parametrize("which", ["tiny", "tiny_full"])
def test_one_graph_no_host_wait_and_same_results_as_iree(which: str, request, monkeypatch) -> None:
    """Engine.run on a GPU tensor: one CUDA graph per batch size, zero host waits, and results equal
    to the IREE-runtime path bit for bit (the same kernels, run by another launcher)."""
    torch = pytest.importorskip("torch", reason="needs torch for a GPU input tensor")
    bundle = request.getfixturevalue(f"{which}_bundle")
    rng = np.random.default_rng(9)
    xs = {b: random_input_batch(b, bundle, rng) for b in (1, 4)}
    with Engine.load(bundle, "cuda") as e:
        got = {}
        for b, x in xs.items():
            e.run(torch.from_numpy(x).cuda())  # capture
            w0 = e.backend.stats.host_waits
            out = e.run(torch.from_numpy(x).cuda())
            torch.cuda.synchronize()
            assert e.backend.stats.host_waits == w0, "a host wait inside Engine.run"
            assert b in e.backend.plan_graphs
            got[b] = {k: torch.from_dlpack(v).cpu().numpy() for k, v in out.items()}
    monkeypatch.setenv("DUALTRACK_TRACK_B", "iree")
    with Engine.load(bundle, "cuda") as ref:
        for b, x in xs.items():
            assert not ref.backend.plan_graphs
            want = ref.run(x)
            for k in want:
                np.testing.assert_array_equal(got[b][k].view(np.uint8), np.ascontiguousarray(want[k]).view(np.uint8))


def random_input_batch(n: int, bundle: Path, rng: np.random.Generator) -> np.ndarray:
    spec = json.loads((bundle / "manifest.json").read_text())["plan"]["inputs"][0]
    return rng.integers(0, 256, size=(n, *spec["shape"][1:]), dtype=np.uint8)


def test_results_handed_out_are_the_callers(tiny_bundle: Path) -> None:
    """The graph rewrites its buffers on every run: what Engine.run gave out earlier must not change."""
    torch = pytest.importorskip("torch", reason="needs torch for a GPU input tensor")
    rng = np.random.default_rng(4)
    with Engine.load(tiny_bundle, "cuda") as e:
        a, b = (random_input_batch(1, tiny_bundle, rng) for _ in range(2))
        first = e.run(torch.from_numpy(a).cuda())
        kept = torch.from_dlpack(first["probs"]).clone()
        e.run(torch.from_numpy(b).cuda())
        torch.cuda.synchronize()
        assert torch.equal(torch.from_dlpack(first["probs"]), kept)
        np.testing.assert_array_equal(kept.cpu().numpy(), e.run(a)["probs"])


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer on PATH")
def test_replay_is_clean_under_memcheck(tiny_full_bundle: Path, tmp_path: Path) -> None:
    """Every replayed module once, under compute-sanitizer's memcheck: no out-of-bounds or misaligned access."""
    script = (
        "import numpy as np, sys\n"
        "from dualtrack.runtime.engine import Engine\n"
        "e = Engine.load(sys.argv[1], 'cuda')\n"
        "for b in e.batch_sizes:\n"
        "    e.run(np.random.default_rng(b).integers(0, 256, (b, *e.input_spec.shape[1:]), dtype=np.uint8))\n"
        "e.close()\n"
    )
    env = {**os.environ, "DUALTRACK_GPU_SELF_CHECK": "0", "DUALTRACK_CACHE_DIR": str(tmp_path)}
    argv = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3"]
    argv += [sys.executable, "-c", script, str(tiny_full_bundle)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr


def test_gpu_input_written_on_a_side_stream_is_waited_for(tiny_bundle: Path) -> None:
    """The input is still being written on another torch stream when Engine.run is called: the
    engine's stream must wait for it on the device (DLPack's stream handshake), not read early."""
    torch = pytest.importorskip("torch", reason="needs torch for a GPU input tensor")
    from dualtrack.errors import InputError

    rng = np.random.default_rng(8)
    x = random_input_batch(1, tiny_bundle, rng)
    with Engine.load(tiny_bundle, "cuda") as e:
        want = e.run(x)
        e.run(torch.from_numpy(x).cuda())  # capture the graph first
        side = torch.cuda.Stream()
        src = torch.from_numpy(x).pin_memory()
        with torch.cuda.stream(side):
            t = torch.zeros(x.shape, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the real pixels land
            t.copy_(src, non_blocking=True)
            out = e.run(t)
        got = torch.from_dlpack(out["mask"]).cpu().numpy()
        np.testing.assert_array_equal(got, want["mask"])
        with pytest.raises(InputError, match="contiguous"):
            e.run(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).cuda().transpose(1, 2))
