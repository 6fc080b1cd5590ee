"""`parallel.pp`: the model cut into stages, each held by the processes of one pipeline rank,
run by a schedule of `torch.distributed.pipelining` (as torchtitan does).

How a model is cut, for any model torch.export can trace: torch's tracer (`pipeline()`)
splits the model's graph where the split points begin (`parallel.pp_split_points`, by module
name; else the repeated blocks divided evenly). Each stage's graph calls modules of the model
by their names (`blocks.2`, `ln_f`); those calls are pointed back at the model's own modules,
so a stage holds the very modules (their classes, parameters and names) of the whole model:
fsdp shards a stage's blocks as it shards the model's, and its state dict is the whole
model's, keyed by the same names, so checkpoints move between pipelined and other layouts.

A process holds one stage (`GPipe`, `1F1B`) or two (`Interleaved1F1B`, looped: stages r and
r + pp; `ZBVZeroBubble`, a V: stages r and 2pp - 1 - r); the loop sees them as one module
(`StageParts`). The loss runs on the last stage's output: the recipe gives
`split_batch(batch) -> (inputs, targets)` and `loss_from_output(output, targets)`.
"""
