"""The Triton kernels alone, on a CUDA machine: the fused LoRA op against a torch
reference (``lora_op``), LoRA's cost per linear layer class (``lora_layer``),
decode attention (``attention``), MoE LoRA (``moe_lora``), and the tuners of the
kernels' launch table (``tune_kernels``, ``tune_dense``); ``timing`` holds how
they time the device."""
