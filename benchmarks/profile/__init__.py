"""Where the time goes, for finding overhead rather than for headline numbers:
``decode`` (one decode step: graph replay, host parts, kernels), ``steps`` (the
steps of continuous serving, base against LoRA), ``offline`` (the offline run's
LoRA overhead by kernel kind), ``timeline`` (the batch-32 decode run's wall time)
and ``first_use`` (the Triton compiles on requests' paths after start-up)."""
