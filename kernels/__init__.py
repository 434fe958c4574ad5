"""The GPU path's Triton kernels, each module beside its plain-PyTorch reference.

Importing the package pins Triton's FP-fusion default on where the environment leaves it unset: the kernels that set
no `enable_fp_fusion` of their own were checked bit for bit with multiply-adds fused, Triton's default up to 3.9,
which Triton 3.10 turns off. `server.settings` refuses a setting that turns fusion off.
"""

import os

FP_FUSION_ENV = "TRITON_DEFAULT_FP_FUSION"
FORCE_NO_FP_FUSION_ENV = "TRITON_FORCE_DISABLE_FP_FUSION"

os.environ.setdefault(FP_FUSION_ENV, "1")
