"""The data plane and loss toolkit for cross-tokenizer distillation: byte-exact alignment, jagged batches, projections and losses.

Modules:

- `xtoken_dp.bench.chunks`: `python -m xtoken_dp.bench chunks [--quick]`: segment-sum chunk averaging against the one-hot `bmm` it replaces, forward and backward, time and peak memory, measured in the same run.
- `xtoken_dp.bench.projection`: `python -m xtoken_dp.bench projection [--quick]`: time and peak RSS of the sparse builder on the full mistral_spm -> mistral_tekken pair, against a dense bf16 intermediate measured in the same run."""

__version__ = "0.0.1"
