"""`stepmem estimate --script`: the script's host side runs for real, only the device is fake.

nanoGPT's data loading (indices from ``torch.randint`` slicing a ``np.memmap``), a torchvision-
style dataset in a shuffled ``DataLoader`` with two workers, host tensors that are not GPU
memory, a device tensor copied back to the host, a view moved to the device: each traced as the
real run allocates it (``benchmarks/scripts/nanogpt_batch.py``, ``mnist_loader.py``) and held to
the same script on real CPU tensors under torch's tracker."""

from __future__ import annotations

from pathlib import Path

from collector.estimate.request import EstimateFlags, plan_estimate
from collector.estimate.script import estimate_script as _estimate_script
from tests.cli import stepmem

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "scripts"
HELD = ("parameters", "gradients", "optimizer_state")


def estimate_script(path: Path, args: list[str], real: bool = False):
    flags = EstimateFlags(script=path, script_args=tuple(args))
    return _estimate_script(plan_estimate(flags, False, real=real))


def _same_as_real(path: Path, args: list[str], cuda_kernels: int | None = 0):
    """The script's estimate and the same steps' on real CPU tensors, its components equal to
    the real trace's: the activations too, but for what CUDA's attention kernel saves beyond the
    CPU's (``cuda_kernels`` bytes: the real trace runs the CPU's kernels; None: not compared)."""
    fake, error = estimate_script(path, args)
    assert not error and fake is not None, error
    real, error = estimate_script(path, args, real=True)
    assert not error and real is not None, error
    for kind in HELD:
        assert fake.first.get(kind) == real.first.get(kind), kind
        assert fake.steady.get(kind) == real.steady.get(kind), kind
    for fake_step, real_step in ((fake.first, real.first), (fake.steady, real.steady)):
        if cuda_kernels is not None:
            assert fake_step["activations"] - real_step["activations"] == cuda_kernels
    assert not fake.undecided
    return fake, real


def test_nanogpts_batches_are_the_real_runs_and_a_host_tensor_is_not_gpu_memory(tmp_path):
    """``get_batch`` cuts a (12, 128) batch from the token file with real indices (under fake
    indices both slice ends read one placeholder: a (12, 0) batch), the loss's f-string formats,
    and a 400 MB host tensor adds nothing to the device."""
    args = [str(tmp_path), "--batch-size", "12", "--block-size", "128", "--vocab", "512"]
    # CUDA's memory-efficient attention saves its RNG seed and offset (two int64) a layer
    est, _ = _same_as_real(SCRIPTS / "nanogpt_batch.py", args, cuda_kernels=2 * 16)
    logits = 12 * 128 * 512 * 4  # the batch's logits, float32
    assert est.steady["activations"] > logits
    with_host, error = estimate_script(
        SCRIPTS / "nanogpt_batch.py", [*args, "--host-tokens", str(50_000_000)]
    )
    assert not error and with_host is not None, error
    assert with_host.steady == est.steady and with_host.first == est.first


def test_a_shuffled_two_worker_loader_over_a_torchvision_style_dataset(tmp_path):
    """pytorch/examples' MNIST loop: ``torch.accelerator`` picks the GPU branch (workers, pinned
    memory, shuffle), the dataset's ``.numpy()`` and PIL run in the workers on real tensors, and
    the batch is the loader's (64, 1, 28, 28): the first convolution's output is on the device.
    The 157 MB of images stay the host's: the real trace on CPU tensors (where the host is the
    device too) counts them among the activations, the estimate does not."""
    est, real = _same_as_real(SCRIPTS / "mnist_loader.py", ["--samples", "200000"], None)
    conv1, images = 64 * 32 * 26 * 26 * 4, 200_000 * 28 * 28
    assert conv1 < est.steady["activations"] < real.steady["activations"] - images
    assert est.spec["optim"] == "Adadelta"


def test_a_host_copy_is_not_gpu_memory_and_a_moved_view_is_its_own_bytes(tmp_path):
    """``.cpu()`` copies kept on the host are not the device's; a view moved to the device is a
    tensor of the view's size (CUDA copies the view, not its base); a host tensor never moved is
    not counted at all."""
    script = tmp_path / "copies.py"
    script.write_text(
        "import torch\n"
        "from collector.probe.core import StepProbe\n"
        "m = torch.nn.Linear(1024, 1024).cuda()\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "probe = StepProbe().watch(m, opt)\n"
        "kept, big = [], torch.empty(1 << 28, dtype=torch.uint8)  # 256 MiB on the host\n"
        "for i in range(3):\n"
        "    x = torch.randn(64, 1024)[:, :512].to('cuda')  # a view moved\n"
        "    assert x.device.type != 'cpu' or x.device.index == 0, x.device\n"
        "    with probe.step(i):\n"
        "        y = m(torch.cat([x, x], 1))\n"
        "        y.sum().backward()\n"
        "        opt.step()\n"
        "        opt.zero_grad()\n"
        "        kept.append(y.detach().cpu() * 2)  # host copies, kept\n"
    )
    est, error = estimate_script(script, [])
    assert not error and est is not None, error
    view, cat, out, total = 64 * 512 * 4, 64 * 1024 * 4, 64 * 1024 * 4, 8
    assert est.steady["activations"] == view + cat + out + total
    assert est.at_end["parameters"] == (1024 * 1024 + 1024) * 4


def test_the_cli_formats_a_device_value_and_says_fits(tmp_path):
    """``f"{loss:.4f}"`` of a fake 0-dim tensor prints its placeholder as a real one prints;
    the estimate is trusted (exit 0), not "a placeholder decided"."""
    r = stepmem(
        "estimate", "--gpu", "24", "--script", str(SCRIPTS / "nanogpt_batch.py"), "--",
        str(tmp_path), "--steps", "3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "iter 0: loss 1.0000, 1.0000" in r.stderr
    assert "Fits" in r.stdout and "Not trustworthy" not in r.stdout
