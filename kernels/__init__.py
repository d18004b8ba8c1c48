"""Triton kernels, installed as loraserve.kernels; import them from their modules.

``lora_ops.add_lora_linear`` is the fused multi-LoRA op (``lora_shrink`` and
``lora_expand`` its two halves, ``lora_meta`` the per-step token grouping it
reads, ``lora_activation`` the merged gate/up projection's update fused into its
activation); ``paged_attention`` is attention over the paged KV cache;
``dense_gemm``, ``fused_norm_rope``, ``activation`` and ``argmax`` serve the
base model's decode steps.

This file imports nothing. From a checkout's root this folder is importable as
a top-level module named ``kernels``, the name of a PyPI package that
transformers probes for (``is_kernels_available``): where that package is not
installed, transformers 5 imports whatever ``kernels`` it finds to read its
``__version__``. Importing this file costs nothing and needs no Triton, and the
version below is one that no release of that package has, so the probe answers
"not available" and transformers carries on without it.
"""

__version__ = "0+loraserve"
