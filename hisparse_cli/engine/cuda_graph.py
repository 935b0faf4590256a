"""CUDA-graph decode: one decode step (T = 1) captured once and replayed for every token.

Everything a step reads lives in static device buffers: the token, its position (the attention
kernels read `q_start` from that tensor), its slot, and the visible block list padded to the
working-set bound (padding blocks start at a huge position, so the causal test masks them).
The KV storage was allocated once at the run's start (at its working-set bound; it never
grows) and global/candidate slots are updated in place, so captured pointers stay valid; the
Engine keeps storage, decoder and graph for the next generate of the same shapes (`rebind`,
engine/decode_state.py), whose first step then replays instead of capturing. Host
bookkeeping (block table, eviction, recalibration, the retrieval tier's offloads) runs between
replays as plain Python plus eager tensor ops; the retrieval tier's page choice and copies run
inside the graph before the forward (engine/retrieval.py, its static form), for the layer-by-layer
forward and the persistent kernel alike. A step that keeps the last page choice
(`retrieval_every` > 1) replays a second graph, captured without the choice into the same
memory pool, writing the same logits buffer; per-step inputs travel in one pinned-memory copy. Sampling stays on the
device; the host reads tokens back only every `sync_every` steps (to stop at EOS), so there is
no host synchronisation per token. With the input embedding table in host memory (the
tight-VRAM option) a kernel in the graph reads the token's row from it (kernels/cuda/host_rows.py),
where the loader could register the table for device access.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from hisparse_cli.engine.runner import KVRun, StepContext
from hisparse_cli.engine.sparsity import cdiv

def _mapped(table: torch.Tensor) -> bool:
    from hisparse_cli.kernels.dispatch import triton_available

    if not triton_available():
        return False
    from hisparse_cli.kernels.cuda.host_rows import is_mapped

    return is_mapped(table)


PAD_START = 1 << 30  # start position of padding blocks: later than any query, so masked (the
# kernels compute key positions in int32, so the pad start + block offsets must stay < 2**31)


@lru_cache(maxsize=None)
def graph_stream(device_index: int) -> "torch.cuda.Stream":
    """The one side stream of the process (per device) on which every decode graph is warmed
    up and captured. cuBLAS keeps a workspace (32 MiB on sm90) for each stream it runs on, for
    the life of the process: a fresh stream per run would add one per generate call (up to
    the stream pool's size), and separate warm-up and capture streams two. The memory planner
    counts this one workspace (`workspace.cublas_graph_stream`)."""
    return torch.cuda.Stream(device=device_index)


class GraphStepContext(StepContext):
    """StepContext over the decoder's static buffers (no per-step tensor creation)."""

    def __init__(self, run: KVRun, q_pos: torch.Tensor, slots: torch.Tensor,
                 block_ids: torch.Tensor, block_starts: torch.Tensor) -> None:
        self.run, self.n = run, 1
        self.q_start = q_pos  # [1] int64 device tensor
        self.slots, self.block_ids, self.block_starts = slots, block_ids, block_starts
        self.memo = None
        self.wants_hidden = run.token_scorer is not None
        self.window = run.seq.window
        if run.retrieval is not None and self.window is not None:
            # the eager step's window reaches back to its first window block's start (every
            # key of a listed block is seen: it is not retrievable until it is evicted); its
            # widest, window + bs - 1, shows exactly the listed blocks at every position
            self.window += run.sparse.block_size - 1


class GraphDecoder:
    """Decode steps of one run through a captured CUDA graph."""

    def __init__(self, model, run: KVRun, total_tokens: int, capture: bool | None = None,
                 host_embeddings: bool | None = None, host_gather: bool | None = None,
                 persistent: bool = False) -> None:
        """capture=False runs the same static-buffer step eagerly every time (no graph): the
        CPU tests use it to check the padded block list and device q_start without CUDA.
        host_embeddings (default: the table is not on the run's device): the graph starts
        from a static [1, hidden] input, filled with the token's row of the host table.
        host_gather (default: the loader registered the table for device access,
        kernels/cuda/host_rows.py): a kernel in the graph reads the row from host memory at the
        device-resident token; otherwise the host reads the sampled token (one
        synchronisation a token) and copies its row. persistent: the execution plan chose
        the persistent decode kernel (kernels/cuda/cuda_step.py), which the step then runs
        where this run allows it (else `cuda_step_reason` says why not)."""
        self.model, self.run = model, run
        self.capture = run.device.type == "cuda" if capture is None else capture
        table = model.model.embed_tokens.weight
        self.host_table = (table.device.type != run.device.type if host_embeddings is None
                           else host_embeddings)
        if host_gather is None:
            host_gather = self.host_table and _mapped(table)
        self.host_gather = bool(host_gather) and self.host_table
        dev = run.device
        self.nb_max = self.padded_blocks(run, total_tokens)
        # the storage was allocated once when the run started, at its working-set bound
        # (>= this one: decode steps are 1 token); the pool cannot mint an id past it
        assert run.pool.storage_blocks == run.cache.capacity, "run without bound storage"
        n = 2 + 2 * self.nb_max
        self.dev = torch.zeros(n, dtype=torch.int64, device=dev)
        cuda = dev.type == "cuda"
        self.host = [torch.zeros(n, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._host_np = [h.numpy() for h in self.host]  # cheap scalar writes
        self._span: tuple[int, int] | None = None  # visible span the block list was built for
        self._active = 0  # blocks in that list before its padding (--trace)
        self._blocks: torch.Tensor | None = None  # [2 * nb_max] padded ids + starts (host)
        self._version, self._buf_version = 0, [-1, -1]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.tok = torch.zeros(1, dtype=torch.int64, device=dev)
        if self.host_table:  # the embedded token: host staging row -> static device input
            hidden, cdt = model.cfg.hidden_size, model.compute_dtype
            self.x = torch.zeros((1, hidden), dtype=cdt, device=dev)
            if not self.host_gather:
                self.x_host = torch.zeros((1, hidden), dtype=cdt, pin_memory=cuda)
        self.ctx = GraphStepContext(run, self.dev[0:1], self.dev[1:2], self.dev[2:2 + self.nb_max],
                                    self.dev[2 + self.nb_max:])
        self.graph: torch.cuda.CUDAGraph | None = None  # a step (with the page choice)
        self.keep_graph: torch.cuda.CUDAGraph | None = None  # one keeping the last choice
        self.logits: torch.Tensor | None = None  # both graphs' output
        # the greedy sampler inside the step (kernels/sampling/graph_sampler.py), where attached: the
        # step then writes the next token into self.tok itself
        self.sampler = None
        self.sampled = False  # the step (and its captured graph) runs self.sampler
        self.steps = 0
        self.captures = 0  # graphs captured by this decoder (2 at most; 0 with capture=False)
        # the persistent decode kernel (kernels/cuda/cuda_step.py) in place of the
        # layer-by-layer forward, where the plan chose it and this run allows it
        self.persistent = persistent
        self.cuda_step = None
        self.cuda_step_reason: str | None = None
        if persistent:
            self.cuda_step_reason = self._persistent_unsupported()
            if self.cuda_step_reason is None:
                from hisparse_cli.kernels.cuda.cuda_step import CudaDecodeStep

                self.cuda_step = CudaDecodeStep(model, run, self.dev, self.tok, self.nb_max)

    def _persistent_unsupported(self) -> str | None:
        """Why this decoder cannot run the persistent kernel (None: it can)."""
        if self.host_table and not self.host_gather:
            return "the host embedding table is read by the host (not registered)"
        from hisparse_cli.kernels.cuda.cuda_step import unsupported

        return unsupported(self.model, self.run)

    @staticmethod
    def padded_blocks(run: KVRun, total_tokens: int) -> int:
        """nb_max: the length the visible block list is padded to (the working-set bound of
        a one-token step, capped at the text's blocks)."""
        seq, bs = run.seq, run.sparse.block_size
        if seq.window is None:
            return cdiv(total_tokens, bs)
        return min(seq.working_set_bound(1), cdiv(total_tokens, bs))

    def rebind(self, model, run: KVRun, total_tokens: int) -> bool:
        """Serve a new run with this decoder's buffers and captured graph (Engine keeps one
        across generate calls): possible when everything the capture baked in is the same --
        the model, the KV cache object (its storage pointers; engine/decode_state.py hands
        the new run the kept cache, reset), the padded list length, and the run's kernel
        arguments. Then the next step replays the graph (no warm-up, no capture) and the
        host state starts over; False (nothing changed) when the capture does not fit."""
        old = self.run
        if not (model is self.model and run.cache is old.cache
                and self.padded_blocks(run, total_tokens) == self.nb_max
                and run.backend == old.backend and run.scale == old.scale
                and run.track_scores == old.track_scores
                and run.score_kwargs == old.score_kwargs
                and run.token_scorer is old.token_scorer
                and run.retrieval is old.retrieval  # (kept with the cache, reset: its buffers)
                and (run.seq.sinks, run.seq.window) == (old.seq.sinks, old.seq.window)):
            return False
        for done in self.copied:
            if done is not None:
                done.synchronize()  # the last run's copies out of the pinned buffers
        self.run = self.ctx.run = run
        if self.cuda_step is not None:  # its launch reads only what was checked equal above
            self.cuda_step.run = run
        self._span, self._blocks = None, None
        self._version, self._buf_version = 0, [-1, -1]
        self.steps = 0
        return True

    def release(self) -> None:
        """Drop the graphs and their output (their private memory pool goes with them)."""
        for g in (self.keep_graph, self.graph):
            if g is not None:
                g.reset()
        self.graph, self.keep_graph, self.logits = None, None, None

    def _prepare(self) -> None:
        """Host bookkeeping for the next position; one pinned copy of the step's inputs.
        O(1) Python per token: the padded block list is rebuilt only when the visible span
        changes (a new block, or the window's first block moving: once per block_size
        tokens); otherwise only the position and the slot are written."""
        run, seq = self.run, self.run.seq
        p = seq.num_tokens
        run.begin_step()  # the retrieval tier: after the last offload copy; the step's number
        new = seq.append(1)
        if new:
            assert run.pool.capacity <= run.cache.capacity, "block ids past the KV storage"
            run.cache.reset_scores(new)
            live = run.pool.live * run.cache.bytes_per_block() + run.cache.slot_bytes()
            run.kv_bytes_peak = max(run.kv_bytes_peak, live)
        span = seq.visible_span(p, 1)
        if span != self._span:
            self._span = span
            ids, starts = seq.visible_blocks(p, 1)
            self._active = len(ids)
            pad = self.nb_max - len(ids)
            assert pad >= 0, (len(ids), self.nb_max)
            self._blocks = torch.tensor(ids + [ids[0]] * pad + starts + [PAD_START] * pad,
                                        dtype=torch.int64)
            self._version += 1
        k = self.steps % 2
        buf, done = self.host[k], self.copied[k]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer is done
        if self._buf_version[k] != self._version:
            buf[2:].copy_(self._blocks)
            self._buf_version[k] = self._version
        bs = run.sparse.block_size
        view = self._host_np[k]
        view[0], view[1] = p, seq.block_table[p // bs] * bs + p % bs  # position, slot
        self.dev.copy_(buf, non_blocking=True)
        if done is not None:
            done.record()

    def sample_in_graph(self, gen, eos) -> bool:
        """Have the step sample greedily itself (kernels/sampling/graph_sampler.py), armed for this
        generate; False where it cannot (not greedy, or the host reads each token to copy its
        embedding row). A graph captured for other settings, or without the sampler, is
        dropped (the next step captures again)."""
        from hisparse_cli.engine.sampling.graph import GraphSampler

        if not GraphSampler.serves(gen, eos) or (self.host_table and not self.host_gather):
            self.use_host_sampler()
            return False
        vocab = self.model.cfg.vocab_size
        gs = self.sampler
        if gs is None or gs.capacity < gen.max_new_tokens or gs.vocab != vocab:
            gs = self.sampler = GraphSampler(vocab, gen.max_new_tokens, self.run.device)
            self.release()
        if gs.reset(gen, eos) or not self.sampled:
            self.release()
        self.sampled = True
        return True

    def use_host_sampler(self) -> None:
        """The step returns logits only (the caller samples); drops a graph that sampled."""
        if self.sampled:
            self.release()
        self.sampled = False

    def sample_first(self, logits: torch.Tensor) -> None:
        """The first token, from the prefill's last logits row, into self.tok and the
        sampler's history (the steps sample the rest)."""
        self.sampler(logits[-1], self.tok)

    def _body(self, choose: bool = True) -> torch.Tensor:
        logits = self._forward(choose)
        if self.sampled:
            self.sampler(logits[-1], self.tok)
        return logits

    def _forward(self, choose: bool) -> torch.Tensor:
        tier = self.run.retrieval
        if tier is not None and choose:  # every layer's pages, from the last step's queries
            tier.choose_decode(static=True)  # (static form: the device-held offloaded range)
        if self.cuda_step is not None:  # the whole step in one kernel (it reads the token's
            logits = self.cuda_step()   # embedding row itself)
            if tier is not None:  # the step's queries for the next choice, from its q sums
                self.cuda_step.keep_queries(tier)
            return logits
        if self.host_table:
            if self.host_gather:  # the row read from host memory by a kernel in the graph
                from hisparse_cli.kernels.cuda.host_rows import gather_rows

                gather_rows(self.model.model.embed_tokens.weight, self.tok, self.x)
            return self.model.forward_hidden(self.x, self.dev[0:1], self.ctx)
        return self.model(self.tok, self.dev[0:1], self.ctx)

    def step(self, token: torch.Tensor | None) -> torch.Tensor:
        """token: [1] int64 on the device (the token at the next position), or None where the
        step samples itself (sample_in_graph: the previous step or sample_first wrote it)
        -> logits [1, V]."""
        self._prepare()
        if token is None:
            assert self.sampled, "no token and no sampler in the step"
        elif self.host_table and not self.host_gather:
            # the token's row from the host table; .item() waits for the sampler, so the
            # previous step's copy out of x_host is done before it is overwritten
            table = self.model.model.embed_tokens.weight
            self.x_host.copy_(table[int(token.reshape(-1)[0].item())].view(1, -1))
            self.x.copy_(self.x_host, non_blocking=True)
        else:
            self.tok.copy_(token)
        tier = self.run.retrieval
        choose = tier is None or tier.choose  # (a kept choice: the graph without it)
        graph = self.graph if choose else self.keep_graph
        if not self.capture:
            result = self._body(choose)
        elif graph is not None:
            graph.replay()
            result = self.logits
        elif choose or self.graph is not None:  # run eagerly (warms kernels up), then capture
            result = self._capture(choose)
        else:  # (a kept choice before any capture: the first decode step always chooses)
            result = self._body(False)
        self.steps += 1
        self._after_step()
        return result

    def _capture(self, choose: bool) -> torch.Tensor:
        """A step, eagerly on the graph stream, then captured (choose: with the page choice,
        as `graph`; else as `keep_graph`, after it: its pool, its logits buffer); its logits."""
        dev = self.run.device
        stream = graph_stream(dev.index if dev.index is not None else torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = self._body(choose)
        torch.cuda.current_stream().wait_stream(stream)
        snapshot = self._scores_snapshot()
        graph = torch.cuda.CUDAGraph()
        # the warm-up's stream (one cuBLAS workspace); the two graphs never run at once, and
        # every tensor that lives from one replay to the next is held outside the pool
        pool = None if choose else self.graph.pool()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = self._body(choose)
            if not choose and logits.data_ptr() != self.logits.data_ptr():
                self.logits.copy_(logits)
        self._scores_restore(snapshot)  # capture does not run, but be exact anyway
        if choose:  # only a completed capture is kept
            self.graph, self.logits = graph, logits
        else:
            self.keep_graph = graph
        self.captures += 1
        return out

    def _after_step(self) -> None:
        run = self.run
        start = run.seq.num_tokens - 1
        evicted = run.end_step(start, 1)
        if run.trace is not None:  # (--trace: the record reads the step's counts back)
            run.trace(run.step_record(start, 1, self._active, evicted))

    def _scores_snapshot(self):
        c = self.run.cache
        return [t.clone() for t in (c.score, c.gmass, c.gseen) if t is not None]

    def _scores_restore(self, snap) -> None:
        c = self.run.cache
        for dst, src in zip([t for t in (c.score, c.gmass, c.gseen) if t is not None], snap):
            dst.copy_(src)
