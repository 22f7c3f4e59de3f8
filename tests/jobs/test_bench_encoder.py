"""jobs/bench_encoder.py on the CPU: the encoder Pareto part on the tiny LLaVA shape, and the image workload."""

from rayinfer.jobs import bench_encoder as B


def test_pareto_part_runs_on_cpu():
    out = B.run(B._args(["--device", "cpu", "--model", "llava-tiny", "--part", "pareto", "--batch-sizes", "1", "4",
                         "--repeats", "1"]))
    assert out["model"] == "llava-tiny" and out["image_tokens"] == 16 and "git_rev" in out and "ttft" not in out
    assert [r["batch_size"] for r in out["pareto"]] == [1, 4]
    assert all(r["images_per_s"] > 0 and r["p50_latency_s"] > 0 for r in out["pareto"])


def test_image_workload_repeats_images():
    work = B.image_workload(8, 4, 8, image_size=32, num_image_tokens=16, patch_size=8, image_token_id=99)
    hashes = [mm[0].content_hash for _, mm in work]
    assert len(set(hashes)) == 6  # requests 3 and 7 reuse an earlier image
    prompt, [mm] = work[0]
    assert prompt[mm.offset : mm.offset + mm.length] == [99] * 16 and mm.num_patches == 16
