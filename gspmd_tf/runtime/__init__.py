"""Run stage: gt.function, Lowered and ShardedTensor."""
