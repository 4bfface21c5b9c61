"""A kernel build killed halfway must not stop later processes from loading the kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine.models import paged_kernel
from engine.models.extension import build_tag, kernel_dir

LOAD = "from engine.models import paged_kernel as k; print(k.kernel_available())"


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(tmp_path: Path) -> None:
    assert paged_kernel.kernel_available(), "the paged-attention kernel builds on this machine"
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_dir() / build_tag(), copy / build_tag())
    stale = copy / build_tag() / "lock"
    stale.touch()  # what torch's builder leaves when its process is killed mid-build
    env = {**os.environ, "WEIR_KERNEL_DIR": str(copy)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=240, check=True
    )
    assert done.stdout.strip() == "True"
    assert not stale.exists()
