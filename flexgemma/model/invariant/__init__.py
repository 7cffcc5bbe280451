"""Batch-invariant kernels (`engine.batch_invariant=true`): a row's result never depends on the other
rows of the step, so a request's logprobs are bitwise the same alone, in any batch, at any slot,
under any prefill chunking, after a prefix-cache hit or a preemption, and in `engine.score()`.

A kernel is batch-invariant when every reduction a row's output goes through runs in an order fixed
by that row alone. What breaks it elsewhere: a matmul library picking a split of K (or a kernel) from
the number of rows, attention kernels splitting the KV by a count chosen from the batch or running
decode and prefill through different kernels, reductions over the vocabulary split across blocks
when rows are few. Here:

- `matmul.linear`: K cut into chunks at fixed positions (`kernels.invariant_k_chunk`), each chunk's
  tl.dot steps run in K order from zero, the chunks added in order. A kernel may run a tile's chunks in
  one program (fold) or in a program each, summed after (split: small row counts' parallelism); tiles and
  the kernel may change with the row count, as neither changes a row's bits (GPU tests; the tiles
  measured on the H200 by experiments/probe_invariance.py). On the CPU rows in fixed tiles of 16 (a
  product of 16 rows gives each row the same bits wherever it sits: tested).
- `attention.paged_attention`: one computation for decode and prefill. A query's KV is cut at fixed
  positions into chunks of `split_tokens`, each chunk a softmax pass over fixed tiles in position order,
  the chunks folded left to right; decode runs the chunks in parallel programs and folds them in a
  second kernel, prefill folds them in one program, with the same arithmetic.
- `logprobs.token_logprobs`: soft-cap, log-sum-exp and the chosen token's log-probability, the vocabulary
  streamed through fixed lanes in order; the sampler and `score()` call it, the trainer's sliced head
  runs the same stream (`LogprobStream`, the same kernels).
- `experts.grouped_linear`: the routed experts' products through the same rule as `linear`.

Norms and the elementwise glue are per-row by construction (a row's reduction never sees another row).
"""
