"""loraserve's benchmarks, run as modules from the repository root
(``python -m benchmarks.offline ...``); benchmarks/RESULTS.md gives the figures
and the command of each, ``bash benchmarks/gpu_suite.sh`` runs them all.

- ``offline``, ``tensor_parallel``, ``peft_baseline``: offline throughput, base
  against LoRA (at tensor-parallel sizes; through transformers + PEFT);
- ``serve``: the serving load generator against a running ``loraserve serve``
  (requests with a JSON schema too);
- ``startup``: engine start and CUDA graph capture, base against LoRA;
- ``ray_scale_out``: Ray Serve replicas against one, on the CPU by default;
- ``profile``: where the time goes (decode steps, served steps, the offline
  run, the decode run's timeline, compiles on first use);
- ``kernels``: the Triton kernels alone, and the tuners of their launch tables;
- ``make_bench_setup``: the Llama-3-8B-shaped model and adapters (N of them as hard
  links to K weight files, and the files that register them all), no download;
  its tokenizer one made-up word a token, or byte-level (``--tokenizer bytes``,
  which can write JSON for structured outputs);
- ``many_adapters.sh``: the many-adapter serving runs (the ``many`` stage of
  ``gpu_suite.sh``);
- ``workload``, ``results``, ``synthetic``: what the scripts share (prompts,
  adapters and flags; the machine, the command and the JSON; the model and
  adapter files).

This package is not part of the install, and it imports nothing here.
"""
