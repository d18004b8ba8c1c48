"""Worker: model runner, input batch, sampler, attention backends."""
