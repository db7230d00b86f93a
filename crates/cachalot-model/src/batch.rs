//! The packed batch and the paged latent KV cache the model reads and writes.
//!
//! Layout as in `shared/DESIGN.md` ("The seams"): all scheduled tokens of all sequences in one
//! array with their positions, per-sequence start offsets, each sequence's block table, and the
//! token indices whose logits are wanted. Prefill, chunked prefill, decode and (later) MTP
//! verification are all this one shape. The cache is paged (spec `executor.md` paged KV cache;
//! `deepseek-v3-r1-kimi-k2.md` §3.4: slot = block_table[pos / block_size]·block_size +
//! pos % block_size); the model declares how many layers and values per token it needs
//! ([`CacheSpec`]), the owner of the pool hands out blocks.

use crate::error::{ModelError, Result};

/// How the float part of a cache is stored: f32 (exact, the default) or bf16 (C16, as the seed
/// stores its latent cache, spec `deepseek-v3-r1-kimi-k2.md` §3.4: half the memory, every value
/// rounded to the nearest bf16 once, when it is written). `Fp8` is DeepSeek-V4's (spec
/// `deepseek-v4.md` §2.12, §3: the seed's fp8 cache): its float values are stored as bf16, and
/// the model keeps its compressed entries and indexer keys as e4m3 codes with power-of-two
/// block scales in the cache's byte part (`int8_width`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    #[default]
    F32,
    Bf16,
    Fp8,
}

impl KvCacheDtype {
    /// The name the CLI and summary.json use: `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::F32 => "f32",
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8 => "fp8",
        }
    }

    /// Bytes of one stored float value (bf16 in an fp8 cache).
    pub fn bytes(self) -> usize {
        match self {
            KvCacheDtype::F32 => 4,
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => 2,
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(KvCacheDtype::F32),
            "bf16" | "bfloat16" => Ok(KvCacheDtype::Bf16),
            "fp8" | "fp8_e4m3" | "e4m3" => Ok(KvCacheDtype::Fp8),
            _ => Err(format!(
                "unknown KV cache dtype {s:?}: use f32 (exact, the default) or bf16 (half the \
                 memory, values rounded to bf16), or for DeepSeek-V4 fp8 (compressed entries in \
                 e4m3)"
            )),
        }
    }
}

/// What a model needs from the cache pool: `layers` caches of `width` values per token; the
/// first `int8_width` of them are stored as int8 (the C8 latent cache, spec §3.4: c_kv in int8
/// with a per-layer scale the model owns), the rest (the float part) as `float` says. A model
/// that also keeps a bounded state per running sequence (DeepSeek-V4's sliding window and
/// compressor inputs, rings of the last positions) asks for `seq_state_width` values per
/// layer and sequence state slot ([`Batch::state_slots`]), stored as `float` says; 0 for none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheSpec {
    pub layers: usize,
    pub width: usize,
    pub int8_width: usize,
    pub float: KvCacheDtype,
    pub seq_state_width: usize,
}

impl CacheSpec {
    /// Values per token in the float part (f32 or bf16).
    pub fn float_width(&self) -> usize {
        self.width - self.int8_width
    }

    /// Bytes one token takes over all cache layers (float part plus int8 part).
    pub fn bytes_per_token(&self) -> usize {
        self.layers * (self.float_width() * self.float.bytes() + self.int8_width)
    }

    /// Bytes one sequence state slot takes in one cache layer (0 without a state).
    pub fn layer_state_bytes(&self) -> usize {
        self.seq_state_width * self.float.bytes()
    }

    /// Bytes one sequence state slot takes over all cache layers (0 without a state).
    pub fn seq_state_bytes(&self) -> usize {
        self.layers * self.layer_state_bytes()
    }
}

/// A pool of fixed-size blocks: per cache layer, a float array (`float_width` values per slot,
/// f32 or bf16 bits as the spec says) and, for an int8 layout, an int8 array (`int8_width`
/// values per slot); with a per-sequence state, per layer `seq_state_width` values per state
/// slot, f32 or bf16 as the float part (grown on first use, or reserved up front with
/// [`KvCache::reserve_seq_slots`]).
pub struct KvCache {
    spec: CacheSpec,
    block_size: usize,
    num_blocks: usize,
    layers: Vec<Vec<f32>>,
    bf16: Vec<Vec<u16>>,
    int8: Vec<Vec<i8>>,
    /// Per layer: `seq_slots · seq_state_width` values (f32 caches).
    state: Vec<Vec<f32>>,
    /// As `state`, bf16 bit patterns (bf16 caches).
    state_bf16: Vec<Vec<u16>>,
    seq_slots: usize,
}

/// Float values of a cache as a model reads and writes them whatever their storage: f32, or
/// bf16 bit patterns (a value written is rounded to the nearest bf16; one read is widened).
pub enum FloatsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl FloatsMut<'_> {
    /// Values `off..off + len`: borrowed from f32 storage, widened from bf16.
    pub fn read(&self, off: usize, len: usize) -> std::borrow::Cow<'_, [f32]> {
        match self {
            FloatsMut::F32(v) => std::borrow::Cow::Borrowed(&v[off..off + len]),
            FloatsMut::Bf16(v) => std::borrow::Cow::Owned(
                v[off..off + len]
                    .iter()
                    .map(|&b| cachalot_kernels::bf16_to_f32(b))
                    .collect(),
            ),
        }
    }

    /// Writes `src` at `off` (rounded to bf16 in bf16 storage).
    pub fn write(&mut self, off: usize, src: &[f32]) {
        match self {
            FloatsMut::F32(v) => v[off..off + src.len()].copy_from_slice(src),
            FloatsMut::Bf16(v) => {
                for (d, &x) in v[off..off + src.len()].iter_mut().zip(src) {
                    *d = cachalot_kernels::f32_to_bf16(x);
                }
            }
        }
    }

    /// Whether the values are stored as bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, FloatsMut::Bf16(_))
    }
}

/// One layer of a cache, for writing: the int8 part (empty without one) and the float part,
/// in `f32` or in `bf16` as the spec says (the other one empty).
pub struct LayerMut<'a> {
    /// `int8_width` values per slot.
    pub int8: &'a mut [i8],
    /// `float_width` values per slot (f32 caches).
    pub f32: &'a mut [f32],
    /// `float_width` bf16 bit patterns per slot (bf16 caches).
    pub bf16: &'a mut [u16],
}

/// Plain numbers whose all-zero bytes are the value 0.
trait Zeroable: Copy {}
impl Zeroable for i8 {}
impl Zeroable for u16 {}
impl Zeroable for f32 {}

/// `n` zeros, or None where the allocator cannot give them (a pool sized past what the process
/// may hold: an address-space or container limit the size check could not see). Zeroed by the
/// allocator (`calloc`: fresh pages stay untouched until used), as `vec![0; n]` is.
fn try_zeros<T: Zeroable>(n: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size; the memory is zeroed, which is a valid T (an
    // integer or float 0) for every element; the Vec takes ownership with the same layout
    // (capacity n of T, the global allocator).
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(p, n, n))
    }
}

impl KvCache {
    pub fn new(spec: CacheSpec, block_size: usize, num_blocks: usize) -> KvCache {
        Self::try_new(spec, block_size, num_blocks).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`KvCache::new`], or an error saying how many bytes could not be allocated.
    pub fn try_new(
        spec: CacheSpec,
        block_size: usize,
        num_blocks: usize,
    ) -> std::result::Result<KvCache, String> {
        assert!(block_size > 0, "block_size must be positive");
        assert!(spec.int8_width <= spec.width, "int8_width exceeds width");
        let slots = block_size * num_blocks;
        let fail = |n: usize, size: usize| {
            format!(
                "cannot allocate the KV cache of {num_blocks} blocks of {block_size} ({:.2} GiB \
                 for one of its {} layers): the process may not hold that much memory; give \
                 fewer blocks (--kv-blocks) or a smaller scheduler_config.mem_fraction_static",
                (n * size) as f64 / (1u64 << 30) as f64,
                spec.layers
            )
        };
        let int8 = if spec.int8_width > 0 {
            let n = slots * spec.int8_width;
            (0..spec.layers)
                .map(|_| try_zeros::<i8>(n).ok_or_else(|| fail(n, 1)))
                .collect::<std::result::Result<_, _>>()?
        } else {
            Vec::new()
        };
        let n = slots * spec.float_width();
        let (layers, bf16) = match spec.float {
            KvCacheDtype::F32 => (
                (0..spec.layers)
                    .map(|_| try_zeros::<f32>(n).ok_or_else(|| fail(n, 4)))
                    .collect::<std::result::Result<_, _>>()?,
                Vec::new(),
            ),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => (
                Vec::new(),
                (0..spec.layers)
                    .map(|_| try_zeros::<u16>(n).ok_or_else(|| fail(n, 2)))
                    .collect::<std::result::Result<_, _>>()?,
            ),
        };
        Ok(KvCache {
            spec,
            block_size,
            num_blocks,
            layers,
            bf16,
            int8,
            state: vec![Vec::new(); spec.layers],
            state_bf16: vec![Vec::new(); spec.layers],
            seq_slots: 0,
        })
    }

    /// Makes room for sequence state slots `0..n` (no-op without a per-sequence state).
    pub fn reserve_seq_slots(&mut self, n: usize) {
        if self.spec.seq_state_width == 0 || n <= self.seq_slots {
            return;
        }
        let len = n * self.spec.seq_state_width;
        match self.spec.float {
            KvCacheDtype::F32 => self.state.iter_mut().for_each(|l| l.resize(len, 0.0)),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                self.state_bf16.iter_mut().for_each(|l| l.resize(len, 0))
            }
        }
        self.seq_slots = n;
    }

    /// A layer's token storage (its float part) and its per-sequence state (all slots), for
    /// reading and writing both in one step.
    pub fn layer_and_state_mut(&mut self, layer: usize) -> (FloatsMut<'_>, FloatsMut<'_>) {
        match self.spec.float {
            KvCacheDtype::F32 => (
                FloatsMut::F32(self.layers.get_mut(layer).map_or(&mut [], |v| &mut v[..])),
                FloatsMut::F32(self.state.get_mut(layer).map_or(&mut [], |v| &mut v[..])),
            ),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => (
                FloatsMut::Bf16(self.bf16.get_mut(layer).map_or(&mut [], |v| &mut v[..])),
                FloatsMut::Bf16(
                    self.state_bf16
                        .get_mut(layer)
                        .map_or(&mut [], |v| &mut v[..]),
                ),
            ),
        }
    }

    /// A layer's byte part (`int8_width` bytes per slot; empty without one) and its
    /// per-sequence state (all slots): what a model that keeps 8-bit codes per token reads and
    /// writes in one step.
    pub fn layer_bytes_and_state_mut(&mut self, layer: usize) -> (&mut [i8], FloatsMut<'_>) {
        let bytes = self.int8.get_mut(layer).map_or(&mut [][..], |v| &mut v[..]);
        let state = match self.spec.float {
            KvCacheDtype::F32 => {
                FloatsMut::F32(self.state.get_mut(layer).map_or(&mut [], |v| &mut v[..]))
            }
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => FloatsMut::Bf16(
                self.state_bf16
                    .get_mut(layer)
                    .map_or(&mut [], |v| &mut v[..]),
            ),
        };
        (bytes, state)
    }

    /// Appends to `out` state slot `slot` of `layer` (`seq_state_width` values, f32 or bf16
    /// as stored, little-endian): what a KV transfer sends after the rows.
    pub fn read_state(&self, layer: usize, slot: usize, out: &mut Vec<u8>) {
        let w = self.spec.seq_state_width;
        if w == 0 {
            return;
        }
        let range = slot * w..(slot + 1) * w;
        match self.spec.float {
            KvCacheDtype::F32 => push_f32s(
                out,
                self.state[layer].get(range).expect("a reserved state slot"),
            ),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                for v in self.state_bf16[layer]
                    .get(range)
                    .expect("a reserved state slot")
                {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Writes state slot `slot` of `layer` from bytes laid out as [`KvCache::read_state`]
    /// gives them, reserving the slot if need be.
    pub fn write_state(&mut self, layer: usize, slot: usize, data: &[u8]) {
        let w = self.spec.seq_state_width;
        if w == 0 {
            return;
        }
        self.reserve_seq_slots(slot + 1);
        match self.spec.float {
            KvCacheDtype::F32 => fill_f32s(&mut self.state[layer][slot * w..(slot + 1) * w], data),
            KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                let dst = &mut self.state_bf16[layer][slot * w..(slot + 1) * w];
                for (d, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                    *d = u16::from_le_bytes([b[0], b[1]]);
                }
            }
        }
    }

    pub fn spec(&self) -> CacheSpec {
        self.spec
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.len() * 4).sum::<usize>()
            + self.state.iter().map(|l| l.len() * 4).sum::<usize>()
            + self.state_bf16.iter().map(|l| l.len() * 2).sum::<usize>()
            + self.bf16.iter().map(|l| l.len() * 2).sum::<usize>()
            + self.int8.iter().map(Vec::len).sum::<usize>()
    }

    /// The f32 float part of a layer (all of it when the spec has no int8 part); empty in a
    /// bf16 cache.
    pub fn layer(&self, layer: usize) -> &[f32] {
        self.layers.get(layer).map_or(&[], |v| &v[..])
    }
    /// As [`KvCache::layer`], for writing.
    pub fn layer_mut(&mut self, layer: usize) -> &mut [f32] {
        self.layers.get_mut(layer).map_or(&mut [], |v| &mut v[..])
    }
    /// The bf16 float part of a layer; empty in an f32 cache.
    pub fn layer_bf16(&self, layer: usize) -> &[u16] {
        self.bf16.get(layer).map_or(&[], |v| &v[..])
    }
    /// Bytes one token takes in one layer: its int8 part, then its float part (f32 or bf16,
    /// little-endian), the layout of [`KvCache::read_rows`].
    pub fn row_bytes(&self) -> usize {
        self.spec.int8_width + self.spec.float_width() * self.spec.float.bytes()
    }

    /// Appends to `out` the rows of positions `0..n` of `layer` of the sequence whose blocks
    /// are `table`, [`KvCache::row_bytes`] per position: what a KV transfer sends.
    pub fn read_rows(&self, layer: usize, table: &[u32], n: usize, out: &mut Vec<u8>) {
        let (iw, fw) = (self.spec.int8_width, self.spec.float_width());
        out.reserve(n * self.row_bytes());
        for p in 0..n {
            let s = slot_of(table, p, self.block_size);
            if iw > 0 {
                out.extend(
                    self.int8[layer][s * iw..(s + 1) * iw]
                        .iter()
                        .map(|&v| v as u8),
                );
            }
            match self.spec.float {
                KvCacheDtype::F32 => push_f32s(out, &self.layers[layer][s * fw..(s + 1) * fw]),
                KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                    for v in &self.bf16[layer][s * fw..(s + 1) * fw] {
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
    }

    /// Writes rows laid out as [`KvCache::read_rows`] gives them (`data.len()` a multiple of
    /// [`KvCache::row_bytes`]) into positions `0..` of `layer` of the sequence whose blocks are
    /// `table`.
    pub fn write_rows(&mut self, layer: usize, table: &[u32], data: &[u8]) {
        let (iw, fw) = (self.spec.int8_width, self.spec.float_width());
        let row = self.row_bytes();
        for (p, r) in data.chunks_exact(row).enumerate() {
            let s = slot_of(table, p, self.block_size);
            let (i8s, floats) = r.split_at(iw);
            if iw > 0 {
                for (d, &v) in self.int8[layer][s * iw..(s + 1) * iw].iter_mut().zip(i8s) {
                    *d = v as i8;
                }
            }
            match self.spec.float {
                KvCacheDtype::F32 => {
                    fill_f32s(&mut self.layers[layer][s * fw..(s + 1) * fw], floats)
                }
                KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => {
                    let dst = &mut self.bf16[layer][s * fw..(s + 1) * fw];
                    for (d, b) in dst.iter_mut().zip(floats.chunks_exact(2)) {
                        *d = u16::from_le_bytes([b[0], b[1]]);
                    }
                }
            }
        }
    }

    /// Every part of a layer (those the spec does not have are empty).
    pub fn layer_parts_mut(&mut self, layer: usize) -> LayerMut<'_> {
        LayerMut {
            int8: self.int8.get_mut(layer).map_or(&mut [], |v| &mut v[..]),
            f32: self.layers.get_mut(layer).map_or(&mut [], |v| &mut v[..]),
            bf16: self.bf16.get_mut(layer).map_or(&mut [], |v| &mut v[..]),
        }
    }
}

/// Hands out free blocks of a [`KvCache`]. The engine's scheduler will own one of these; the
/// CLI and tests use it directly.
pub struct BlockAllocator {
    free: Vec<u32>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize) -> BlockAllocator {
        BlockAllocator {
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Grows `table` so that it covers `n_tokens` positions.
    pub fn ensure(
        &mut self,
        table: &mut Vec<u32>,
        n_tokens: usize,
        block_size: usize,
    ) -> Result<()> {
        let needed = n_tokens.div_ceil(block_size);
        while table.len() < needed {
            let b = self.free.pop().ok_or_else(|| {
                ModelError::Batch(format!(
                    "KV cache is full: {n_tokens} tokens need {needed} blocks of {block_size}; \
                     raise the cache size"
                ))
            })?;
            table.push(b);
        }
        Ok(())
    }

    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.extend(table.drain(..).rev());
    }
}

/// All scheduled tokens of all sequences, packed.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// `seq_starts[s]..seq_starts[s+1]` are the tokens of sequence `s` (length = sequences + 1).
    pub seq_starts: Vec<usize>,
    /// Per sequence: the cache blocks holding positions `[i·block_size, (i+1)·block_size)`.
    pub block_tables: Vec<Vec<u32>>,
    /// Token indices (into `tokens`) whose logits are returned, in this order.
    pub logits_indices: Vec<usize>,
    /// Per sequence (missing entries: unmarked): what its positions are
    /// ([`Batch::mark_prefill`], [`Batch::mark_generated`]).
    pub kinds: Vec<SeqKind>,
    /// Per sequence (missing entries: its index in the batch): the cache's state slot that
    /// holds its per-sequence state ([`CacheSpec::seq_state_width`]); a sequence keeps its slot
    /// from its first position to its last, and no two sequences of a batch share one.
    pub state_slots: Vec<u32>,
}

/// What a sequence's positions in a [`Batch`] are, for a model that computes each kind one way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeqKind {
    /// Not said: the model chooses by cost.
    #[default]
    Unmarked,
    /// Prompt positions.
    Prompt,
    /// Generated ones (decode, MTP verification, or their recompute after preemption).
    Generated,
}

impl Batch {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
    pub fn num_seqs(&self) -> usize {
        self.seq_starts.len().saturating_sub(1)
    }

    /// A decode step: every sequence contributes exactly one token (at least one sequence).
    pub fn is_decode(&self) -> bool {
        self.num_seqs() > 0 && self.seq_starts.windows(2).all(|w| w[1] - w[0] == 1)
    }

    /// Appends one sequence's scheduled tokens at consecutive positions starting at `start_pos`.
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        block_table: Vec<u32>,
        want_logits: LogitsWanted,
    ) {
        if self.seq_starts.is_empty() {
            self.seq_starts.push(0);
        }
        let base = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((0..tokens.len()).map(|i| start_pos + i));
        self.seq_starts.push(self.tokens.len());
        self.block_tables.push(block_table);
        match want_logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => {
                if !tokens.is_empty() {
                    self.logits_indices.push(base + tokens.len() - 1)
                }
            }
            LogitsWanted::All => self.logits_indices.extend(base..base + tokens.len()),
        }
    }

    /// Marks the last sequence pushed as prompt positions: a prompt's positions are then
    /// computed alike however it was split into chunks or taken from a prefix cache
    /// (DeepSeek-V3: the naive MLA path, attended in f32 over a bf16 cache too).
    pub fn mark_prefill(&mut self) {
        self.mark(SeqKind::Prompt);
    }

    /// Marks the last sequence pushed as generated positions: computed as a decode step
    /// computes them, however many run together (DeepSeek-V3: the absorbed MLA path), so a
    /// recompute after preemption gives their first computation's bits.
    pub fn mark_generated(&mut self) {
        self.mark(SeqKind::Generated);
    }

    /// Says what the last sequence pushed is.
    pub fn mark(&mut self, kind: SeqKind) {
        if let Some(last) = self.block_tables.len().checked_sub(1) {
            self.kinds.resize(last + 1, SeqKind::Unmarked);
            self.kinds[last] = kind;
        }
    }

    /// What sequence `s` is.
    pub fn kind(&self, s: usize) -> SeqKind {
        self.kinds.get(s).copied().unwrap_or_default()
    }

    /// Gives the last sequence pushed state slot `slot`.
    pub fn set_state_slot(&mut self, slot: u32) {
        if let Some(last) = self.block_tables.len().checked_sub(1) {
            while self.state_slots.len() < last {
                let s = self.state_slots.len() as u32;
                self.state_slots.push(s);
            }
            self.state_slots.truncate(last);
            self.state_slots.push(slot);
        }
    }

    /// The state slot of sequence `s`.
    pub fn state_slot(&self, s: usize) -> usize {
        self.state_slots.get(s).map_or(s, |&v| v as usize)
    }

    /// Checks the invariants the forward pass relies on.
    pub fn validate(&self, block_size: usize, num_blocks: usize, vocab: usize) -> Result<()> {
        let err = |m: String| Err(ModelError::Batch(m));
        if self.positions.len() != self.tokens.len() {
            return err(format!(
                "{} tokens but {} positions",
                self.tokens.len(),
                self.positions.len()
            ));
        }
        if self.seq_starts.first() != Some(&0)
            || self.seq_starts.last() != Some(&self.tokens.len())
            || self.seq_starts.windows(2).any(|w| w[0] > w[1])
        {
            return err(format!(
                "seq_starts {:?} must rise from 0 to the token count {}",
                self.seq_starts,
                self.tokens.len()
            ));
        }
        if self.block_tables.len() != self.num_seqs() {
            return err(format!(
                "{} block tables for {} sequences",
                self.block_tables.len(),
                self.num_seqs()
            ));
        }
        if let Some(&t) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return err(format!(
                "token id {t} is outside the vocabulary of {vocab} (config.json vocab_size; a \
                 prompt's ids come from the tokenizer, or were given as ids: is the tokenizer \
                 (tokenizer.json or tiktoken.model) this model's, or are the ids?)"
            ));
        }
        if let Some(&i) = self
            .logits_indices
            .iter()
            .find(|&&i| i >= self.tokens.len())
        {
            return err(format!(
                "logits index {i} is past the {} tokens",
                self.tokens.len()
            ));
        }
        for s in 0..self.num_seqs() {
            let range = self.seq_starts[s]..self.seq_starts[s + 1];
            let table = &self.block_tables[s];
            if let Some(&b) = table.iter().find(|&&b| b as usize >= num_blocks) {
                return err(format!(
                    "sequence {s}: block {b} is outside the pool of {num_blocks}"
                ));
            }
            for i in range.clone() {
                let p = self.positions[i];
                if p / block_size >= table.len() {
                    return err(format!(
                        "sequence {s}: position {p} has no cache block (table of {})",
                        table.len()
                    ));
                }
            }
            // Every query attends to positions 0..=p, which must be cached already or be
            // written by this step: positions of one sequence's new tokens are consecutive.
            if range.len() > 1
                && self.positions[range.clone()]
                    .windows(2)
                    .any(|w| w[1] != w[0] + 1)
            {
                return err(format!(
                    "sequence {s}: positions of a step must be consecutive"
                ));
            }
        }
        Ok(())
    }

    /// Cache slot of token `i` of sequence `s`.
    #[inline]
    pub fn slot(&self, s: usize, i: usize, block_size: usize) -> usize {
        slot_of(&self.block_tables[s], self.positions[i], block_size)
    }
}

/// Appends `src` to `out` as little-endian f32 bytes.
fn push_f32s(out: &mut Vec<u8>, src: &[f32]) {
    out.reserve(src.len() * 4);
    for v in src {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Fills `dst` from little-endian f32 bytes.
fn fill_f32s(dst: &mut [f32], bytes: &[u8]) {
    for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

#[inline]
pub fn slot_of(table: &[u32], position: usize, block_size: usize) -> usize {
    table[position / block_size] as usize * block_size + position % block_size
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    Last,
    All,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows read from one cache's blocks and written into another's (other block size, other
    /// blocks) read back the same, for each layout.
    #[test]
    fn rows_move_between_caches_of_other_block_sizes() {
        for (int8_width, float) in [
            (0, KvCacheDtype::F32),
            (0, KvCacheDtype::Bf16),
            (4, KvCacheDtype::Bf16),
            (4, KvCacheDtype::F32),
        ] {
            let spec = CacheSpec {
                layers: 2,
                width: 7,
                int8_width,
                float,
                seq_state_width: 0,
            };
            let mut a = KvCache::new(spec, 4, 8);
            for l in 0..2 {
                let parts = a.layer_parts_mut(l);
                for (i, v) in parts.int8.iter_mut().enumerate() {
                    *v = (i as i32 * 37 % 251 - 125) as i8;
                }
                for (i, v) in parts.f32.iter_mut().enumerate() {
                    *v = i as f32 * 0.25 - 3.0;
                }
                for (i, v) in parts.bf16.iter_mut().enumerate() {
                    *v = (i * 977) as u16;
                }
            }
            let (ta, tb) = ([5u32, 2, 7], [3u32, 1, 4, 6, 2]);
            let n = 10;
            let mut b = KvCache::new(spec, 3, 8);
            for l in 0..2 {
                let mut rows = Vec::new();
                a.read_rows(l, &ta, n, &mut rows);
                assert_eq!(rows.len(), n * a.row_bytes());
                b.write_rows(l, &tb, &rows);
                let mut back = Vec::new();
                b.read_rows(l, &tb, n, &mut back);
                assert_eq!(back, rows, "{spec:?} layer {l}");
            }
        }
    }

    #[test]
    fn cache_bytes_match_the_spec() {
        for int8_width in [0, 512] {
            for float in [KvCacheDtype::F32, KvCacheDtype::Bf16] {
                let spec = CacheSpec {
                    layers: 3,
                    width: 576,
                    int8_width,
                    float,
                    seq_state_width: 0,
                };
                let mut cache = KvCache::new(spec, 16, 5);
                assert_eq!(cache.bytes(), spec.bytes_per_token() * 16 * 5);
                let parts = cache.layer_parts_mut(2);
                let per_slot = spec.float_width() * 16 * 5;
                let (f, h) = match float {
                    KvCacheDtype::F32 => (per_slot, 0),
                    KvCacheDtype::Bf16 | KvCacheDtype::Fp8 => (0, per_slot),
                };
                assert_eq!((parts.f32.len(), parts.bf16.len()), (f, h));
                assert_eq!(parts.int8.len(), int8_width * 16 * 5);
            }
        }
        assert_eq!(
            CacheSpec {
                layers: 2,
                width: 576,
                int8_width: 0,
                float: KvCacheDtype::Bf16,
                seq_state_width: 0,
            }
            .bytes_per_token(),
            2 * 576 * 2
        );
        assert_eq!("BF16".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Bf16));
        assert!("f8".parse::<KvCacheDtype>().unwrap_err().contains("f32"));
    }
}
