"""`sgl_kernel.scalar_type` in the gpu-lite stand-in: absent, so that SGLang uses its own."""

raise ImportError("sgl_kernel.scalar_type is not in fineslab's gpu-lite stand-in "
                  "(SGLang falls back to its own scalar types)")
