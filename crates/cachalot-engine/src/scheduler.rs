//! The scheduler: which tokens of which requests go into the next forward pass. Pure logic over
//! token counts and the block pool, testable without a model (vLLM v1's shape).
//!
//! A request is one growing token list (prompt, then each sampled token) of which the first
//! `num_computed` have their KV in the cache. Every step schedules, per request, the next
//! tokens whose KV is missing; when a step covers the last known token, its logits are sampled
//! and one token is appended. Prefill, chunked prefill, decode and recompute after preemption
//! are all this one rule.
//!
//! Policy of one step:
//! 1. Running requests first, oldest first. A request in decode gets its one token; one still
//!    prefilling gets a chunk of at most what is left of the step's prefill budget
//!    (`max_prefill_tokens`). If the pool cannot cover the new tokens, the newest running
//!    request is preempted (its blocks freed, its KV to be recomputed later, back to the front
//!    of the queue) until it can, possibly the request itself.
//! 2. Then, if nothing was preempted this step, waiting requests are admitted in order while
//!    fewer than `batch_size` run and budget is left, each with a first chunk; a preempted
//!    request only where the pool has room for its generated tokens too (admitted with less,
//!    the chunks recomputing them would preempt it again at once, step after step). The first
//!    that is not admitted stays at the head of the queue and admission stops for this step
//!    (the seed system spins on it forever — spec `executor.md` §7.1; we don't).
//!
//! Speculative decoding (spec `executor.md` §2.8, `deepseek-v3-r1-kimi-k2.md` §3.8): with a
//! lookahead of n ([`Scheduler::set_lookahead`]), a decode request also gets cache slots for up
//! to n draft tokens after its known token (never more than it may still generate), when the
//! pool has them; otherwise it decodes plainly (drafts are never a reason to preempt). After the
//! verifying forward, [`Scheduler::accept_drafts`] counts the accepted drafts' KV as computed
//! and returns to the pool every block held only for rejected ones, so between steps a running
//! request holds exactly the blocks its computed tokens need (checked by
//! [`Scheduler::check_invariants`]). Rejected drafts' KV beyond that is simply not counted and
//! gets overwritten.
//!
//! Prefix caching (when the pool has it on, [`KvBlockManager::enable_prefix_caching`]): a request
//! added with its tokens ([`Scheduler::add_prompt`]) registers each of its blocks of prompt
//! tokens (and of generated ones too with [`Scheduler::set_share_generated`]) once they are all
//! computed (checked at the start of every step, and when it finishes or is
//! preempted), and when it is admitted with nothing computed (first admission, or recompute
//! after preemption) it takes the longest run of registered blocks matching its first tokens:
//! they count as computed and its first chunk starts after them. At least the last known token
//! is always computed (its logits are sampled), so at most `(num_tokens − 1) / block_size` full
//! blocks are taken; the shared blocks are never written. A waiting request whose next block
//! to compute is a prompt block a running request is still computing waits (keeping its place
//! in the queue; admission goes on with the requests after it), so requests that arrive
//! together with the same prompt compute it once.
//!
//! Progress: a request is accepted only if it fits the pool alone, so the oldest running
//! request always gets its tokens (by preempting everyone after it if need be), and with no
//! request running the pool is empty and the queue's head fits. Every step with unfinished
//! requests therefore schedules at least one token.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::kv_pool::{block_key, BlockKey, KvBlockManager};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests running at once.
    pub batch_size: usize,
    /// Prompt (and recompute) tokens per step, over all requests; decode tokens are not counted.
    pub max_prefill_tokens: usize,
    /// Cut every prompt at the same places whatever else runs: chunks end at multiples of
    /// `max_prefill_tokens` (or at the prompt's end), and a chunk that does not fit what is
    /// left of a step's budget waits for the next step instead of being cut shorter. For
    /// models whose prompt bits depend on the cut (a C8 cache), so a request's output does not
    /// depend on the traffic beside it.
    pub fixed_chunks: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("request {0} is already known")]
    Duplicate(u64),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "request needs up to {tokens} tokens of KV cache ({blocks} blocks) but the pool holds \
         {capacity} blocks of {block_size}; shorten the prompt or max_new_tokens, or give the KV \
         cache more blocks (--kv-blocks, or more memory: mem_fraction_static)"
    )]
    TooLong {
        tokens: usize,
        blocks: usize,
        capacity: usize,
        block_size: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Waiting,
    Running,
}

#[derive(Clone, Debug)]
struct Seq {
    /// Prompt + generated tokens known so far.
    num_tokens: usize,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    prompt_len: usize,
    /// Most tokens it may reach (prompt + max_new_tokens).
    max_len: usize,
    /// Draft slots held beyond `num_computed` until [`Scheduler::accept_drafts`].
    pending_drafts: usize,
    phase: Phase,
    num_preemptions: usize,
    /// The token list, for prefix caching (None: the request was added by counts alone).
    tokens: Option<Vec<u32>>,
    /// Keys of its full blocks of known tokens, in order (computed as far as needed).
    keys: Vec<BlockKey>,
    /// Blocks of its current table already offered to the prefix cache.
    registered: usize,
    /// It may take cached blocks when admitted (false: every prompt position must run, e.g.
    /// to score the prompt).
    reuse: bool,
    /// Positions whose MTP layer cache rows are written (they wait for the next token), from
    /// the first on; with a prefix lookahead only blocks within it are offered to the cache.
    mtp_computed: usize,
}

impl Seq {
    /// A request of `num_tokens` known tokens, `num_computed` of them cached, outside prefix
    /// caching until [`Scheduler::add_prompt`] gives it its tokens.
    fn new(
        num_tokens: usize,
        num_computed: usize,
        prompt_len: usize,
        max_len: usize,
        phase: Phase,
    ) -> Seq {
        Seq {
            num_tokens,
            num_computed,
            prompt_len,
            max_len,
            pending_drafts: 0,
            phase,
            num_preemptions: 0,
            tokens: None,
            keys: Vec::new(),
            registered: 0,
            reuse: false,
            mtp_computed: 0,
        }
    }
}

/// One request's share of a step: tokens `start..start + len` of its token list, at positions
/// `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: u64,
    pub start: usize,
    pub len: usize,
    /// The step covers the last known token: sample one from its logits.
    pub sample: bool,
    /// A single generated token (decode), as opposed to prompt or recompute work (prefill).
    pub decode: bool,
    /// Cache slots held for draft tokens at positions `start + len..start + len + drafts`
    /// (speculative decoding; 0 otherwise). The step must end with
    /// [`Scheduler::accept_drafts`] for this request when it is not zero.
    pub drafts: usize,
    /// Admitted this step with its first `cached` tokens' KV taken from the prefix cache
    /// (`start` equals it then); 0 otherwise.
    pub cached: usize,
    /// Admitted from the queue this step (first admission or recompute after preemption).
    pub admitted: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    pub items: Vec<Scheduled>,
    /// Requests preempted this step (their KV will be recomputed).
    pub preempted: Vec<u64>,
}

impl Schedule {
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|s| s.len).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvBlockManager,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    seqs: HashMap<u64, Seq>,
    lookahead: usize,
    /// Blocks of generated tokens are offered to the prefix cache too: the model computes a
    /// generated position's KV with the bits a prefill of the same tokens gives (DeepSeek-V4).
    share_generated: bool,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, kv: KvBlockManager) -> Scheduler {
        assert!(cfg.batch_size > 0 && cfg.max_prefill_tokens > 0);
        Scheduler {
            cfg,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            seqs: HashMap::new(),
            lookahead: 0,
            share_generated: false,
        }
    }

    /// Draft tokens a decode request may verify per step (0: no speculative decoding).
    pub fn set_lookahead(&mut self, n: usize) {
        self.lookahead = n;
    }
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }
    pub fn kv(&self) -> &KvBlockManager {
        &self.kv
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }
    pub fn block_table(&self, id: u64) -> &[u32] {
        self.kv.block_table(id)
    }
    pub fn num_preemptions(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.num_preemptions)
    }
    pub fn phase(&self, id: u64) -> Option<Phase> {
        self.seqs.get(&id).map(|s| s.phase)
    }

    /// A new request `id` that may grow to `max_len` tokens: not known yet, and the pool could
    /// hold it alone.
    pub fn check_new(&self, id: u64, max_len: usize) -> Result<(), AdmissionError> {
        if self.seqs.contains_key(&id) {
            return Err(AdmissionError::Duplicate(id));
        }
        let blocks = self.kv.blocks_for(max_len);
        if blocks > self.kv.pool().capacity() {
            return Err(AdmissionError::TooLong {
                tokens: max_len,
                blocks,
                capacity: self.kv.pool().capacity(),
                block_size: self.kv.block_size(),
            });
        }
        Ok(())
    }

    /// Queues a request of `prompt_len` tokens that may grow to `max_len` tokens.
    pub fn add(
        &mut self,
        id: u64,
        prompt_len: usize,
        max_len: usize,
    ) -> Result<(), AdmissionError> {
        if prompt_len == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        let max_len = max_len.max(prompt_len);
        self.check_new(id, max_len)?;
        self.seqs.insert(
            id,
            Seq::new(prompt_len, 0, prompt_len, max_len, Phase::Waiting),
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// [`Scheduler::add`] with the prompt's tokens, for prefix caching: its computed blocks are
    /// registered, and with `reuse` it takes cached blocks of the same prefix when admitted.
    /// Its tokens must then be appended with [`Scheduler::append_token_ids`].
    pub fn add_prompt(
        &mut self,
        id: u64,
        prompt: &[u32],
        max_len: usize,
        reuse: bool,
    ) -> Result<(), AdmissionError> {
        self.add(id, prompt.len(), max_len)?;
        if self.kv.prefix_caching() {
            let s = self.seqs.get_mut(&id).expect("just added");
            s.tokens = Some(prompt.to_vec());
            s.reuse = reuse;
        }
        Ok(())
    }

    /// Turns on prefix caching (module docs); before any request is added.
    pub fn enable_prefix_caching(&mut self) {
        self.kv.enable_prefix_caching();
    }

    /// Whether blocks of generated tokens are offered to the prefix cache too (and taken back
    /// when a preempted request recomputes): only for a model whose decode steps write a
    /// position's KV with the bits a prefill of the same tokens writes (DeepSeek-V4; not the
    /// V3 family, whose generated positions take the absorbed MLA path). A second turn that
    /// repeats a whole first exchange then finds the answer's blocks too.
    pub fn set_share_generated(&mut self, on: bool) {
        self.share_generated = on;
    }
    pub fn shares_generated(&self) -> bool {
        self.share_generated
    }

    /// Blocks' cache rows depend on the `n` tokens after them (MTP: 1); see
    /// [`KvBlockManager::set_prefix_lookahead`]. Set before requests are added. A request's
    /// blocks are then offered to the prefix cache as its MTP rows are reported
    /// ([`Scheduler::mtp_computed`]).
    pub fn set_prefix_lookahead(&mut self, n: usize) {
        self.kv.set_prefix_lookahead(n);
    }

    /// The MTP layer's cache rows of `id`'s positions `first..upto` are written (a catch-up):
    /// its count of caught-up positions grows where the rows continue it.
    pub fn mtp_computed(&mut self, id: u64, first: usize, upto: usize) {
        if let Some(s) = self.seqs.get_mut(&id) {
            if first <= s.mtp_computed {
                s.mtp_computed = s.mtp_computed.max(upto);
            }
        }
    }

    /// After a step that failed part way (its scheduled tokens counted as computed, their KV
    /// perhaps never written): forgets the prefix cache, and the requests known now never
    /// register blocks.
    pub fn poison_prefix_cache(&mut self) {
        self.kv.clear_prefix_cache();
        for s in self.seqs.values_mut() {
            s.tokens = None;
            s.reuse = false;
        }
    }

    /// Extends `id`'s key list to its first `blocks` full blocks (as far as its tokens go).
    fn extend_keys(&mut self, id: u64, blocks: usize) {
        let bs = self.kv.block_size();
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let Some(tokens) = &s.tokens else { return };
        let la = self.kv.prefix_lookahead();
        let blocks = blocks.min(tokens.len().saturating_sub(la) / bs);
        while s.keys.len() < blocks {
            let i = s.keys.len();
            let key = block_key(s.keys.last().copied(), &tokens[i * bs..(i + 1) * bs + la]);
            s.keys.push(key);
        }
    }

    /// Offers `id`'s blocks of prompt tokens, all computed, to the prefix cache. Blocks that
    /// hold generated tokens are not offered unless [`Scheduler::set_share_generated`] says the
    /// model's decode steps write a prefill's bits: their KV was made by decode steps, and a
    /// later prompt that repeats them (a second turn) must get the KV a prefill makes (on the V3
    /// family the same only up to rounding: generated positions take the absorbed MLA path).
    /// With a prefix lookahead (MTP), a block is offered once the MTP layer's rows of all its
    /// positions are written too.
    fn register_computed(&mut self, id: u64) {
        if !self.kv.prefix_caching() {
            return;
        }
        let bs = self.kv.block_size();
        let la = self.kv.prefix_lookahead();
        let Some(s) = self.seqs.get(&id) else { return };
        if s.tokens.is_none() {
            return;
        }
        let mut done = if self.share_generated {
            s.num_computed
        } else {
            s.num_computed.min(s.prompt_len)
        };
        if la > 0 {
            done = done.min(s.mtp_computed);
        }
        let full = done / bs;
        if full <= s.registered {
            return;
        }
        self.extend_keys(id, full);
        let s = &self.seqs[&id];
        let tokens = s.tokens.as_deref().unwrap_or_default();
        let from = s.registered;
        let upto = full.min(s.keys.len());
        for i in from..upto {
            let parent = i.checked_sub(1).map(|j| s.keys[j]);
            self.kv
                .register(id, i, s.keys[i], parent, &tokens[i * bs..(i + 1) * bs + la]);
        }
        self.seqs.get_mut(&id).expect("known").registered = upto;
    }

    /// How many whole blocks a request admitted with nothing computed may take from the cache:
    /// its last known token always runs, and a recompute takes only blocks of its prompt (its
    /// generated tokens run as generated positions, with their decode steps' bits, where a
    /// longer prompt that holds the same tokens registered prompt-computed ones) unless
    /// generated blocks are shared (`share_generated`: the bits are the same either way).
    fn most_hits(s: &Seq, block_size: usize, share_generated: bool) -> usize {
        let known = (s.num_tokens - 1) / block_size;
        if share_generated {
            known
        } else {
            known.min(s.prompt_len / block_size)
        }
    }

    /// The cached blocks a request being admitted with nothing computed may take.
    fn prefix_hits(&mut self, id: u64) -> Vec<u32> {
        let s = &self.seqs[&id];
        if !s.reuse || s.num_computed != 0 || s.tokens.is_none() {
            return Vec::new();
        }
        let most = Self::most_hits(s, self.kv.block_size(), self.share_generated);
        self.extend_keys(id, most);
        let s = &self.seqs[&id];
        let keys = &s.keys[..most.min(s.keys.len())];
        self.kv
            .cached_prefix(keys, s.tokens.as_deref().unwrap_or_default())
    }

    /// Takes a request whose first `num_tokens - 1` tokens already have their KV (a prompt
    /// prefilled elsewhere, its KV transferred here; then one sampled token) straight into the
    /// running set, with blocks for those tokens. `Ok(false)` (nothing changed) when the batch
    /// is full or the pool lacks the blocks now (for its next step as well, and one per running
    /// request; with nothing running, any request the pool can hold fits); the caller writes the KV into
    /// [`Scheduler::block_table`] after `Ok(true)`.
    pub fn add_computed(
        &mut self,
        id: u64,
        prompt_len: usize,
        num_tokens: usize,
        max_len: usize,
    ) -> Result<bool, AdmissionError> {
        if prompt_len == 0 || num_tokens <= prompt_len {
            return Err(AdmissionError::EmptyPrompt);
        }
        let max_len = max_len.max(num_tokens);
        self.check_new(id, max_len)?;
        // Room for its next step too (its token and drafts), and a block for each running
        // request's next token, so that the step after placing it need not preempt it and throw
        // the transferred KV away.
        // (Drafts never pass max_len, as `drafts_for` says.)
        let ahead = (num_tokens + self.lookahead).min(max_len).max(num_tokens);
        let next = self.kv.blocks_for(ahead);
        let room =
            self.running.is_empty() || self.kv.pool().num_free() >= next + self.running.len();
        if self.running.len() >= self.cfg.batch_size
            || !room
            || !self.kv.allocate_slots(id, num_tokens - 1)
        {
            return Ok(false);
        }
        self.seqs.insert(
            id,
            Seq::new(
                num_tokens,
                num_tokens - 1,
                prompt_len,
                max_len,
                Phase::Running,
            ),
        );
        self.running.push(id);
        Ok(true)
    }

    /// Tokens of `id` whose KV is in the cache (0 for unknown ids).
    /// Tokens of `id` known to the scheduler (0 for an unknown id).
    pub fn num_known_tokens(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.num_tokens)
    }

    pub fn num_computed(&self, id: u64) -> usize {
        self.seqs.get(&id).map_or(0, |s| s.num_computed)
    }

    /// Plans the next step; the caller must run it (the scheduled tokens count as cached from
    /// now on) and then report each sampled token with [`Scheduler::append_token`].
    pub fn schedule(&mut self) -> Schedule {
        for i in 0..self.running.len() {
            self.register_computed(self.running[i]);
        }
        let mut budget = self.cfg.max_prefill_tokens;
        let mut out = Schedule::default();
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let len = self.chunk_len(id, budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let cover = self.seqs[&id].num_computed + len;
            let want = self.drafts_for(id, len);
            let mut drafts = 0;
            let mut scheduled = false;
            if want > 0 && self.kv.allocate_slots(id, cover + want) {
                drafts = want;
                scheduled = true;
            }
            while !scheduled {
                if self.kv.allocate_slots(id, cover) {
                    scheduled = true;
                    break;
                }
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
            if !scheduled {
                break;
            }
            budget -= self.take(id, len, drafts, &mut out);
            i += 1;
        }
        if out.preempted.is_empty() {
            // Prompt blocks running requests are computing (prefix caching).
            let mut in_flight: HashSet<BlockKey> = HashSet::new();
            if self.kv.prefix_caching() && !self.waiting.is_empty() {
                for i in 0..self.running.len() {
                    self.add_in_flight(self.running[i], &mut in_flight);
                }
            }
            // The queue position looked at: requests before it wait for blocks in flight.
            let mut at = 0;
            while self.running.len() < self.cfg.batch_size {
                let Some(&id) = self.waiting.get(at) else {
                    break;
                };
                let hits = self.prefix_hits(id);
                if self.waits_for(id, hits.len(), &in_flight) {
                    // A running request is computing its next block: it takes it from the
                    // cache once that is done, instead of computing it beside it; it keeps
                    // its place and the requests after it go on.
                    at += 1;
                    continue;
                }
                let cached = hits.len() * self.kv.block_size();
                let s = self.seqs.get_mut(&id).unwrap();
                s.num_computed = cached;
                // A shared block's MTP rows came with it (its key took the token after it).
                s.mtp_computed = cached;
                let len = self.chunk_len(id, budget);
                // A preempted request comes back (with its prompt's first chunk) only where
                // the pool has room for its generated tokens too: else the chunks recomputing
                // them would find no blocks and preempt it, the newest, again, step after
                // step, while the others run.
                let s = &self.seqs[&id];
                let resumed = s.num_tokens > s.prompt_len;
                if len == 0
                    || (resumed && !self.kv.fits_with_prefix(&hits, s.num_tokens))
                    || !self.kv.allocate_with_prefix(id, &hits, cached + len)
                {
                    self.seqs.get_mut(&id).unwrap().num_computed = 0;
                    break;
                }
                self.seqs.get_mut(&id).unwrap().registered = hits.len();
                self.waiting.remove(at);
                self.running.push(id);
                self.seqs.get_mut(&id).unwrap().phase = Phase::Running;
                budget -= self.take(id, len, 0, &mut out);
                let item = out.items.last_mut().expect("just taken");
                item.cached = cached;
                item.admitted = true;
                if self.kv.prefix_caching() {
                    self.add_in_flight(id, &mut in_flight);
                }
            }
        }
        out
    }

    /// Adds the keys of `id`'s whole prompt blocks that it has not offered to the prefix cache
    /// yet (it computes them in this step or later ones) to `keys`. Generated blocks in flight
    /// are not listed (a request whose next block one of them is computes it too: no harm, no
    /// wait).
    fn add_in_flight(&mut self, id: u64, keys: &mut HashSet<BlockKey>) {
        let s = &self.seqs[&id];
        if s.tokens.is_none() {
            return;
        }
        let full = s.prompt_len / self.kv.block_size();
        self.extend_keys(id, full);
        let s = &self.seqs[&id];
        let end = full.min(s.keys.len());
        keys.extend(s.keys[s.registered.min(end)..end].iter());
    }

    /// A waiting request that would take `hits` cached blocks should wait instead: the next
    /// block it would compute is one a running request is computing (`in_flight`). Requests
    /// that arrive together with the same prompt (a request's `n` choices, users of one system
    /// prompt) then compute it once. The running request makes progress every step it runs,
    /// so the wait ends.
    fn waits_for(&self, id: u64, hits: usize, in_flight: &HashSet<BlockKey>) -> bool {
        let s = &self.seqs[&id];
        if !s.reuse || in_flight.is_empty() {
            return false;
        }
        hits < Self::most_hits(s, self.kv.block_size(), self.share_generated).min(s.keys.len())
            && in_flight.contains(&s.keys[hits])
    }

    /// Tokens of `id` to schedule now given the prefill budget left.
    fn chunk_len(&self, id: u64, budget: usize) -> usize {
        let s = &self.seqs[&id];
        let remaining = s.num_tokens - s.num_computed;
        if remaining == 1 && s.num_computed >= s.prompt_len {
            // A decode token: not counted against the prefill budget.
            1
        } else if s.num_computed < s.prompt_len {
            // A recompute stops at the end of the prompt: its generated tokens run in chunks of
            // their own, so the model can compute them as their decode steps did.
            let rest = remaining.min(s.prompt_len - s.num_computed);
            if self.cfg.fixed_chunks {
                let b = self.cfg.max_prefill_tokens.max(1);
                let chunk = rest.min(b - s.num_computed % b);
                if chunk <= budget {
                    chunk
                } else {
                    0
                }
            } else {
                rest.min(budget)
            }
        } else {
            remaining.min(budget)
        }
    }

    /// Draft slots to ask for when `id` gets `len` tokens: only a decode token gets them, at
    /// most the lookahead, and never more than the request may still generate after the token
    /// the step samples anyway.
    fn drafts_for(&self, id: u64, len: usize) -> usize {
        let s = &self.seqs[&id];
        let decode =
            len == 1 && s.num_tokens - s.num_computed == 1 && s.num_computed >= s.prompt_len;
        if !decode {
            return 0;
        }
        self.lookahead
            .min(s.max_len.saturating_sub(s.num_tokens + 1))
    }

    /// Records `len` tokens (and `drafts` draft slots) of `id` as scheduled; returns the prefill
    /// budget they use.
    fn take(&mut self, id: u64, len: usize, drafts: usize, out: &mut Schedule) -> usize {
        let s = self.seqs.get_mut(&id).unwrap();
        let start = s.num_computed;
        s.num_computed += len;
        s.pending_drafts = drafts;
        let sample = s.num_computed == s.num_tokens;
        let decode = len == 1 && start >= s.prompt_len;
        out.items.push(Scheduled {
            id,
            start,
            len,
            sample,
            decode,
            drafts,
            cached: 0,
            admitted: false,
        });
        if decode {
            0
        } else {
            len
        }
    }

    fn preempt(&mut self, id: u64) {
        self.register_computed(id);
        self.kv.free(id);
        let s = self.seqs.get_mut(&id).unwrap();
        s.num_computed = 0;
        s.registered = 0;
        s.mtp_computed = 0;
        s.pending_drafts = 0;
        s.phase = Phase::Waiting;
        s.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// A token sampled for `id` (after a step that had `sample` set for it).
    pub fn append_token(&mut self, id: u64) {
        self.append_tokens(id, 1);
    }

    /// `n` tokens appended to `id` (after speculative verification: the accepted drafts and the
    /// token sampled after them).
    /// A request added with its tokens stops taking part in prefix caching here (its token
    /// list would be stale): give it [`Scheduler::append_token_ids`] instead.
    pub fn append_tokens(&mut self, id: u64, n: usize) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.num_tokens += n;
            s.tokens = None;
            s.reuse = false;
        }
    }

    /// [`Scheduler::append_tokens`] with the tokens themselves (a request added with
    /// [`Scheduler::add_prompt`] keeps its token list for prefix caching).
    pub fn append_token_ids(&mut self, id: u64, ids: &[u32]) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.num_tokens += ids.len();
            if let Some(t) = &mut s.tokens {
                t.extend_from_slice(ids);
            }
        }
    }

    /// Ends the speculative part of a step for `id`: `accepted` of the drafts verified after
    /// its known token were kept (their KV now counts as computed); the slots of the rejected
    /// ones stop counting and blocks held only for them go back to the pool. Call before
    /// appending the step's tokens. Unknown ids are ignored.
    pub fn accept_drafts(&mut self, id: u64, accepted: usize) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        let accepted = accepted.min(s.pending_drafts);
        s.num_computed += accepted;
        s.pending_drafts = 0;
        let computed = s.num_computed;
        self.kv.trim(id, computed);
    }

    /// Removes a request (finished or aborted) and frees its blocks. Unknown ids are ignored.
    pub fn finish(&mut self, id: u64) {
        self.register_computed(id);
        if self.seqs.remove(&id).is_none() {
            return;
        }
        self.kv.free(id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
    }

    /// Every block free or held by as many tables as its count (only registered blocks by
    /// several); running requests hold blocks covering
    /// their computed tokens, waiting ones none. For tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        for (&id, _) in self.kv.holders() {
            if !self.running.contains(&id) {
                return Err(format!("request {id} holds blocks but is not running"));
            }
        }
        for &id in &self.running {
            let s = &self.seqs[&id];
            let held = self.kv.block_table(id).len();
            let need = self.kv.blocks_for(s.num_computed + s.pending_drafts);
            if held != need {
                return Err(format!(
                    "request {id} holds {held} blocks but its {} computed tokens and {} draft \
                     slots need exactly {need}",
                    s.num_computed, s.pending_drafts
                ));
            }
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err("a request is lost or listed twice".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sched(blocks: usize, bs: usize, batch: usize, budget: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                batch_size: batch,
                max_prefill_tokens: budget,
                fixed_chunks: false,
            },
            KvBlockManager::new(blocks, bs),
        )
    }

    /// A prefilled request is placed with room for its next step, and one that fills the
    /// whole pool still fits an empty one (drafts never pass its last position).
    #[test]
    fn computed_requests_get_headroom_and_a_full_pool_request_still_fits() {
        // 8 usable blocks of 4 tokens = 32 positions; lookahead 3.
        let mut s = sched(9, 4, 4, 64);
        s.set_lookahead(3);
        assert_eq!(s.add_computed(1, 29, 30, 32), Ok(true));
        s.check_invariants().unwrap();
        s.finish(1);
        // Running requests keep a block each for their next token.
        let mut s = sched(9, 4, 4, 64);
        assert_eq!(s.add_computed(1, 8, 9, 12), Ok(true));
        assert_eq!(s.kv().pool().num_free(), 6);
        // 5 blocks for 17 tokens + 1 for the running one: 6 free, fits.
        assert_eq!(s.add_computed(2, 16, 17, 20), Ok(true));
        // Nothing left: waits (no change), and a second id is refused as a duplicate.
        assert_eq!(s.add_computed(3, 3, 4, 6), Ok(false));
        assert_eq!(
            s.add_computed(2, 3, 4, 6),
            Err(AdmissionError::Duplicate(2))
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn long_prompt_is_chunked_and_decodes_batch() {
        let mut s = sched(64, 4, 8, 10);
        s.add(1, 25, 30).unwrap();
        s.add(2, 3, 10).unwrap();
        let p = s.schedule();
        assert_eq!(p.items.len(), 1, "{p:?}");
        assert_eq!(
            (p.items[0].start, p.items[0].len, p.items[0].sample),
            (0, 10, false)
        );
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].len), (10, 10));
        let p = s.schedule();
        assert_eq!(
            (p.items[0].start, p.items[0].len, p.items[0].sample),
            (20, 5, true)
        );
        // Request 2 is admitted into the same step with the 5 tokens of budget left.
        assert_eq!(p.items[1].id, 2);
        assert_eq!((p.items[1].len, p.items[1].sample), (3, true));
        s.append_token(1);
        s.append_token(2);
        let p = s.schedule();
        assert!(p.items.iter().all(|i| i.decode && i.len == 1), "{p:?}");
    }

    #[test]
    fn fixed_chunks_wait_rather_than_cut_shorter() {
        let mut s = sched(64, 4, 8, 10);
        s.cfg.fixed_chunks = true;
        s.add(1, 25, 30).unwrap();
        s.add(2, 3, 10).unwrap();
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].len), (0, 10));
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].len), (10, 10));
        // 5 left of 1's prompt, and 2's 3 tokens fit the 5 of budget left.
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].len), (20, 5));
        assert_eq!((p.items[1].id, p.items[1].len), (2, 3));
        // A prompt that would be cut by the budget left waits for the next step.
        let mut s = sched(64, 4, 8, 10);
        s.cfg.fixed_chunks = true;
        s.add(1, 7, 30).unwrap();
        s.add(2, 6, 30).unwrap();
        let p = s.schedule();
        assert_eq!(p.items.len(), 1, "{p:?}");
        s.append_token(1);
        let p = s.schedule();
        assert_eq!(p.items.len(), 2, "{p:?}");
        assert_eq!((p.items[1].id, p.items[1].start, p.items[1].len), (2, 0, 6));
        // Without fixed chunks the second prompt takes the 3 left in the first step.
        let mut s = sched(64, 4, 8, 10);
        s.add(1, 7, 30).unwrap();
        s.add(2, 6, 30).unwrap();
        let p = s.schedule();
        assert_eq!((p.items[1].id, p.items[1].len), (2, 3), "{p:?}");
    }

    #[test]
    fn too_long_requests_are_refused_up_front() {
        let mut s = sched(3, 4, 8, 10);
        assert!(matches!(
            s.add(1, 5, 9),
            Err(AdmissionError::TooLong {
                blocks: 3,
                capacity: 2,
                ..
            })
        ));
        s.add(1, 5, 8).unwrap();
        assert_eq!(s.add(1, 5, 8), Err(AdmissionError::Duplicate(1)));
        assert_eq!(s.add(2, 0, 8), Err(AdmissionError::EmptyPrompt));
    }

    #[test]
    fn full_pool_preempts_the_newest_and_recomputes_it() {
        // 4 usable blocks of 2 tokens; two requests of 3-token prompts growing to 8.
        let mut s = sched(5, 2, 4, 100);
        s.add(1, 3, 8).unwrap();
        s.add(2, 3, 8).unwrap();
        let p = s.schedule();
        assert_eq!(p.items.len(), 2);
        s.append_token(1);
        s.append_token(2);
        // Both now need 4 positions cached = 2 blocks each: fits.
        let p = s.schedule();
        assert_eq!(p.items.len(), 2);
        s.append_token(1);
        s.append_token(2);
        // Now 5 positions = 3 blocks each: request 2 is preempted.
        let p = s.schedule();
        assert_eq!(p.preempted, vec![2]);
        assert_eq!(p.items.len(), 1);
        assert_eq!(s.phase(2), Some(Phase::Waiting));
        s.check_invariants().unwrap();
        s.finish(1);
        // Request 2 comes back and recomputes its 3-token prompt, then its 2 generated tokens
        // in a chunk of their own (computed as generated positions), then samples.
        let p = s.schedule();
        assert_eq!(p.items[0].id, 2);
        assert_eq!(
            (p.items[0].start, p.items[0].len, p.items[0].sample),
            (0, 3, false)
        );
        assert!(!p.items[0].decode);
        let p = s.schedule();
        assert_eq!(
            (p.items[0].start, p.items[0].len, p.items[0].sample),
            (3, 2, true)
        );
        assert!(!p.items[0].decode);
        assert_eq!(s.num_preemptions(2), 1);
    }

    /// A preempted request comes back only when the pool has room for its generated tokens
    /// too: admitted with its prompt chunk alone, it would preempt itself at the next step,
    /// again and again while the others run.
    #[test]
    fn a_preempted_request_is_not_readmitted_to_be_preempted_again() {
        // 8 usable blocks of 4 tokens; three 4-token prompts growing to 24 tokens each.
        let mut s = sched(9, 4, 3, 100);
        for id in 1..=3 {
            s.add(id, 4, 24).unwrap();
        }
        let mut preempted = 0;
        let mut steps = 0;
        while s.has_unfinished() {
            let p = s.schedule();
            preempted += p.preempted.len();
            for item in &p.items {
                if item.sample {
                    s.append_token(item.id);
                    if s.num_known_tokens(item.id) == 24 {
                        s.finish(item.id);
                    }
                }
            }
            s.check_invariants().unwrap();
            steps += 1;
            assert!(steps < 500, "no progress");
        }
        // Request 3 is preempted once when the pool fills, and request 2 once when request 1
        // needs its last blocks; each comes back only when it fits and then runs to its end.
        assert!(preempted <= 3, "{preempted} preemptions in {steps} steps");
    }

    #[test]
    fn a_full_queue_waits_instead_of_spinning() {
        let mut s = sched(3, 4, 8, 100);
        s.add(1, 8, 8).unwrap();
        s.add(2, 4, 8).unwrap();
        let p = s.schedule();
        assert_eq!(p.items.len(), 1);
        assert_eq!(s.num_waiting(), 1);
        s.finish(1);
        let p = s.schedule();
        assert_eq!(p.items[0].id, 2);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Add { prompt: usize, out: usize },
        Step,
        Abort(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..40, 1usize..12).prop_map(|(prompt, out)| Op::Add { prompt, out }),
            Just(Op::Step),
            Just(Op::Step),
            Just(Op::Step),
            (0u64..20).prop_map(Op::Abort),
        ]
    }

    /// What the engine does after a forward: for every sampled item, `accept(drafts)` of its
    /// drafts are kept (none without speculation) and one more token is sampled; a request
    /// stops once it has all its tokens (`lens[id].1`), possibly among the accepted drafts.
    fn complete_spec_step(
        s: &mut Scheduler,
        plan: &Schedule,
        lens: &HashMap<u64, (usize, usize)>,
        generated: &mut HashMap<u64, usize>,
        mut accept: impl FnMut(usize) -> usize,
    ) {
        for it in plan.items.iter().filter(|it| it.sample) {
            let a = accept(it.drafts).min(it.drafts);
            let g = generated.entry(it.id).or_default();
            let want = lens[&it.id].1;
            let emitted = (a + 1).min(want - *g);
            *g += emitted;
            if *g >= want {
                s.finish(it.id);
            } else {
                if it.drafts > 0 {
                    s.accept_drafts(it.id, a);
                }
                s.append_tokens(it.id, emitted);
            }
        }
    }

    #[test]
    fn drafts_get_slots_only_in_decode_and_rejected_ones_give_blocks_back() {
        // Blocks of 2 tokens; a 3-token prompt growing to 12.
        let mut s = sched(16, 2, 4, 100);
        s.set_lookahead(3);
        s.add(1, 3, 12).unwrap();
        let p = s.schedule();
        assert_eq!(
            (p.items[0].len, p.items[0].drafts),
            (3, 0),
            "prefill gets no drafts"
        );
        s.append_token(1);
        // Decode: token 3 plus 3 drafts at positions 4..7 -> 7 positions, 4 blocks.
        let p = s.schedule();
        assert_eq!(
            (p.items[0].start, p.items[0].len, p.items[0].drafts),
            (3, 1, 3)
        );
        assert_eq!(s.block_table(1).len(), 4);
        s.check_invariants().unwrap();
        // None accepted: 4 positions computed, 2 blocks kept.
        s.accept_drafts(1, 0);
        s.append_tokens(1, 1);
        assert_eq!(s.block_table(1).len(), 2);
        s.check_invariants().unwrap();
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].drafts), (4, 3));
        // All accepted: positions 0..8 computed, 4 more tokens known (9 tokens).
        s.accept_drafts(1, 3);
        s.append_tokens(1, 4);
        assert_eq!(s.block_table(1).len(), 4);
        s.check_invariants().unwrap();
        // 9 of 12 tokens known: at most 2 drafts still make sense.
        let p = s.schedule();
        assert_eq!((p.items[0].start, p.items[0].drafts), (8, 2));
    }

    #[test]
    fn a_pool_too_full_for_drafts_decodes_plainly_instead_of_preempting() {
        // 3 usable blocks of 4; two requests of 2-token prompts hold one block each.
        let mut s = sched(4, 4, 4, 100);
        s.set_lookahead(2);
        s.add(1, 2, 8).unwrap();
        s.add(2, 2, 8).unwrap();
        let p = s.schedule();
        assert_eq!(p.items.len(), 2);
        s.append_token(1);
        s.append_token(2);
        // Request 1's token and 2 drafts (positions 2..5) take the free block; request 2's
        // drafts would need another, so it decodes plainly and nobody is preempted.
        let p = s.schedule();
        assert!(p.preempted.is_empty(), "{p:?}");
        assert_eq!((p.items[0].drafts, p.items[1].drafts), (2, 0), "{p:?}");
        s.check_invariants().unwrap();
        s.accept_drafts(1, 1);
        s.append_tokens(1, 2);
        s.accept_drafts(2, 0);
        s.append_token(2);
        s.check_invariants().unwrap();
        assert_eq!(s.kv().pool().num_free(), 1);
    }

    /// Applies `ops` (steps completed by [`complete_spec_step`] with `accept`), checking the
    /// invariants after every schedule and every operation; then finishes whatever is left (a
    /// full pool makes progress) and checks every block is back.
    fn run_ops(
        mut s: Scheduler,
        lookahead: usize,
        ops: Vec<Op>,
        accept: &mut dyn FnMut(usize) -> usize,
    ) -> Result<(), TestCaseError> {
        s.set_lookahead(lookahead);
        let mut lens = HashMap::new();
        let mut generated: HashMap<u64, usize> = HashMap::new();
        let mut next_id = 0u64;
        for op in ops {
            match op {
                Op::Add { prompt, out } => {
                    if s.add(next_id, prompt, prompt + out).is_ok() {
                        lens.insert(next_id, (prompt, out));
                    }
                    next_id += 1;
                }
                Op::Abort(id) => s.finish(id),
                Op::Step => {
                    let plan = s.schedule();
                    s.check_invariants().map_err(TestCaseError::fail)?;
                    if s.has_unfinished() {
                        prop_assert!(!plan.is_empty(), "nothing scheduled");
                    }
                    let cfg = s.config();
                    for it in &plan.items {
                        prop_assert!(it.drafts == 0 || it.decode, "{:?}", it);
                        prop_assert!(it.drafts <= lookahead);
                        let prompt = lens[&it.id].0;
                        if cfg.fixed_chunks && it.start < prompt {
                            // Every prompt cut at the same places: multiples of the budget.
                            let b = cfg.max_prefill_tokens;
                            let end = it.start + it.len;
                            prop_assert!(it.start % b == 0, "{:?}", it);
                            prop_assert!(end % b == 0 || end == prompt, "{:?}", it);
                        }
                    }
                    complete_spec_step(&mut s, &plan, &lens, &mut generated, &mut *accept);
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        let left: HashMap<u64, (usize, usize)> = lens
            .iter()
            .map(|(&id, &(p, o))| {
                let done = generated.get(&id).copied().unwrap_or(0);
                (id, (p, o.saturating_sub(done).max(1)))
            })
            .collect();
        let mut generated = HashMap::new();
        for step in 0..10_000 {
            if !s.has_unfinished() {
                break;
            }
            let plan = s.schedule();
            s.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert!(!plan.is_empty(), "step {} scheduled nothing", step);
            complete_spec_step(&mut s, &plan, &left, &mut generated, &mut *accept);
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        prop_assert!(!s.has_unfinished(), "not done after 10 000 steps");
        prop_assert_eq!(s.kv().pool().num_free(), s.kv().pool().capacity());
        Ok(())
    }

    /// Requests that arrive together with the same prompt compute it once: the second waits
    /// while the first computes the blocks, then takes them; a request behind it goes on.
    #[test]
    fn requests_arriving_together_compute_a_shared_prompt_once() {
        let mut s = sched(64, 4, 8, 100);
        s.enable_prefix_caching();
        let t: Vec<u32> = (0..18).collect();
        s.add_prompt(1, &t, 30, true).unwrap();
        s.add_prompt(2, &t, 30, true).unwrap();
        s.add_prompt(3, &[7, 7, 7], 10, true).unwrap();
        let p = s.schedule();
        let ids: Vec<u64> = p.items.iter().map(|i| i.id).collect();
        assert_eq!(ids, [1, 3], "{p:?}");
        assert_eq!(p.items[0].len, 18);
        assert_eq!(s.num_waiting(), 1);
        s.append_token_ids(1, &[5]);
        s.append_token_ids(3, &[5]);
        let p = s.schedule();
        let two = p.items.iter().find(|i| i.id == 2).unwrap();
        assert_eq!((two.cached, two.start, two.len), (16, 16, 2));
        // A prompt to be scored does not wait (it takes nothing from the cache).
        let mut s = sched(64, 4, 8, 100);
        s.enable_prefix_caching();
        s.add_prompt(1, &t, 30, true).unwrap();
        s.add_prompt(2, &t, 30, false).unwrap();
        assert_eq!(s.schedule().items.len(), 2);
        s.check_invariants().unwrap();
    }

    /// With a prefix lookahead of one token (MTP), a computed block is offered only once its
    /// MTP rows are reported, and taken only by a request whose token after it is the same.
    #[test]
    fn mtp_blocks_wait_for_their_rows_and_match_the_next_token() {
        let mut s = sched(64, 4, 8, 100);
        s.enable_prefix_caching();
        s.set_prefix_lookahead(1);
        let t: Vec<u32> = (0..10).collect();
        s.add_prompt(1, &t, 30, true).unwrap();
        assert_eq!(s.schedule().items[0].len, 10);
        s.append_token_ids(1, &[77]);
        // Computed, but no MTP row yet: nothing to share.
        s.schedule();
        assert_eq!(s.kv().num_cached_blocks(), 0);
        // The catch-up wrote rows 0..10 (not after a gap: rows 12.. alone change nothing).
        s.mtp_computed(1, 12, 14);
        s.schedule();
        assert_eq!(s.kv().num_cached_blocks(), 0);
        s.mtp_computed(1, 0, 10);
        s.append_token_ids(1, &[78]);
        s.schedule();
        assert_eq!(s.kv().num_cached_blocks(), 2);
        // Same first 8 tokens, then the token after block 1 differs: one block shared.
        let mut other = t[..8].to_vec();
        other.extend([99, 9, 3]);
        s.add_prompt(2, &other, 30, true).unwrap();
        // Same first 9 tokens: both blocks.
        s.add_prompt(
            3,
            &t[..9].iter().copied().chain([5, 5]).collect::<Vec<_>>(),
            30,
            true,
        )
        .unwrap();
        let p = s.schedule();
        let cached = |id| p.items.iter().find(|i| i.id == id).unwrap().cached;
        assert_eq!((cached(2), cached(3)), (4, 8), "{p:?}");
        s.check_invariants().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Speculative decoding with any lookahead and any acceptance pattern (many rejected
        /// drafts): block accounting stays exact at every point (a running request holds
        /// exactly the blocks of its computed tokens and draft slots, nothing leaked or shared),
        /// and at the end every block is back in the pool.
        #[test]
        fn draft_blocks_are_exact_under_rejections(
            blocks in 2usize..24,
            bs in 1usize..6,
            batch in 1usize..6,
            budget in 1usize..20,
            lookahead in 1usize..4,
            ops in proptest::collection::vec(op(), 1..80),
            accepts in proptest::collection::vec(0usize..4, 1..64),
        ) {
            let mut k = 0usize;
            let mut accept = |n: usize| {
                k += 1;
                accepts[k % accepts.len()].min(n)
            };
            run_ops(sched(blocks, bs, batch, budget), lookahead, ops, &mut accept)?;
        }

        /// After any sequence of admissions, chunked prefills, finishes, aborts and
        /// preemptions, no block is leaked or owned twice; then everything finishes.
        #[test]
        fn blocks_are_never_leaked_or_shared(
            blocks in 2usize..24,
            bs in 1usize..6,
            batch in 1usize..6,
            budget in 1usize..20,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            run_ops(sched(blocks, bs, batch, budget), 0, ops, &mut |_| 0)?;
        }

        /// The same with every prompt cut at fixed places (a C8 cache): no prompt chunk is cut
        /// by what else runs, and every step still makes progress.
        #[test]
        fn fixed_chunks_cut_every_prompt_alike(
            blocks in 2usize..24,
            bs in 1usize..6,
            batch in 1usize..6,
            budget in 1usize..20,
            lookahead in 0usize..3,
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut s = sched(blocks, bs, batch, budget);
            s.cfg.fixed_chunks = true;
            run_ops(s, lookahead, ops, &mut |n| n / 2)?;
        }

        /// Prefix caching under any sequence of admissions, chunked prefills, finishes,
        /// aborts and preemptions: every KV a step reads is what the request itself would have
        /// written, a shared block is never written, nothing leaks (`run_cached`); with blocks
        /// of generated tokens shared too (`share`) or not.
        #[test]
        fn prefix_cache_reads_are_exact_and_blocks_balance(
            blocks in 2usize..24,
            bs in 1usize..6,
            batch in 1usize..6,
            budget in 1usize..20,
            share in proptest::bool::ANY,
            ops in proptest::collection::vec(cached_op(), 1..80),
        ) {
            run_cached(blocks, bs, batch, budget, share, ops)?;
        }
    }

    /// What the simulated cache holds at a position: a hash of the tokens up to it (the KV a
    /// causal model writes there depends on exactly those).
    fn prefix_id(tokens: &[u32]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        tokens.hash(&mut h);
        h.finish()
    }

    /// The next token of a deterministic "model" (greedy: the same prefix, the same token).
    fn next_token(tokens: &[u32]) -> u32 {
        (prefix_id(tokens) % 3) as u32 + 1
    }

    #[derive(Clone, Debug)]
    enum CachedOp {
        /// A prompt of the first `shared` tokens of a common text, then `tail` tokens of its
        /// own, generating `out` tokens.
        Add {
            shared: usize,
            tail: usize,
            out: usize,
        },
        Step,
        Abort(u64),
    }

    fn cached_op() -> impl Strategy<Value = CachedOp> {
        prop_oneof![
            (1usize..30, 0usize..3, 1usize..10).prop_map(|(shared, tail, out)| CachedOp::Add {
                shared,
                tail,
                out
            }),
            Just(CachedOp::Step),
            Just(CachedOp::Step),
            Just(CachedOp::Step),
            (0u64..20).prop_map(CachedOp::Abort),
        ]
    }

    /// Runs `ops` with prefix caching through a simulated cache: every position a step reads
    /// (before its first scheduled token) must hold what the request's own tokens would have
    /// written there, no step writes a block another request holds, cached tokens are whole
    /// blocks short of the last known token, and the invariants hold throughout; then
    /// everything finishes with every block back. Returns the tokens taken from the cache.
    fn run_cached(
        blocks: usize,
        bs: usize,
        batch: usize,
        budget: usize,
        share_generated: bool,
        ops: Vec<CachedOp>,
    ) -> Result<usize, TestCaseError> {
        let mut s = sched(blocks, bs, batch, budget);
        s.enable_prefix_caching();
        s.set_share_generated(share_generated);
        let common: Vec<u32> = (0..40u32).map(|i| i * 7 % 5 + 1).collect();
        let mut cache: Vec<Vec<Option<u64>>> = vec![vec![None; bs]; blocks];
        let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut left: HashMap<u64, usize> = HashMap::new();
        let mut hits = 0usize;
        let step = |s: &mut Scheduler,
                    toks: &mut HashMap<u64, Vec<u32>>,
                    left: &mut HashMap<u64, usize>,
                    cache: &mut Vec<Vec<Option<u64>>>|
         -> Result<usize, TestCaseError> {
            let plan = s.schedule();
            s.check_invariants().map_err(TestCaseError::fail)?;
            if s.has_unfinished() {
                prop_assert!(!plan.is_empty(), "nothing scheduled");
            }
            let mut taken = 0;
            for it in &plan.items {
                let t = &toks[&it.id];
                let table = s.block_table(it.id).to_vec();
                prop_assert!(it.cached % bs == 0 && it.cached < t.len(), "{:?}", it);
                prop_assert!(it.cached == 0 || it.admitted);
                taken += it.cached;
                for pos in 0..it.start {
                    prop_assert_eq!(
                        cache[table[pos / bs] as usize][pos % bs],
                        Some(prefix_id(&t[..=pos])),
                        "request {} reads a wrong KV at {}",
                        it.id,
                        pos
                    );
                }
                for pos in it.start..it.start + it.len {
                    let b = table[pos / bs];
                    prop_assert_eq!(s.kv().pool().holders(b), 1, "block {} is shared", b);
                    cache[b as usize][pos % bs] = Some(prefix_id(&t[..=pos]));
                }
            }
            for it in plan.items.iter().filter(|it| it.sample) {
                let t = toks.get_mut(&it.id).unwrap();
                let next = next_token(t);
                t.push(next);
                let l = left.get_mut(&it.id).unwrap();
                *l -= 1;
                if *l == 0 {
                    s.finish(it.id);
                } else {
                    s.append_token_ids(it.id, &[next]);
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
            Ok(taken)
        };
        let mut next_id = 0u64;
        for op in ops {
            match op {
                CachedOp::Add { shared, tail, out } => {
                    let mut prompt = common[..shared].to_vec();
                    prompt.extend((0..tail).map(|i| (next_id as u32 + i as u32) % 4 + 1));
                    if s.add_prompt(next_id, &prompt, prompt.len() + out, true)
                        .is_ok()
                    {
                        toks.insert(next_id, prompt);
                        left.insert(next_id, out);
                    }
                    next_id += 1;
                }
                CachedOp::Abort(id) => s.finish(id),
                CachedOp::Step => hits += step(&mut s, &mut toks, &mut left, &mut cache)?,
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        for _ in 0..10_000 {
            if !s.has_unfinished() {
                break;
            }
            hits += step(&mut s, &mut toks, &mut left, &mut cache)?;
        }
        prop_assert!(!s.has_unfinished(), "not done after 10 000 steps");
        prop_assert_eq!(s.kv().pool().num_free(), s.kv().pool().capacity());
        Ok(hits)
    }

    /// Requests with the same first blocks share them; a recompute after preemption and a
    /// prompt that extends an earlier request's whole text (a second turn) take cached blocks
    /// too, those of its prompt (blocks of generated tokens are not registered).
    #[test]
    fn shared_prefixes_are_taken_from_the_cache() {
        let ops = |n: usize| {
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(CachedOp::Add {
                    shared: 17,
                    tail: 1,
                    out: 6,
                });
                v.push(CachedOp::Step);
            }
            v
        };
        // Roomy pool: every request after the first takes 4 blocks of 4 (16 of its 18 tokens).
        let hits = run_cached(64, 4, 8, 64, false, ops(4)).unwrap();
        assert_eq!(hits, 3 * 16);
        // A tight pool preempts and recomputes, still exact, with generated blocks shared or
        // not.
        run_cached(9, 4, 4, 8, false, ops(6)).unwrap();
        run_cached(9, 4, 4, 8, true, ops(6)).unwrap();
        // A second turn: of the first request's prompt and output (17 + 7 = 24 tokens, all
        // computed), the 4 whole blocks of its prompt are registered, and the new prompt of 27
        // tokens takes them.
        // A first exchange: a 17-token prompt, then 7 tokens each appended and scheduled
        // (all 24 positions computed); its scheduler and token list.
        let first_exchange = |share_generated: bool| {
            let mut s = sched(64, 4, 8, 64);
            s.enable_prefix_caching();
            s.set_share_generated(share_generated);
            let mut t: Vec<u32> = (0..17).map(|i| i % 3 + 1).collect();
            s.add_prompt(1, &t, 30, true).unwrap();
            let p = s.schedule();
            assert_eq!(p.items[0].len, 17);
            for _ in 0..7 {
                let next = next_token(&t);
                t.push(next);
                s.append_token_ids(1, &[next]);
                s.schedule();
            }
            s.finish(1);
            (s, t)
        };
        let (mut s, mut t) = first_exchange(false);
        assert_eq!(s.kv().num_cached_blocks(), 4);
        t.extend([9, 9, 9]);
        s.add_prompt(2, &t, 40, true).unwrap();
        let p = s.schedule();
        assert_eq!((p.items[0].cached, p.items[0].start), (16, 16));
        // Without reuse (a prompt to be scored) nothing is taken.
        s.add_prompt(3, &t, 40, false).unwrap();
        let p = s.schedule();
        let it = p.items.iter().find(|i| i.id == 3).unwrap();
        assert_eq!((it.cached, it.start, it.len), (0, 0, 27));
        s.check_invariants().unwrap();

        // Sharing generated blocks (DeepSeek-V4): all 24 positions of the first exchange are
        // computed here (each appended token is scheduled), so its 6 blocks are registered,
        // generated ones too, and the second turn takes them all.
        let (mut s, mut t) = first_exchange(true);
        assert_eq!(s.kv().num_cached_blocks(), 6);
        t.extend([9, 9, 9]);
        s.add_prompt(2, &t, 40, true).unwrap();
        let p = s.schedule();
        assert_eq!((p.items[0].cached, p.items[0].start), (24, 24));
        s.check_invariants().unwrap();
    }
}
