"""Engine.signal on a GPU, and `serve --workers N` with the GPU marking each answer in its slot.

Checked: the GPU's stores land after the rows launched before them and the driver's thread then
posts a process-shared semaphore (the rows bit-identical to ``Engine.run``, the marks exactly the
values given); the last launch's result waits for them too; a worker gets, through the engine
process, masks that agree with ``Engine.run`` of each image alone on at least ``MASK_AGREEMENT`` of
pixels (the service batches them with others, and a batch size may round a logit differently; a mask
of another request would agree on about half), with the GPU's marks (the default) and without
(``DUALTRACK_GPU_SIGNALS=0``), over rounds that reuse the slots.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from gpu_serving import host_and_client

from dualtrack.serve import semaphores

MASK_AGREEMENT = 0.99
needs_semaphores = pytest.mark.skipif(
    not semaphores.available(), reason="no process-shared semaphores in this C library"
)


@needs_semaphores
def test_signal_marks_land_after_the_rows_and_wake_another_thread(engine, tmp_path) -> None:
    from dualtrack.errors import InputError

    rng = np.random.default_rng(15)
    b = max(engine.batch_sizes)
    h, w = engine.input_spec.shape[1:3]
    x = rng.integers(0, 256, engine.input_spec.at_batch(b), dtype=np.uint8)
    want = engine.run(x, outputs=("mask",))["mask"]
    at = -(-b * h * w // 64) * 64  # the marks after the rows, 8-byte aligned, in one registered range
    buf = np.zeros(at + 8 * b, np.uint8)
    rows = buf[: b * h * w].reshape(b, h, w)
    words = buf[at:].view(np.uint64)
    sems = semaphores.SemaphoreFile(tmp_path / "sem", 1, create=True)
    pinned = engine.pin_host(buf)
    post = semaphores.post_function()
    try:
        for round_ in range(3):  # the same rows and words again: each round's marks are its own
            rows[...] = 0xEE
            seen: dict[str, object] = {}

            def waiter(seen: dict[str, object] = seen) -> None:
                seen["woken"] = sems.wait(0, 30)
                seen["words"] = words.tolist()
                seen["rows"] = rows.copy()

            th = threading.Thread(target=waiter)
            th.start()
            sub = engine.launch(engine.stage(x), outputs=("mask",), into={"mask": list(rows)})
            marks = [(int(words.ctypes.data) + 8 * i, round_ * 100 + i + 1) for i in range(b)]
            engine.signal(marks, [(post, sems.address(0))])
            th.join(60)
            assert seen["woken"] is True
            assert seen["words"] == [round_ * 100 + i + 1 for i in range(b)]
            np.testing.assert_array_equal(seen["rows"], want)
            sub.result()
        # The last launch's result covers the marks and the call queued after it.
        sub = engine.launch(engine.stage(x), outputs=("mask",), into={"mask": list(rows)})
        engine.signal([(int(words.ctypes.data), 999)], [(post, sems.address(0))])
        sub.result()
        assert int(words[0]) == 999 and sems.wait(0, 0)
        with pytest.raises(InputError, match="pin_host"):
            engine.signal([(int(np.zeros(1, np.uint64).ctypes.data), 1)])
        with pytest.raises(InputError, match="aligned"):
            engine.signal([(int(words.ctypes.data) + 4, 1)])
    finally:
        engine.backend.stream.synchronize()
        pinned.close()
        sems.close()


@needs_semaphores
@pytest.mark.parametrize("gpu_signals", ["1", "0"])
def test_a_worker_gets_its_own_masks_marked_by_the_gpu(tiny_bundle: Path, gpu_signals, monkeypatch) -> None:
    from dualtrack.runtime.engine import Engine

    monkeypatch.setenv("DUALTRACK_GPU_SIGNALS", gpu_signals)
    rng = np.random.default_rng(16)
    with Engine.load(tiny_bundle, "cuda") as e:
        shape = tuple(e.input_spec.shape[1:])
        images = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(11)]
        want = [e.run(im[None], outputs=("mask",))["mask"][0] for im in images]
        with host_and_client(e) as (host, client):
            assert bool(host._signals) == (gpu_signals == "1")
            for _ in range(4):  # full and partial batches, the slots reused
                futures = [client.submit(im) for im in images]
                for f, expected in zip(futures, want, strict=True):
                    result = f.result(120)
                    assert result.mask.shape == expected.shape
                    assert float((result.mask == expected).mean()) >= MASK_AGREEMENT
                    assert 0 < result.timings["batch_gpu_ms"] == result.run_ms < 120e3
