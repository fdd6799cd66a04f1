"""The kernels check's spec, apart from run(): its judging module builds results through it too, below the
package's __init__."""

from __future__ import annotations

from posdiag.checks import CheckSpec, Option

SPEC = CheckSpec(
    name="kernels",
    title="Attention kernels agree with eager",
    proves="SDPA, FlashAttention and flex compute eager attention's function (FlashAttention's own error rule)",
    options={
        "implementations": Option(None, "implementations compared with eager; by default every one the model and "
                                        "this machine take", (list,)),
    },
)
