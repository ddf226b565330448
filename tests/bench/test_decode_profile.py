"""bench/decode_profile.py: its kernel kinds on names an H200 profile really gave, and a clear refusal without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.decode_profile import kind

# kernel names from the bench preset's decode step on an H200 (torch 2.11, bench/RESULTS.md 2026-12-04e)
SEEN = {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": "matmul",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Gemm": "matmul",
        "_gate_up_kernel": "triton", "_rms_norm_kernel": "triton", "_scores_kernel": "triton",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)":
            "elementwise",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)":
            "copy/convert",
        "Memcpy DtoD (Device -> Device)": "copy/convert",
        "void at::native::radixSortKVInPlace<-2, -1, 16, 2, long, long, unsigned int>(at::cuda::detail::TensorInfo":
            "reduce",
        "void at_cuda_detail::cub::detail::scan::DeviceScanKernel<at_cuda_detail::cub::detail::scan::policy_hub<int":
            "reduce"}


@pytest.mark.parametrize("name", list(SEEN))
def test_each_kernel_of_a_real_profile_gets_its_kind(name):
    assert kind(name) == SEEN[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tool runs: CI's machines have none")
def test_without_a_gpu_it_says_so_and_exits_2():
    done = subprocess.run([sys.executable, "bench/decode_profile.py", "--batch", "1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
