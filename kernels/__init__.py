"""Packed-integer formats and kernels (imported as `compress.kernels`).

    packing.py       reference LSB-first bitstream and the GPTQ / auto-round layout (pure torch)
    cpu.py           the `cpu-rows` layout for the C++ kernel (int3 as two planes), its build on first use,
                     fp32 / int8 activations
    cpu_kernel.cpp   the AVX2/FMA (+ AVX-VNNI) and scalar kernels
    gpu.py           the Triton kernel on the GPTQ (K-major) layout, 2/3/4/8 bits; runs in Triton's interpreter on CPU
    backends.py      backends behind one interface (`reference`, `cpu`, `cpu-a8`, `triton`), `QuantLinear`,
                     `quantize_model`
"""
